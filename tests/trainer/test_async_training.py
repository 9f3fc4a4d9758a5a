"""`rollout.async_rollouts` in the trainer: at staleness 0 the synchronous run's numbers bit for
bit, at staleness 1 the first batch fresh and the next ones one update behind."""
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
def test_truncated_importance_weights_in_the_trainer_step_at_cap_1_against_the_uncorrected_run(tmp_path):
    """opd with gap_logprobs recomputed declares "tis": the step multiplies each response token
    by min(π_θ/π_rollout, cap). With the JAX engine the ratio is 1 up to XLA's rounding (~1e-6),
    so at cap 1 the weights are <= 1 and near 1: the losses stay those of the uncorrected run
    within that rounding, and the mean weight is logged."""
    from test_served_teacher_training import small_run

    from ctopd_jax.rollout.staleness import TruncatedIS

    losses = {}
    for corrected in (False, True):
        out = tmp_path / f"tis_{corrected}"
        trainer = Trainer(small_run(out, "opd", "algorithm.gap_logprobs=recomputed"))
        assert trainer.objective.stale_responses == "tis"
        if corrected:
            trainer.step_objective = TruncatedIS(trainer.objective, 1.0)
        trainer.train()
        losses[corrected] = read_metrics(out)
    weights = [r["tis_weight"] for r in losses[True]]
    assert all(0.999 < w <= 1.0 for w in weights), weights
    assert "tis_weight" not in losses[False][0]
    np.testing.assert_allclose([r["loss"] for r in losses[True]],
                               [r["loss"] for r in losses[False]], rtol=1e-4, atol=1e-6)
