"""Issue 26, families 6 and 7 at the Checkpointer: every saved item (parameters, optimizer
state, RNG, and the meta with the data position and objective state) is verified on restore and
a damaged step falls back to the previous whole one with a warning naming the item; a write the
disk refuses (ENOSPC) is one CheckpointWriteError naming the folder and the last whole step,
leaves no half-written folder and no Orbax tracebacks, and the checkpointer saves again once
there is space."""
import errno
import glob
import json
import os
import subprocess
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from ctopd_jax.loop.checkpoint import (CheckpointWriteError, Checkpointer, _leaf_key, checksums,
                                  meta_checksum)


def make_state(seed):
    k = jax.random.key(seed)
    params = {"w": jax.random.normal(k, (64, 32)), "b": jnp.arange(3.0) + seed}
    tx = optax.adam(1e-2)
    opt = tx.init(params)
    _, opt = tx.update(jax.tree.map(jnp.ones_like, params), opt, params)
    return {"params": params, "opt_state": opt,
            "rng": jax.random.key_data(jax.random.key(seed + 100))}


def assert_tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def flip_one_bit(x):
    """The lowest bit of the first word: the smallest damage a float sum could not see."""
    raw = np.array(x).copy()
    view = raw.reshape(-1).view(np.uint8)
    view[0] ^= 1
    return jnp.asarray(raw)


def two_steps(directory):
    ck = Checkpointer(directory, every=1, keep=5, async_save=False)
    for step in (1, 2):
        ck.save(step, make_state(step), {"data": {"position": step}, "objective": {"ema": 0.5}})
    ck.wait()
    return ck


def rewrite_step(ck, step, arrays, meta):
    """Write `step` again with these arrays and this meta, as damage on disk would leave it."""
    ck._manager.delete(step)
    ck._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                                   meta=ocp.args.JsonSave(meta)), force=True)
    ck._manager.wait_until_finished()


def saved_meta(directory, step):
    return json.loads((directory / str(step) / "meta" / "metadata").read_text())


# ----------------------------------------------------------------------------- checksums

def test_checksums_see_one_flipped_bit_in_every_dtype():
    for x in (jnp.linspace(0.0, 1.0, 1000), jnp.arange(7, dtype=jnp.int32),
              jnp.ones((5, 3), jnp.bfloat16), jnp.array([True, False]),
              jax.random.key_data(jax.random.key(3))):
        assert checksums([x]) != checksums([flip_one_bit(x)]), x.dtype


def test_checksums_do_not_depend_on_the_sharding():
    from jax.sharding import NamedSharding, PartitionSpec

    x = jax.random.normal(jax.random.key(0), (16, 24))
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("d")))
    assert len(sharded.sharding.device_set) == len(jax.devices())
    assert checksums([x]) == checksums([sharded])


def test_swapped_words_change_the_weighted_sum():
    x = jnp.array([1.0, 2.0, 3.0])
    assert checksums([x])[0][0] == checksums([x[::-1]])[0][0]     # the plain sum cannot see it
    assert checksums([x])[0][1] != checksums([x[::-1]])[0][1]


# ----------------------------------------------------------------------------- damaged items

@pytest.mark.parametrize("item,name", [("params", "parameters"),
                                       ("opt_state", "optimizer state"), ("rng", "RNG state")])
def test_a_flipped_bit_in_any_item_falls_back_naming_it(tmp_path, item, name):
    ck = two_steps(tmp_path / "ck")
    state, meta = make_state(2), saved_meta(tmp_path / "ck", 2)
    damaged = dict(state)
    leaves, tree = jax.tree.flatten(state[item])
    damaged[item] = jax.tree.unflatten(tree, [*leaves[:-1], flip_one_bit(leaves[-1])])
    rewrite_step(ck, 2, {_leaf_key(i): x for i, x in enumerate(jax.tree.leaves(damaged))}, meta)
    with pytest.warns(RuntimeWarning, match=rf"step 2 .*checksum mismatch in the {name} of step 2"):
        restored = ck.restore_latest(make_state(0))
    assert restored.step == 1 and restored.meta["data"] == {"position": 1}
    assert_tree_equal(restored.state, make_state(1))
    assert (tmp_path / "ck" / "2.corrupt").is_dir() and ck.steps() == [1]
    assert ck.newest_whole() == "step 1"     # what the divergence guard names from now on
    ck.close()


@pytest.mark.parametrize("edit", ["data_position", "objective_state"])
def test_an_edited_meta_falls_back(tmp_path, edit):
    ck = two_steps(tmp_path / "ck")
    meta = saved_meta(tmp_path / "ck", 2)
    assert meta["meta_sha256"] == meta_checksum(meta)
    if edit == "data_position":
        meta["data"]["position"] = 7
    else:
        meta["objective"]["ema"] = 0.25
    arrays = {_leaf_key(i): x for i, x in enumerate(jax.tree.leaves(make_state(2)))}
    rewrite_step(ck, 2, arrays, meta)
    with pytest.warns(RuntimeWarning, match=r"checksum mismatch in the meta of step 2"):
        restored = ck.restore_latest(make_state(0))
    assert restored.step == 1
    ck.close()


