"""SIGINT / SIGTERM at any moment of `python -m ctopd_jax.train`: start-up (modules loading,
preflight, models, compilation), training, checkpointing. In every case: one line naming the
signal, exit status 128 + signal, no traceback, no lock left, no file of the run left partial
(no Orbax temporary folder, every metrics row whole, config.json whole), and the run then
continues (`--resume` when a checkpoint was saved, else a fresh start) to the same parameters
and metrics as an uninterrupted run, bit-exact. The moments are drawn from a seeded generator
(printed with `-s`), a handful of them: the test is bounded, and slow."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from ctopd_jax.common.metrics import read_metrics, run_values
from ctopd_jax.common.run_dir import LOCK_NAME
from ctopd_jax.config import load_config
from ctopd_jax.loop.checkpoint import Checkpointer
from ctopd_jax.loop.trainer import Trainer

from conftest import subprocess_env, tiny_tree

ROOT = Path(__file__).resolve().parents[2]
RNG = random.Random(35)
# (phase, signal, what the moment waits for): start-up moments are a random delay after the
# process starts (from 0.2 s: before that the interpreter itself has not started our code; up
# to 4 s: a whole run with a warm compile cache takes ~8-13 s here, and a later moment can land
# after the run ended, in the interpreter's own shutdown, where Python has restored the
# default action and the signal ends the process without a line);
# training ones a random delay after step 1 is logged; checkpointing ones the moment a step's
# temporary Orbax folder appears (the write in flight)
MOMENTS = [("start-up", signal.SIGINT, RNG.uniform(0.2, 2.0)),
           ("start-up", signal.SIGTERM, RNG.uniform(2.0, 4.0)),
           ("training", signal.SIGTERM, RNG.uniform(0.0, 1.0)),
           ("training", signal.SIGINT, RNG.uniform(0.0, 1.0)),
           ("checkpointing", signal.SIGTERM, 0.0)]


def comparable(records):
    return [run_values(r) for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    (out / "run.yaml").write_text(yaml.safe_dump(tiny_tree(out / "run")))
    trainer = Trainer(load_config(out / "run.yaml"))
    trainer.train()
    return jax.tree.map(np.asarray, trainer._state()), comparable(read_metrics(out / "run"))


def wait_for(phase: str, run: Path, proc: subprocess.Popen, delay: float) -> None:
    if phase == "start-up":
        time.sleep(delay)
        return
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if phase == "training" and (run / "metrics.jsonl").is_file() and \
                '"step": 1' in (run / "metrics.jsonl").read_text():
            time.sleep(delay)
            return
        if phase == "checkpointing" and any((run / "checkpoints").glob("*.orbax-checkpoint-tmp*")):
            return
        time.sleep(0.005)


def assert_nothing_partial(run: Path) -> None:
    if not run.exists():
        return
    names = [str(p.relative_to(run)) for p in run.rglob("*")]
    assert not [n for n in names if "orbax-checkpoint-tmp" in n or LOCK_NAME in n], names
    if (run / "config.json").exists():
        json.loads((run / "config.json").read_text())
    if (run / "metrics.jsonl").exists():
        for line in (run / "metrics.jsonl").read_text().splitlines():
            json.loads(line)


@pytest.mark.slow   # five interrupted commands and their continuations (~6 min on 2 cores)
@pytest.mark.parametrize("phase,sig,delay", MOMENTS,
                         ids=[f"{p}-{s.name}-{d:.2f}s" for p, s, d in MOMENTS])
def test_a_signal_at_any_moment_is_one_line_and_the_run_continues_exactly(
        tmp_path, compile_cache, reference, phase, sig, delay):
    cfg = tmp_path / "run.yaml"
    run = tmp_path / "run"
    cfg.write_text(yaml.safe_dump(tiny_tree(run)))
    cmd = [sys.executable, "-m", "ctopd_jax.train", "--config", str(cfg)]
    env = subprocess_env(compile_cache, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(phase, run, proc, delay)
    assert proc.poll() is None, "the run ended before the moment came"
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=600)
    print(f"\n[{phase} {sig.name} +{delay:.2f} s] exit {proc.returncode}: {err.strip().splitlines()[-1]}")
    said = [line for line in err.splitlines() if sig.name in line]
    assert proc.returncode == 128 + sig and "Traceback" not in err, err[-3000:]
    assert len(said) == 1 and said[0] == err.strip().splitlines()[-1], err[-3000:]
    assert_nothing_partial(run)

    saved = Checkpointer(run / "checkpoints").steps() if (run / "checkpoints").is_dir() else []
    again = subprocess.run(cmd + (["--resume"] if saved else []), env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    expected_state, expected_metrics = reference
    ck = Checkpointer(run / "checkpoints")
    restored = ck.restore_latest(Trainer(load_config(cfg))._state())
    ck.close()
    assert restored.step == 4
    for a, b in zip(jax.tree.leaves(expected_state),
                    jax.tree.leaves(jax.tree.map(np.asarray, restored.state)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert comparable(read_metrics(run)) == expected_metrics
