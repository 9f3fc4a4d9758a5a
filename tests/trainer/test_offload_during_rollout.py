"""optimizer.offload_during_rollout: the AdamW state sits in host memory during the rollout
(seen from inside the engine's generate), is back on the device for training, and training is
unchanged (the same parameters after two steps), with the moves timed."""
import jax
import numpy as np
import pytest

from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.config import load_config
from ctopd_jax.loop.trainer import Trainer


def watch_rollouts(trainer, monkeypatch) -> list:
    """The memory kinds of the optimizer state's leaves at each of the engine's generations."""
    seen, generate = [], trainer.engine.generate

    def generate_watched(*args, **kwargs):
        seen.append({x.sharding.memory_kind for x in jax.tree.leaves(trainer.opt_state)})
        return generate(*args, **kwargs)

    monkeypatch.setattr(trainer.engine, "generate", generate_watched)
    return seen


@pytest.mark.slow  # two tiny runs of two steps
def test_offloaded_optimizer_state_is_on_the_host_during_the_rollout_and_trains_the_same(
        write_config, monkeypatch):
    runs = {}
    for offload in (False, True):
        cfg, run_dir = write_config(f"offload_{offload}", steps=2, checkpoint__save=False,
                                    optimizer__offload_during_rollout=offload)
        trainer = Trainer(load_config(cfg))
        seen = watch_rollouts(trainer, monkeypatch)
        trainer.train()
        runs[offload] = (jax.device_get(trainer.params), read_metrics(run_dir))
        # during each of the two rollouts: every leaf in host memory (pinned, host_offload.HOST),
        # or every leaf on the device without the option
        assert seen == [{"pinned_host" if offload else "device"}] * 2, seen
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(trainer.opt_state)}
        assert kinds == {"device"}   # back on the device after every rollout
    for a, b in zip(jax.tree.leaves(runs[False][0]), jax.tree.leaves(runs[True][0])):
        np.testing.assert_array_equal(a, b)
    assert all(r["time_offload"] > 0 for r in runs[True][1])
    assert all("time_offload" not in r for r in runs[False][1])