def test_bytes_flipped_in_the_files_fall_back(tmp_path):
    """Real damage on disk: one byte inverted in the middle of every data file of step 2 (Orbax
    may fail to decode it, or decode other numbers: either way step 1 is used)."""
    ck = two_steps(tmp_path / "ck")
    files = [f for f in glob.glob(str(tmp_path / "ck" / "2" / "state" / "**" / "d" / "*"),
                                  recursive=True) if os.path.isfile(f)]
    assert files
    for f in files:
        with open(f, "r+b") as handle:
            handle.seek(os.path.getsize(f) // 2)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.warns(RuntimeWarning, match="step 2 .* corrupt"):
        restored = Checkpointer(tmp_path / "ck").restore_latest(make_state(0))
    assert restored.step == 1
    assert_tree_equal(restored.state, make_state(1))
    ck.close()


def test_a_checkpoint_of_the_older_format_still_restores(tmp_path):
    """Steps written before the exact checksums (parameters fingerprint only) still resume."""
    from ctopd_jax.loop.checkpoint import fingerprint

    ck = two_steps(tmp_path / "ck")
    meta = {k: v for k, v in saved_meta(tmp_path / "ck", 2).items()
            if k not in ("checksums", "meta_sha256")}
    meta["params_fingerprint"] = fingerprint(make_state(2)["params"])
    rewrite_step(ck, 2, {_leaf_key(i): x for i, x in enumerate(jax.tree.leaves(make_state(2)))},
                 meta)
    restored = ck.restore_latest(make_state(0))
    assert restored.step == 2
    assert_tree_equal(restored.state, make_state(2))
    ck.close()


# ----------------------------------------------------------------------------- a full disk

def no_partial_folders(directory):
    return [p.name for p in directory.iterdir() if "tmp" in p.name]


def test_enospc_from_a_patched_writer_is_one_error_and_no_half_folder(tmp_path, monkeypatch):
    """The writer raises what tensorstore raises inside Orbax, after leaving its temporary
    folder behind, as a full disk does."""
    ck = two_steps(tmp_path / "ck")
    real_save = ck._manager.save

    def full_disk(step, *args, **kwargs):
        (tmp_path / "ck" / f"{step}.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "leaf_00001/0": Failed to write '
                         "571807 bytes to file 4: No space left on device [os_error_code='28']")
    monkeypatch.setattr(ck._manager, "save", full_disk)
    with pytest.raises(CheckpointWriteError) as err:
        ck.save(3, make_state(3), {})
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "ck") in message
    assert "no space left on device (ENOSPC)" in message and "step 3" in message
    assert "the last whole checkpoint is step 2" in message and "--resume" in message
    assert no_partial_folders(tmp_path / "ck") == [] and ck.steps() == [1, 2]
    monkeypatch.setattr(ck._manager, "save", real_save)   # space freed: saving works again
    ck.save(3, make_state(3), {})
    ck.wait()
    assert ck.steps() == [1, 2, 3]
    assert_tree_equal(ck.restore_latest(make_state(0)).state, make_state(3))
    ck.close()


def test_a_partial_write_left_by_a_killed_run_is_removed_when_the_run_resumes(tmp_path):
    ck = two_steps(tmp_path / "ck")
    ck.close()
    (tmp_path / "ck" / "3.orbax-checkpoint-tmp-1700000000" / "state").mkdir(parents=True)
    again = Checkpointer(tmp_path / "ck")
    assert no_partial_folders(tmp_path / "ck") == [] and again.steps() == [1, 2]
    assert again.restore_latest(make_state(0)).step == 2
    again.close()


def test_other_errors_are_not_reported_as_a_full_disk(tmp_path, monkeypatch):
    ck = two_steps(tmp_path / "ck")

    def broken(*args, **kwargs):
        raise ValueError("something else")
    monkeypatch.setattr(ck._manager, "save", broken)
    with pytest.raises(ValueError, match="something else"):
        ck.save(3, make_state(3), {})
    ck.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (root only); skipped where mounting is not allowed."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True)
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the patched-writer test covers it")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_async_save(small_tmpfs, capfd):
    ck = Checkpointer(small_tmpfs / "ck", every=1, keep=5, async_save=True)
    ck.save(1, make_state(1), {"data": {"position": 1}})
    ck.wait()
    big = make_state(2)
    big["params"]["w"] = jax.random.normal(jax.random.key(9), (300, 300))  # 360 kB, incompressible
    template = jax.tree.map(jnp.zeros_like, big)
    capfd.readouterr()
    with pytest.raises(CheckpointWriteError, match=r"no space left on device \(ENOSPC\) while "
                       r"writing the checkpoint of step 2; the last whole checkpoint is step 1"):
        ck.save(2, big, {})
        ck.wait()
    _, err = capfd.readouterr()
    assert "Traceback" not in err and "ERROR:absl" not in err, err[:2000]
    assert no_partial_folders(small_tmpfs / "ck") == [] and ck.steps() == [1]
    ck.close()
    # more space (remount larger): the same folder saves and restores again
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_tmpfs)], check=True)
    again = Checkpointer(small_tmpfs / "ck", every=1, keep=5, async_save=True)
    again.save(2, big, {})
    again.wait()
    assert again.steps() == [1, 2]
    assert_tree_equal(again.restore_latest(template).state, big)
    again.close()


def test_disk_errno_reads_oserrors_and_tensorstore_messages():
    from ctopd_jax.common.run_dir import disk_errno

    assert disk_errno(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
    assert disk_errno(ValueError("Failed: Read-only file system [os_error_code=30]")) == errno.EROFS
    rust = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })'
    assert disk_errno(Exception(rust)) == errno.ENOSPC
    try:
        try:
            raise OSError(errno.EDQUOT, "quota")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert disk_errno(outer) == errno.EDQUOT
    assert disk_errno(OSError(errno.ENOENT, "missing")) is None
    assert disk_errno(ValueError("plain")) is None
