"""Checkpointer: exact round trip, keep-last-K, corrupt latest -> previous with a warning."""
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ctopd_jax.loop.checkpoint import CheckpointError, Checkpointer


def make_state(seed):
    k = jax.random.key(seed)
    params = {"w": jax.random.normal(k, (4, 3)), "b": jnp.arange(3.0) + seed}
    tx = optax.adam(1e-2)
    opt = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt = tx.update(grads, opt, params)
    return {"params": params, "opt_state": opt, "rng": jax.random.key_data(jax.random.key(seed + 100))}


def assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_and_keep_last(tmp_path):
    ck = Checkpointer(tmp_path / "ck", every=2, keep=2)
    states = {s: make_state(s) for s in (2, 4, 6)}
    for s, st in states.items():
        ck.save(s, st, {"data": {"position": s}, "config": {"x": 1}})
    ck.wait()
    assert ck.steps() == [4, 6]
    restored = ck.restore_latest(make_state(0))
    assert restored.step == 6 and restored.meta["data"] == {"position": 6}
    assert_tree_equal(restored.state, states[6])
    ck.close()
    assert [ck.should_save(s, 7) for s in range(1, 8)] == [False, True, False, True, False, True, True]


def test_nothing_to_restore_returns_none(tmp_path):
    ck = Checkpointer(tmp_path / "empty")
    assert ck.restore_latest(make_state(0)) is None
    ck.close()


@pytest.mark.parametrize("damage", ["delete_data", "garble_data"])
def test_corrupt_latest_falls_back_with_warning(tmp_path, damage):
    ck = Checkpointer(tmp_path / "ck", every=1, keep=3, async_save=False)
    for s in (1, 2):
        ck.save(s, make_state(s), {"data": {"position": s}})
    ck.wait()
    data_files = [f for f in glob.glob(str(tmp_path / "ck" / "2" / "state" / "**" / "d" / "*"), recursive=True)
                  if os.path.isfile(f)]
    assert data_files
    for f in data_files:
        if damage == "delete_data":
            os.remove(f)
        else:
            size = os.path.getsize(f)
            with open(f, "r+b") as h:
                h.seek(size // 2)
                h.write(bytes(255 - b for b in open(f, "rb").read()[size // 2:]))
    with pytest.warns(RuntimeWarning, match="step 2 .* corrupt"):
        reader = Checkpointer(tmp_path / "ck")
        restored = reader.restore_latest(make_state(0))
    reader.close()
    ck.close()
    assert restored.step == 1
    assert_tree_equal(restored.state, make_state(1))
    assert (tmp_path / "ck" / "2.corrupt").exists()
    # the run can save step 2 again afterwards
    again = Checkpointer(tmp_path / "ck", async_save=False)
    again.save(2, make_state(2), {})
    again.wait()
    assert again.steps() == [1, 2]
    again.close()


def test_other_structure_is_a_clear_error(tmp_path):
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(1, make_state(1), {})
    ck.wait()
    other = make_state(0)
    other["params"]["extra"] = jnp.zeros(2)
    with pytest.raises(CheckpointError, match="other names"):
        ck.restore_latest(other)
    ck.close()


def test_corrupt_checkpoint_reason_is_one_clean_line():
    from ctopd_jax.loop.checkpoint import describe_error

    err = ValueError("Failed to restore <bound method pybind11_detail_function_record_v1.spec of "
                     "<tensorstore.Spec object at 0x7f00>>:\n  missing chunk /ck/4/state/d/1a2b")
    assert describe_error(err) == "ValueError: Failed to restore: missing chunk /ck/4/state/d/1a2b"
    assert describe_error(KeyError("leaf_00003")) == "KeyError: 'leaf_00003'"
    assert describe_error(OSError()) == "OSError"
