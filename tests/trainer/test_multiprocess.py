"""Two local processes with jax.distributed (4 CPU devices each, one 8-device mesh
data=2 x fsdp=4 over both) train a few steps and agree with a single-process run on the same
mesh shape: same exported student weights and the same logged losses, while each process
sampled only its shard of the prompts (the gathered host batches are identical). The single-process run
also checks that the teacher never changes and that the exported student loads in transformers
with the same logits. A two-process run SIGKILLed after a checkpoint and resumed by two new
processes ends bit-exact with an uninterrupted two-process run."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import yaml
from flax import nnx
from transformers import AutoModelForCausalLM
from safetensors.numpy import load_file

from ctopd_jax.common.metrics import read_metrics, run_values
from ctopd_jax.config import load_config
from ctopd_jax.loop.trainer import Trainer

from conftest import subprocess_env, tiny_tree


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write(tmp_path, name, steps=2, every=0):
    tree = tiny_tree(tmp_path / name, steps=steps, **{"checkpoint.every": every, "checkpoint.export_hf": True})
    tree["mesh"] = {"data": 2, "fsdp": 4, "tensor": 1}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path, tmp_path / name


def launch(cfg, compile_cache, *args):
    """Two `ctopd_jax.train` processes (4 CPU devices each) joined by jax.distributed, without the
    persistent compilation cache: JAX writes cache entries from process 0 only and process 1's
    cache keys differ, so a second launch on a warm cache runs process 0 on cached executables and
    process 1 on fresh compiles, and (jax 0.10.2, gloo) process 0 then aborts in step 1 with a
    collective size mismatch ("op.preamble.length <= op.nbytes. 9696 vs 32"). Cold on both sides,
    the launches agree."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "ctopd_jax.train", "--config", str(cfg), *args],
                             env=subprocess_env(compile_cache, devices=4, CTOPD_COORDINATOR=f"127.0.0.1:{port}",
                                                CTOPD_NUM_PROCESSES="2", CTOPD_PROCESS_ID=str(i),
                                                JAX_ENABLE_COMPILATION_CACHE="false"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]


def finish(procs, timeout=900):
    outputs = [p.communicate(timeout=timeout)[0].decode() for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]


def logged_steps(run_dir):
    log = run_dir / "metrics.jsonl"
    return [json.loads(l)["step"] for l in log.read_text().splitlines() if l.strip()] if log.is_file() else []


@pytest.mark.slow  # ~2-3 minutes on 2 cores: run by .ci/run in the slow step
def test_two_processes_agree_with_one(tmp_path, compile_cache):
    cfg, single_dir = write(tmp_path, "single")
    trainer = Trainer(load_config(cfg))
    teacher_before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.default_parts.model))]
    student_before = np.array(trainer.student.embed[...])
    trainer.train()
    # the teacher is frozen: not one of its parameters moved
    for a, b in zip(teacher_before, jax.tree.leaves(nnx.state(trainer.default_parts.model))):
        np.testing.assert_array_equal(a, np.asarray(b))
    # the exported student loads in transformers and computes what the trained student computes
    hf = AutoModelForCausalLM.from_pretrained(single_dir / "hf_student", dtype=torch.float32)
    ids = np.array([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        hf_logits = hf(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(trainer.student(jnp.asarray(ids), jnp.arange(ids.shape[1])[None]))
    np.testing.assert_allclose(hf_logits, ours, rtol=1e-4, atol=1e-4)

    cfg, multi_dir = write(tmp_path, "multi")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "ctopd_jax.train", "--config", str(cfg)],
                              env=subprocess_env(compile_cache, devices=4, CTOPD_COORDINATOR=f"127.0.0.1:{port}",
                                                 CTOPD_NUM_PROCESSES="2", CTOPD_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outputs = [p.communicate(timeout=900)[0].decode() for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]

    single = load_file(str(single_dir / "hf_student" / "model.safetensors"))
    multi = load_file(str(multi_dir / "hf_student" / "model.safetensors"))
    assert single.keys() == multi.keys()
    for name in single:
        # Adam turns reduction-order noise in near-zero gradients into up to ~1e-3 x lr
        np.testing.assert_allclose(multi[name], single[name], rtol=1e-4, atol=1e-5, err_msg=name)
    s_log, m_log = read_metrics(single_dir), read_metrics(multi_dir)
    assert [r["step"] for r in m_log] == [1, 2]
    # one engine per process: each generated only its shard (2 of the 4 prompts, 2 samples each)
    assert [r["rollout_shard_samples"] for r in s_log] == [8, 8]
    assert [r["rollout_shard_samples"] for r in m_log] == [4, 4]
    for a, b in zip(s_log, m_log):
        for key in ("loss", "grad_norm", "coverage_student", "strict_pairs", "student_response_tokens"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)
    # training changed the student (two steps at lr 1e-3 after warmup): the embedding moved
    trained = single["model.embed_tokens.weight"][:student_before.shape[0]]
    assert np.abs(trained - student_before).max() > 1e-5


@pytest.mark.slow  # ~7-8 minutes on 2 cores (three cold two-process launches)
def test_two_processes_resume_bit_exact(tmp_path, compile_cache):
    """Two processes train 3 steps (a checkpoint every step); both are SIGKILLed once step 2's
    checkpoint is committed, two new processes resume with --resume, and the exported student and
    the logged metrics equal an uninterrupted two-process 3-step run's bit for bit."""
    ref_cfg, ref_dir = write(tmp_path, "reference", steps=3, every=1)
    finish(launch(ref_cfg, compile_cache))

    cfg, run_dir = write(tmp_path, "killed", steps=3, every=1)
    procs = launch(cfg, compile_cache)
    ck_dir = run_dir / "checkpoints"
    deadline = time.time() + 600
    # Orbax renames a step directory into place only when every process has written its part;
    # step 2 is logged right after its save is started. Step 3 reuses step 2's programs, so the
    # window before checkpoint 3 is committed is about a second and a half of work on 2 cores.
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if (ck_dir / "2").is_dir() and 2 in logged_steps(run_dir):
            break
        time.sleep(0.02)
    running = [p.poll() is None for p in procs]
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    outputs = [p.communicate()[0].decode() for p in procs]
    assert all(running), "\n".join(o[-3000:] for o in outputs)
    committed = sorted(int(d.name) for d in ck_dir.iterdir() if d.name.isdigit())
    assert committed == [1, 2], committed          # killed before step 3 was committed
    assert not (run_dir / "hf_student").exists()

    finish(launch(cfg, compile_cache, "--resume"))
    ref = load_file(str(ref_dir / "hf_student" / "model.safetensors"))
    got = load_file(str(run_dir / "hf_student" / "model.safetensors"))
    assert ref.keys() == got.keys()
    for name in ref:
        assert np.array_equal(got[name], ref[name]), name
    comparable = [[run_values(r) for r in read_metrics(d)] for d in (ref_dir, run_dir)]
    assert [r["step"] for r in comparable[1]] == [1, 2, 3]
    assert comparable[1][2]["loss"] == comparable[0][2]["loss"]
    assert comparable[1] == comparable[0]
