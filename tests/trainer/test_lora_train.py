"""A tiny training run with `lora.rank` > 0: only the adapter moves (base weights bit-identical,
optimizer state and checkpoint hold the adapter alone), and the run's adapter/ folder loads
onto the HF student with PEFT and gives our final student's logits; export_merged writes the
merged model, which transformers loads to the same logits."""
import shutil

import numpy as np
import pytest
import torch
import yaml
from flax import nnx
from transformers import AutoModelForCausalLM

from conftest import tiny_tree
from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.config import load_config
from ctopd_jax.loop.trainer import Trainer
from ctopd_jax.models import lora, weights
from test_wandb import _history

peft = pytest.importorskip("peft", reason="pip install -e '.[test]' (peft)")


@pytest.mark.slow
def test_lora_run_trains_only_the_adapter_and_writes_a_peft_adapter(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tree = tiny_tree(tmp_path / "run", steps=2, **{
        "lora.rank": 4, "lora.alpha": 8.0, "lora.target_modules": ["q_proj", "v_proj", "up_proj"],
        "checkpoint.every": 1, "checkpoint.export_hf": True, "checkpoint.export_merged": True,
        "checkpoint.async_save": False, "optimizer.lr": 1e-2,
        "logging.wandb": True, "logging.wandb_mode": "offline"})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    trainer = Trainer(load_config(path))
    base_before = jax_host(nnx.state(trainer.student, nnx.Not(lora.LoraParam)))
    adapter_size = lora.parameter_count(trainer.student)
    full_size = lora.parameter_count(trainer.student, adapters_only=False) - adapter_size
    assert 0 < adapter_size < full_size // 10
    assert sum(x.size for x in jax_leaves(trainer.params)) == adapter_size
    assert sum(x.size for x in jax_leaves(trainer.opt_state)) < 2 * adapter_size + 100
    # the student is a random tiny model: its HF form (B = 0, so the base exactly) for PEFT
    weights.export_hf_checkpoint(trainer.student, trainer.student.cfg, tmp_path / "base")
    result = trainer.train()

    after = jax_host(nnx.state(trainer.student, nnx.Not(lora.LoraParam)))
    for (path_, a), (_, b) in zip(nnx.to_flat_state(after), nnx.to_flat_state(base_before)):
        np.testing.assert_array_equal(a, b, err_msg=str(path_))
    b = np.asarray(trainer.student.layers[0].attn.q_proj_lora_b[...])
    assert np.abs(b).max() > 0  # the adapter moved

    run_dir = result.run_dir
    base_dir = tmp_path / "base"
    ids = np.random.RandomState(0).randint(3, 200, (2, 9))
    ours = np.asarray(trainer.student(ids.astype(np.int32), np.broadcast_to(
        np.arange(9, dtype=np.int32), ids.shape)))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    peft_model = peft.PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(ids)).logits.numpy()
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf_student",
                                                      dtype=torch.float32).eval()
        merged_logits = merged(torch.tensor(ids)).logits.numpy()
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(merged_logits, theirs, rtol=0, atol=1e-5 * scale)

    # Resume from the step-1 checkpoint (adapter-only parameters and optimizer state): the same
    # adapter as the uninterrupted run, bit for bit, and the same wandb run continued.
    final = jax_host(nnx.state(trainer.student, lora.LoraParam))
    run_id = (run_dir / "wandb_run_id").read_text()
    shutil.rmtree(run_dir / "checkpoints" / "2")
    again = Trainer(load_config(path))
    again.train(resume=True)
    resumed = jax_host(nnx.state(again.student, lora.LoraParam))
    for (path_, a), (_, b) in zip(nnx.to_flat_state(resumed), nnx.to_flat_state(final)):
        np.testing.assert_array_equal(a, b, err_msg=str(path_))
    assert (run_dir / "wandb_run_id").read_text() == run_id
    runs = sorted((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*"))
    assert [f.name for r in runs for f in r.glob("*.wandb")] == [f"run-{run_id.strip()}.wandb"] * 2
    logged = [h for r in runs for h in _history(next(r.glob("*.wandb")))[0]]
    assert [h["_step"] for h in logged] == [1, 2, 2]
    for row, history in zip(read_metrics(run_dir), logged[::2]):  # rows of steps 1 and 2
        assert set(row) - {"step"} <= set(history)


def jax_host(state):
    import jax

    return jax.tree.map(np.asarray, state)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _dropout_run(tmp_path, name, *overrides):
    """configs/tiny_cpu_same_lora.yaml for 2 small steps (2 micro-batches each); the adapter."""
    from pathlib import Path

    config = load_config(Path(__file__).parents[2] / "configs" / "tiny_cpu_same_lora.yaml", [
        f"output_dir={tmp_path / name}", "steps=2", "rollout.rollout_batch_size=8",
        "optimizer.train_batch_size=8", "optimizer.micro_batch_size=4", "optimizer.lr=1e-2",
        "checkpoint.every=0", "checkpoint.export_hf=false", "checkpoint.export_merged=false",
        "checkpoint.async_save=false", "logging.tensorboard=false", "logging.progress=false",
        *overrides])
    trainer = Trainer(config)
    trainer.train()
    return jax_host(nnx.state(trainer.student, lora.LoraParam)), read_metrics(tmp_path / name)


@pytest.mark.slow
def test_lora_dropout_run_is_deterministic_in_the_seed(tmp_path):
    first, metrics = _dropout_run(tmp_path, "a", "lora.dropout=0.1")
    assert [row["step"] for row in metrics] == [1, 2]
    assert all(np.isfinite(row["loss"]) and row["update_applied"] for row in metrics)
    again, _ = _dropout_run(tmp_path, "b", "lora.dropout=0.1")
    no_dropout, plain = _dropout_run(tmp_path, "c", "lora.dropout=0.0")
    other_seed, _ = _dropout_run(tmp_path, "d", "lora.dropout=0.1", "seed=1")
    flat = lambda s: [np.asarray(v) for _, v in nnx.to_flat_state(s)]  # noqa: E731
    for a, b in zip(flat(first), flat(again)):
        np.testing.assert_array_equal(a, b)  # same seed: the same masks, the same adapter
    assert any(not np.array_equal(a, b) for a, b in zip(flat(first), flat(other_seed)))
    # dropout acts on training only: step 1's rollout (B = 0) is the same with and without it,
    # the update is not
    assert metrics[0]["response_length"] == plain[0]["response_length"]
    assert any(not np.array_equal(a, b) for a, b in zip(flat(first), flat(no_dropout)))


@pytest.mark.slow
def test_each_checkpoint_rewrites_the_peft_adapter_atomically(tmp_path, monkeypatch):
    """checkpoint.every=1 without export_hf: <run_dir>/adapter/ comes from the checkpoint saves
    alone, holds the last checkpointed step's adapter (PEFT loads it to our logits), and a save that
    fails half-way leaves the previous adapter in place, whole."""
    tree = tiny_tree(tmp_path / "run", steps=2, **{  # step 1's update is lr 0 (warmup)
        "lora.rank": 4, "lora.alpha": 8.0, "checkpoint.every": 1, "checkpoint.export_hf": False,
        "checkpoint.async_save": False, "optimizer.lr": 1e-2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    trainer = Trainer(load_config(path))
    weights.export_hf_checkpoint(trainer.student, trainer.student.cfg, tmp_path / "base")
    result = trainer.train()
    assert result.hf_dir is None
    adapter = result.run_dir / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]
    assert [p.name for p in result.run_dir.iterdir() if p.name.startswith(".adapter")] == []

    # the folder holds the step-2 adapter: the one in the student the checkpoint was taken from
    step2 = jax_host(nnx.state(trainer.student, lora.LoraParam))
    assert np.abs(np.asarray(trainer.student.layers[0].attn.q_proj_lora_b[...])).max() > 0
    copy = nnx.clone(trainer.student)
    for _, var in nnx.to_flat_state(nnx.state(copy, lora.LoraParam)):
        var[...] = var[...] * 0
    lora.load_adapter(copy, adapter)
    for (p_, a), (_, b) in zip(nnx.to_flat_state(jax_host(nnx.state(copy, lora.LoraParam))),
                               nnx.to_flat_state(step2)):
        np.testing.assert_array_equal(a, b, err_msg=str(p_))
    ids = np.random.RandomState(0).randint(3, 200, (2, 9))
    ours = np.asarray(trainer.student(ids.astype(np.int32), np.broadcast_to(
        np.arange(9, dtype=np.int32), ids.shape)))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, adapter).eval()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())

    # a crash in the middle of the next save: the step-2 adapter stays, whole
    before = {p.name: p.read_bytes() for p in adapter.iterdir()}

    def half_written(model, out, *args):
        (out / lora.ADAPTER_WEIGHTS).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(lora, "_write_adapter", half_written)
    with pytest.raises(OSError, match="disk full"):
        lora.save_adapter(copy, adapter)
    assert {p.name: p.read_bytes() for p in adapter.iterdir()} == before
    assert [p.name for p in result.run_dir.iterdir() if p.name.startswith(".adapter")] == []
