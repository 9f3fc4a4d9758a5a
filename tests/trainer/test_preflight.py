"""preflight() on a good config returns what it loaded (prompts, tokenizer sides, overlap map,
mesh shape, checkpoint state) without loading a model or writing a file; on --resume it
reports the accepted config changes."""
import json
from pathlib import Path

import pytest

import ctopd_jax.algorithms  # noqa: F401  (heavy imports at collection, not inside a test)
from ctopd_jax.config import load_config
import ctopd_jax.data.prompts  # noqa: F401
import ctopd_jax.models  # noqa: F401
from ctopd_jax.preflight import (PreflightError, expected_hf_shapes, preflight,
                                 read_safetensors_header)
import ctopd_jax.tokenization.overlap  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
PROMPTS = Path(__file__).parent / "fixtures" / "prompts.jsonl"


def test_preflight_returns_the_cheap_things_it_loaded(tmp_path, monkeypatch):
    import ctopd_jax.models.weights as weights
    monkeypatch.setattr(weights, "load_hf_checkpoint", lambda *a, **k: pytest.fail("model loaded"))
    config = load_config(TINY, [f"output_dir={tmp_path / 'run'}", f"data.path={PROMPTS}"])
    pre = preflight(config, device_count=4)
    assert len(pre.prompts) == len(PROMPTS.read_text().splitlines()) and pre.prompts[0].messages[-1]["role"] == "user"
    assert pre.student_tokenizer.vocab_size == 901 and pre.teacher.tokenizer.vocab_size == 800
    assert pre.teacher.overlap.shared == 606
    assert pre.mesh_shape == {"data": 4, "fsdp": 1, "tensor": 1}
    assert pre.checkpoint_dir == tmp_path / "run" / "checkpoints" and pre.checkpoint_steps == []
    assert list(pre.teachers) == ["teacher"] and pre.teacher.model_dir is not None and pre.teacher.served is None
    assert list(tmp_path.iterdir()) == []


def test_resume_with_allowed_change_reports_it(tmp_path):
    run = tmp_path / "run"
    config = load_config(TINY, [f"output_dir={run}", f"data.path={PROMPTS}"])
    meta = run / "checkpoints" / "5" / "meta"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text(json.dumps({"step": 5, "config": config.to_dict()}))
    changed = load_config(TINY, [f"output_dir={run}", f"data.path={PROMPTS}", "optimizer.lr=5e-4",
                                 "logging.progress=false"])
    with pytest.raises(PreflightError, match=r"optimizer\.lr: 0\.001 -> 0\.0005; restore"):
        preflight(changed, resume=True, device_count=1)
    pre = preflight(changed, resume=True, allow_config_change=True, device_count=1)
    assert pre.checkpoint_steps == [5]
    assert [(c.field, c.harmless) for c in pre.config_changes] == [
        ("logging.progress", True), ("optimizer.lr", False)]
    assert pre.saved_config_source.endswith("checkpoints/5")


def test_header_reader_agrees_with_the_demo_checkpoint():
    from ctopd_jax.models.config import ModelConfig
    directory = ROOT / "ctopd_jax" / "assets" / "demo" / "student"
    header = read_safetensors_header(directory / "model.safetensors")
    cfg = ModelConfig.from_hf_dict(json.loads((directory / "config.json").read_text()))
    expected = expected_hf_shapes(cfg)
    assert {k: tuple(v["shape"]) for k, v in header.items() if k in expected} == expected


def test_a_teacher_judge_call_longer_than_the_teacher_is_one_preflight_line(tmp_path, monkeypatch):
    # SAGE-OPD's judge prompt wraps a turn and its feedback: on the tool demo's char teacher
    # (256 positions) it cannot fit, and preflight says so before any model loads.
    import ctopd_jax.models.weights as weights
    monkeypatch.setattr(weights, "load_hf_checkpoint", lambda *a, **k: pytest.fail("model loaded"))
    tools = ROOT / "configs" / "tiny_cpu_tools.yaml"
    sets = [f"output_dir={tmp_path / 'run'}", "algorithm.name=sage_opd"]
    with pytest.raises(PreflightError, match=r"algorithm\.sage_judge=teacher: a judge call needs "
                       r"up to \d+ positions but the teacher's max_position_embeddings is 256"):
        preflight(load_config(tools, [*sets, "algorithm.sage_judge=teacher"]), device_count=1)
    pre = preflight(load_config(tools, [*sets, "algorithm.sage_judge=proxy"]), device_count=1)
    assert pre.teacher.tokenizer.vocab_size == pre.student_tokenizer.vocab_size
    assert not (tmp_path / "run").exists()
