"""A run SIGKILLed between checkpoints and resumed ends with the same parameters, the same
objective run state and the same logged metrics as an uninterrupted run of the same length
(timings excepted): full fine-tuning, a LoRA student, and MP-OPD's grass_chunk (whose GRASS
noise EMA is run state)."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ctopd_jax.common.metrics import read_metrics, run_values
from ctopd_jax.config import load_config
from ctopd_jax.loop.checkpoint import Checkpointer
from ctopd_jax.loop.trainer import Trainer

from conftest import subprocess_env

GRASS = {"algorithm": {"name": "mp_opd", "mp_opd_mode": "grass_chunk", "grass_chunk_atoms": 3,
                       "chunked_loss_size": 64},
         "rollout__generate_max_len": 40,
         # the demo models write clean text (random tiny models emit split UTF-8, which fails
         # every sample closed as replacement_character and leaves nothing to train)
         "model": {"student": "demo:student", "teacher": "demo:teacher"}, "data__path": "demo:train"}


def final_state(trainer):
    return jax.tree.map(np.asarray, trainer._state())


def comparable(records):
    return [run_values(r) for r in records]


def kill_and_resume(write_config, compile_cache, changes, **env):
    """(reference trainer, its run dir, resumed trainer, its run dir): the reference runs 4
    steps in this process; the other is a `ctopd_jax.train` process SIGKILLed once step 3 is
    logged and the step-2 checkpoint committed, then resumed here to step 4."""
    ref_cfg, ref_dir = write_config("reference", **changes)
    reference = Trainer(load_config(ref_cfg))
    reference.train()

    cfg, run_dir = write_config("killed", **changes)
    proc = subprocess.Popen([sys.executable, "-m", "ctopd_jax.train", "--config", str(cfg)],
                            env=subprocess_env(compile_cache, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    log = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    # kill once step 3 is logged and the (async) step-2 checkpoint is committed: Orbax renames
    # the step directory into place only when the write is complete
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
    assert resumed.train(resume=True).final_step == 4
    return reference, ref_dir, resumed, run_dir


def assert_same_run(reference, ref_dir, resumed, run_dir):
    for a, b in zip(jax.tree.leaves(final_state(reference)), jax.tree.leaves(final_state(resumed))):
        np.testing.assert_array_equal(a, b)
    assert resumed.objective.state_dict() == reference.objective.state_dict()  # bit-exact (JSON)
    got, want = comparable(read_metrics(run_dir)), comparable(read_metrics(ref_dir))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for got_row, want_row in zip(got, want):
        diff = {k for k in set(got_row) | set(want_row) if got_row.get(k) != want_row.get(k)}
        assert not diff, (got_row["step"], {k: (got_row.get(k), want_row.get(k)) for k in diff})


# a LoRA student (adapter-only parameters and optimizer state, dropout masks from the
# checkpointed RNG key) resumes as exactly as full fine-tuning
@pytest.mark.parametrize("student", ["full", pytest.param("lora", marks=pytest.mark.slow)])
def test_sigkill_between_checkpoints_then_resume_is_exact(write_config, compile_cache, student):
    lora = {"lora__rank": 4, "lora__dropout": 0.1} if student == "lora" else {}
    assert_same_run(*kill_and_resume(write_config, compile_cache, lora))


@pytest.mark.slow
def test_grass_sigkill_then_resume_is_exact(write_config, compile_cache):
    # no persistent cache in the child: on 8 host CPU devices the callback-free grass step
    # loaded from the XLA cache deadlocks in an all-gather rendezvous (compiled fresh it runs)
    reference, ref_dir, resumed, run_dir = kill_and_resume(
        write_config, compile_cache, GRASS, JAX_ENABLE_COMPILATION_CACHE="false")
    assert reference.objective.state_dict()["grass_noise_updates"] > 0, \
        "the run must exercise the noise estimate"
    assert_same_run(reference, ref_dir, resumed, run_dir)
    assert any("mp_opd_grass_alpha" in r for r in read_metrics(run_dir))
