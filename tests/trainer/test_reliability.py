"""Issue 26 at the trainer, with real runs: a checkpoint whose optimizer state was damaged on
disk is skipped on resume (the run ends bit-exact with an uninterrupted one), a full disk
during a checkpoint stops the command with one line and `--resume` after space is freed ends
bit-exact, and a second trainer on a busy output folder is refused in one line."""
import json
import subprocess
import sys
import time
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ctopd_jax.common.metrics import read_metrics, run_values
from ctopd_jax.config import load_config
from ctopd_jax.loop.checkpoint import Checkpointer, _leaf_key
from ctopd_jax.loop.trainer import Trainer

from conftest import subprocess_env


def final_state(trainer):
    return jax.tree.map(np.asarray, trainer._state())


def assert_same_state(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def restored_final(cfg, ck_dir):
    ck = Checkpointer(ck_dir)
    restored = ck.restore_latest(Trainer(load_config(cfg))._state())
    ck.close()
    return restored


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-step run (the tiny trainer config of conftest)."""
    import yaml

    from conftest import tiny_tree

    out = tmp_path_factory.mktemp("reference")
    path = out / "reference.yaml"
    path.write_text(yaml.safe_dump(tiny_tree(out / "run")))
    trainer = Trainer(load_config(path))
    trainer.train()
    return final_state(trainer), out / "run"


def comparable(records):
    return [run_values(r) for r in records]


def test_damaged_optimizer_state_is_skipped_and_the_run_ends_exactly(write_config, reference):
    expected, ref_dir = reference
    cfg, run_dir = write_config("damaged")
    Trainer(load_config(cfg)).train()
    # one bit of the newest step's optimizer state flipped, its files still readable: what a
    # damaged disk leaves, and what a parameters-only fingerprint resumed from silently
    ck = Checkpointer(run_dir / "checkpoints", async_save=False)
    template = Trainer(load_config(cfg))._state()
    state = ck.restore_latest(template).state
    meta = json.loads((run_dir / "checkpoints" / "4" / "meta" / "metadata").read_text())
    leaves = [np.array(x) for x in jax.tree.leaves(state)]
    first_opt = len(jax.tree.leaves(state["params"]))
    leaves[first_opt + 1].reshape(-1).view(np.uint8)[0] ^= 1
    ck._manager.delete(4)
    ck._manager.save(4, args=ocp.args.Composite(
        state=ocp.args.StandardSave({_leaf_key(i): x for i, x in enumerate(leaves)}),
        meta=ocp.args.JsonSave(meta)), force=True)
    ck.close()

    resumed = Trainer(load_config(cfg))
    with pytest.warns(RuntimeWarning, match=r"step 4 .*checksum mismatch in the optimizer state of step 4"):
        result = resumed.train(resume=True)
    assert result.final_step == 4 and (run_dir / "checkpoints" / "4.corrupt").is_dir()
    assert_same_state(expected, final_state(resumed))
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(ref_dir))


@pytest.fixture
def small_disk(tmp_path):
    """A 7 MiB tmpfs: one checkpoint of the tiny run (~4.6 MB) fits, a second does not."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); tests/trainer/"
                    "test_checkpoint_integrity.py covers ENOSPC with a patched writer")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow   # a failing run and its resume as commands (~1 min on 2 cores)
def test_a_full_disk_stops_in_one_line_and_resume_ends_exactly(write_config, compile_cache,
                                                               reference, small_disk):
    expected, ref_dir = reference
    ck_dir = small_disk / "checkpoints"
    cfg, run_dir = write_config("full", checkpoint__dir=str(ck_dir))
    cmd = [sys.executable, "-m", "ctopd_jax.train", "--config", str(cfg)]
    proc = subprocess.run(cmd, env=subprocess_env(compile_cache), capture_output=True, text=True,
                          timeout=900)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ERROR:absl" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0] == lines[-1], lines
    assert f"checkpoint.dir {ck_dir}: no space left on device (ENOSPC)" in errors[0]
    assert "the last whole checkpoint is step 2" in errors[0]
    assert sorted(p.name for p in ck_dir.iterdir()) == ["2"]     # no half-written folder
    assert not (run_dir / ".run.lock").exists()

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resume = subprocess.run(cmd + ["--resume"], env=subprocess_env(compile_cache),
                            capture_output=True, text=True, timeout=900)
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert "resumed from step 2" in resume.stderr
    restored = restored_final(cfg, ck_dir)
    assert restored.step == 4
    assert_same_state(expected, restored.state)
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(ref_dir))


@pytest.mark.slow   # two trainer processes (~1 min on 2 cores)
def test_a_second_trainer_on_the_same_folder_is_refused(write_config, compile_cache):
    cfg, run_dir = write_config("busy", steps=40, checkpoint__every=0)
    cmd = [sys.executable, "-m", "ctopd_jax.train", "--config", str(cfg)]
    first = subprocess.Popen(cmd, env=subprocess_env(compile_cache), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and first.poll() is None and not (
                run_dir / "metrics.jsonl").is_file():
            time.sleep(0.1)
        assert first.poll() is None and (run_dir / ".run.lock").is_file()
        before = sorted(p.name for p in run_dir.rglob("*"))
        second = subprocess.run(cmd, env=subprocess_env(compile_cache), capture_output=True,
                                text=True, timeout=600)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert f"output_dir {run_dir} is in use by another run (pid {first.pid} on host" in lines[0]
        assert (run_dir / ".run.lock").is_file()
        assert json.loads((run_dir / ".run.lock").read_text())["pid"] == first.pid
        assert first.poll() is None      # the first run goes on, its files untouched by the second
        assert set(before) <= set(p.name for p in run_dir.rglob("*"))
    finally:
        first.kill()
        first.wait()
