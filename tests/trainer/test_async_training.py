"""`rollout.async_rollouts` in the trainer: at staleness 0 the synchronous run's numbers bit for
bit, at staleness 1 the first batch fresh and the next ones one update behind, and those stale
batches reweighted by the truncated importance weights where the objective asks for them."""
import dataclasses

import jax
import numpy as np
import pytest

from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.config import load_config
from ctopd_jax.loop.trainer import Trainer
from ctopd_jax.rollout.async_rollouts import Rollouts


@pytest.mark.slow  # three tiny runs of three steps
def test_staleness_0_trains_as_the_synchronous_run_and_staleness_1_one_update_behind(write_config):
    """The JAX engine stands behind the background collection (config refuses async with it, so
    the trainer's Rollouts is swapped in): the same parameters bit for bit at staleness 0."""
    runs = {}
    for mode in ("sync", 0, 1):
        cfg, run_dir = write_config(f"async_{mode}", steps=3, checkpoint__save=False)
        trainer = Trainer(load_config(cfg))
        if mode != "sync":
            rollout = dataclasses.replace(trainer.config.rollout, async_rollouts=True,
                                          async_staleness=mode)
            trainer.rollouts = Rollouts(trainer.draw, trainer.collect, rollout, trainer.config.steps)
        trainer.train()
        runs[mode] = (jax.device_get(trainer.params), read_metrics(run_dir))
    for a, b in zip(jax.tree.leaves(runs["sync"][0]), jax.tree.leaves(runs[0][0])):
        np.testing.assert_array_equal(a, b)
    assert [r["loss"] for r in runs["sync"][1]] == [r["loss"] for r in runs[0][1]]
    assert [r["rollout_staleness"] for r in runs[0][1]] == [0, 0, 0]
    assert [r["rollout_staleness"] for r in runs[1][1]] == [0, 1, 1]
    assert runs[1][1][0]["loss"] == runs["sync"][1][0]["loss"]   # the first batch is not stale
    assert runs[1][1][2]["loss"] != runs["sync"][1][2]["loss"]


@pytest.mark.slow  # two tiny runs of two steps
def test_stale_batches_are_reweighted_in_the_trainer_and_fresh_ones_are_not(tmp_path):
    """opd with gap_logprobs recomputed ("tis") at staleness 1, the JAX engine behind the
    background collection: step 2 trains on responses sampled by the weights before step 1's
    update, so their rollout log-probs are those of an older policy (ratios != 1). The corrected
    run (the trainer's own `step_objective` choice) logs a mean weight of 1 at step 1 (fresh:
    ratio 1 up to XLA's rounding) and away from 1 at step 2, and its step-2 loss moves off the
    uncorrected stale run's while step 1's stays. The exact weights and the gradient they make
    are checked against torch in tests/rollout/test_async_rollouts.py."""
    from test_served_teacher_training import small_run

    from ctopd_jax.rollout.staleness import TruncatedIS, step_objective

    runs = {}
    for corrected in (False, True):
        out = tmp_path / f"tis_{corrected}"
        # no warm-up: step 1's update moves the weights, so step 2's responses are stale
        trainer = Trainer(small_run(out, "opd", "algorithm.gap_logprobs=recomputed",
                                    "optimizer.warmup_ratio=0"))
        rollout = dataclasses.replace(trainer.config.rollout, async_rollouts=True, async_staleness=1)
        trainer.rollouts = Rollouts(trainer.draw, trainer.collect, rollout, trainer.config.steps)
        if corrected:
            trainer.step_objective = step_objective(trainer.objective, rollout)
            assert isinstance(trainer.step_objective, TruncatedIS)
        trainer.train()
        runs[corrected] = read_metrics(out)
    plain, tis = runs[False], runs[True]
    assert [r["rollout_staleness"] for r in tis] == [0, 1]
    assert "tis_weight" not in plain[0]
    assert abs(tis[0]["tis_weight"] - 1) < 1e-5            # fresh responses: weight 1
    assert abs(tis[1]["tis_weight"] - 1) > 1e-3            # stale responses: reweighted (0.98)
    assert tis[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-4, abs=1e-6)
    assert abs(tis[1]["loss"] - plain[1]["loss"]) > 1e-3 * abs(plain[1]["loss"])
