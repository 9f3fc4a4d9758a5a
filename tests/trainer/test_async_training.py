"""`rollout.async_rollouts` in the trainer: at staleness 0 the synchronous run's numbers bit for
bit, at staleness 1 the first batch fresh and the next ones one update behind."""
import dataclasses

import jax
import numpy as np
import pytest

from ctopd_jax.config import load_config
from ctopd_jax.metrics import read_metrics
from ctopd_jax.rollout.overlap import Rollouts
from ctopd_jax.trainer import Trainer


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
