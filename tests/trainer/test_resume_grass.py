"""MP-OPD grass_chunk carries run state (the GRASS noise EMA): a run SIGKILLed between
checkpoints and resumed ends with the same parameters, the same noise state and the same logged
metrics as an uninterrupted run (timings excepted)."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ctopd_jax.checkpoint import Checkpointer
from ctopd_jax.config import load_config
from ctopd_jax.metrics import read_metrics
from ctopd_jax.trainer import Trainer

from conftest import subprocess_env

GRASS = {"algorithm": {"name": "mp_opd", "mp_opd_mode": "grass_chunk", "grass_chunk_atoms": 3,
                       "chunked_loss_size": 64},
         "rollout.generate_max_len": 40,
         # the demo models write clean text (random tiny models emit split UTF-8, which fails
         # every sample closed as replacement_character and leaves nothing to train)
         "model": {"student": "demo:student", "teacher": "demo:teacher"}, "data.path": "demo:train"}


def comparable(records):
    clock = ("tokens_per_s", "wall_time", "elapsed_s", "peak_device_memory_bytes")
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in clock} for r in records]


@pytest.mark.slow
def test_grass_sigkill_then_resume_is_exact(write_config, compile_cache):
    changes = {k.replace(".", "__"): v for k, v in GRASS.items()}
    ref_cfg, ref_dir = write_config("reference", **changes)
    reference = Trainer(load_config(ref_cfg))
    reference.train()
    expected = jax.tree.map(np.asarray, reference._state())
    ref_noise = reference.objective.state_dict()
    assert ref_noise["grass_noise_updates"] > 0, "the run must exercise the noise estimate"

    cfg, run_dir = write_config("killed", **changes)
    proc = subprocess.Popen([sys.executable, "-m", "ctopd_jax.train", "--config", str(cfg)],
                            # no persistent cache in the child: on 8 host CPU devices the
                            # callback-free grass step loaded from the XLA cache deadlocks in an
                            # all-gather rendezvous (compiled fresh it runs; see the commit)
                            env=subprocess_env(compile_cache, JAX_ENABLE_COMPILATION_CACHE="false"),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    log = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        logged = log.is_file() and any(json.loads(l)["step"] == 3 for l in log.read_text().splitlines() if l.strip())
        if logged and (run_dir / "checkpoints" / "2").is_dir():
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ck = Checkpointer(run_dir / "checkpoints")
    steps = ck.steps()
    ck.close()
    assert steps and max(steps) < 4, steps

    resumed = Trainer(load_config(cfg))
    result = resumed.train(resume=True)
    assert result.final_step == 4
    assert resumed.objective.state_dict() == ref_noise   # bit-exact floats (JSON round trip)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(jax.tree.map(np.asarray, resumed._state()))):
        np.testing.assert_array_equal(a, b)
    got_rows, want_rows = comparable(read_metrics(run_dir)), comparable(read_metrics(ref_dir))
    assert [r["step"] for r in got_rows] == [r["step"] for r in want_rows]
    for got_row, want_row in zip(got_rows, want_rows):
        diff = {k for k in set(got_row) | set(want_row) if got_row.get(k) != want_row.get(k)}
        assert not diff, (got_row["step"], {k: (got_row.get(k), want_row.get(k)) for k in diff})
    assert any("mp_opd_grass_alpha" in r for r in read_metrics(run_dir))
