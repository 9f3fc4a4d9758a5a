"""A diverging run stops with a clear message and a good checkpoint; a corrupt latest checkpoint
is detected on resume, the previous one is used with a warning, and the run still ends exactly
where an uninterrupted run ends."""
import glob
import os

import jax
import numpy as np
import pytest

from ctopd_jax.common import cli
from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.config import load_config
from ctopd_jax.loop.checkpoint import Checkpointer
from ctopd_jax.loop.trainer import Trainer, TrainerSetupError, TrainingDiverged


def test_a_diverged_run_is_one_line_and_exit_3_from_every_command_that_trains(capsys):
    """train, demo and demo.real all run under cli.run: the guard's stop is one line there."""
    def diverging(argv):
        raise TrainingDiverged("step 8: gradient norm 0.0 for 3 steps in a row. Last good "
                               "checkpoint: none in /runs/x/checkpoints")
    assert cli.run(diverging, [], "python -m ctopd_jax.demo.real") == 3
    assert capsys.readouterr().err == (
        "python -m ctopd_jax.demo.real: training stopped: step 8: gradient norm 0.0 for 3 steps "
        "in a row. Last good checkpoint: none in /runs/x/checkpoints\n")


def test_nan_loss_stops_with_message_and_keeps_last_good_checkpoint(write_config):
    # a constant lr of 1e30 blows the parameters up in the first update: step 2's loss is not finite
    cfg, run_dir = write_config("nan", steps=3, optimizer__lr=1e30, optimizer__min_lr=0.0,
                                optimizer__schedule="constant", checkpoint__every=1)
    trainer = Trainer(load_config(cfg))
    with pytest.raises(TrainingDiverged, match=r"step 2: .* not finite.*Last good checkpoint: step 1"):
        trainer.train()
    ck = Checkpointer(run_dir / "checkpoints")
    assert ck.steps() == [1]
    restored = ck.restore_latest(trainer._state())
    ck.close()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.state["params"]))
    # the diverged update was not applied: the live params are still finite too
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(trainer.params))
    # the failing step's values are logged (NaN shown as such), nothing after it
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert not np.isfinite(rows[1]["loss"]) or not np.isfinite(rows[1]["grad_norm"])


def test_corrupt_latest_checkpoint_falls_back_and_run_ends_exactly(write_config):
    ref_cfg, _ = write_config("reference")
    reference = Trainer(load_config(ref_cfg))
    reference.train()

    cfg, run_dir = write_config("corrupt")
    Trainer(load_config(cfg)).train()
    for f in glob.glob(str(run_dir / "checkpoints" / "4" / "state" / "**" / "d" / "*"), recursive=True):
        os.remove(f)
    with pytest.raises(TrainerSetupError, match="--resume"):
        Trainer(load_config(cfg)).train()  # existing checkpoints without --resume
    resumed = Trainer(load_config(cfg))
    with pytest.warns(RuntimeWarning, match="step 4 .* corrupt"):
        resumed.train(resume=True)
    for a, b in zip(jax.tree.leaves(reference._state()), jax.tree.leaves(resumed._state())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (run_dir / "checkpoints" / "4.corrupt").is_dir()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


def test_prompts_longer_than_max_prompt_len_are_dropped_at_start(write_config, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "What is 2 + 3?"}\n' * 3 + '{"prompt": "' + "1 + 1 + " * 40 + '1?"}\n')
    cfg, _ = write_config("long", data__path=str(data), rollout__max_prompt_len=40)
    with pytest.warns(RuntimeWarning, match=r"dropped 1 of 4 prompts .* \(first: .*prompts.jsonl:4\)"):
        trainer = Trainer(load_config(cfg))
    assert len(trainer.stream.prompts) == 3
    cfg, _ = write_config("none_fit", data__path=str(data), rollout__max_prompt_len=5)
    with pytest.raises(TrainerSetupError, match="no prompt fits rollout.max_prompt_len=5"):
        with pytest.warns(RuntimeWarning):
            Trainer(load_config(cfg))
