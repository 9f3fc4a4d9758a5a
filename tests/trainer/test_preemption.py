"""SIGTERM during a run: the step in flight finishes and is checkpointed, the command exits 143
with one line naming the step and the checkpoint, the metrics log is kept, and `--resume`
continues to the same parameters as an uninterrupted run (bit-exact)."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.config import load_config
from ctopd_jax.loop.checkpoint import Checkpointer
from ctopd_jax.loop.trainer import Trainer

from conftest import subprocess_env


@pytest.mark.slow  # a reference run, a preempted command and its resume (~2-4 min on 2 cores)
def test_sigterm_checkpoints_the_step_and_resume_is_exact(write_config, compile_cache):
    ref_cfg, ref_dir = write_config("reference", checkpoint__every=0)
    reference = Trainer(load_config(ref_cfg))
    reference.train()
    expected = jax.tree.map(np.asarray, reference._state())

    cfg, run_dir = write_config("preempted", checkpoint__every=0)  # only the final step is saved
    cmd = [sys.executable, "-m", "ctopd_jax.train", "--config", str(cfg)]
    proc = subprocess.Popen(cmd, env=subprocess_env(compile_cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if log.is_file() and any(json.loads(l)["step"] == 1 for l in log.read_text().splitlines() if l.strip()):
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err[-3000:]
    last = [line for line in err.strip().splitlines() if line.strip()][-1]
    assert "SIGTERM" in last and "--resume" in last and "Traceback" not in err, err[-3000:]
    ck = Checkpointer(run_dir / "checkpoints")
    steps = ck.steps()
    ck.close()
    stopped = max(steps)
    assert 1 <= stopped < 4 and f"step {stopped}" in last, (steps, last)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stopped + 1))

    resume = subprocess.run(cmd + ["--resume"], env=subprocess_env(compile_cache), capture_output=True,
                            text=True, timeout=900)
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert f"resumed from step {stopped}" in resume.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    ck = Checkpointer(run_dir / "checkpoints")
    resumed = Trainer(load_config(cfg))
    restored = ck.restore_latest(resumed._state())
    ck.close()
    assert restored.step == 4
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(jax.tree.map(np.asarray, restored.state))):
        np.testing.assert_array_equal(a, b)
