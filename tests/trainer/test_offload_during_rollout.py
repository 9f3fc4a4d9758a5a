"""optimizer.offload_during_rollout: the AdamW state sits in host memory during the rollout and
training is unchanged (the same parameters after two steps), with the moves timed."""
import jax
import numpy as np
import pytest

from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.config import load_config
from ctopd_jax.loop.trainer import Trainer


@pytest.mark.slow  # two tiny runs of two steps
def test_offloaded_optimizer_state_trains_the_same(write_config):
    runs = {}
    for offload in (False, True):
        cfg, run_dir = write_config(f"offload_{offload}", steps=2, checkpoint__save=False,
                                    optimizer__offload_during_rollout=offload)
        trainer = Trainer(load_config(cfg))
        trainer.train()
        runs[offload] = (jax.device_get(trainer.params), read_metrics(run_dir))
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(trainer.opt_state)}
        assert kinds == {"device"}   # back on the device after every rollout
    for a, b in zip(jax.tree.leaves(runs[False][0]), jax.tree.leaves(runs[True][0])):
        np.testing.assert_array_equal(a, b)
    assert all(r["time_offload"] > 0 for r in runs[True][1])
    assert all("time_offload" not in r for r in runs[False][1])
