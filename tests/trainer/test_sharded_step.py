"""The loss runs per batch shard on 8 host devices (data=4 x fsdp=2): equal to the one-unit
computation, and the compiled program never all-gathers hidden rows, logits or teacher rows.

Each shard's samples are prepared on their own (shard-local rows), stacked, and the objective
runs under shard_map over data x fsdp; only the lm_heads and the parameters (FSDP) may be
gathered. And on that mesh, updates after the first compile nothing new (compiles_once_check)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ctopd_jax.algorithms import get_objective
from ctopd_jax.algorithms.micro_batch import map_rows
from ctopd_jax.config import from_dict
from ctopd_jax.mesh.arrays import to_global
from ctopd_jax.mesh.device_mesh import make_mesh, shard_module
from ctopd_jax.models import tiny_llama, tiny_qwen2
from ctopd_jax.step import optimizer
from ctopd_jax.step.grad import STEP_PROGRAMS, lower_micro_grad, make_apply_update, micro_grad, zero_grads
from ctopd_jax.step.shards import stack_shards
from ctopd_jax.step.teacher import lm_head_of, teacher_hidden_rows

from test_student_step import VS, VT, host_batch, samples, tiny

M = 8  # one micro-batch: one sample per batch shard


def gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Result shapes of every all-gather in an optimized HLO module."""
    shapes = []
    for line in hlo.splitlines():
        if "all-gather(" in line or "all-gather-start(" in line:
            for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", line.split("=", 1)[1].split("all-gather")[0]):
                shapes.append(tuple(int(d) for d in dims.split(",") if d))
    return shapes


def on_eight_devices(call: str) -> None:
    """`call` (a function of this module) in a process of its own on 8 host devices, without the
    persistent compilation cache: inside the whole slow suite's process, jaxlib has crashed on
    this 8-device program (SIGSEGV / abort, in compiling it or in serializing it for the cache)
    in four suite runs; alone it never did."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", f"import test_sharded_step as t; t.{call}"],
                          cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow  # compiles the step twice for 8 devices (~15 s-1 min on 2 cores)
@pytest.mark.parametrize("name", ["span"])  # span = strict top-k rows + mismatch-group rows
def test_per_shard_loss_equals_one_unit_and_gathers_no_rows(name):
    on_eight_devices(f"per_shard_check({name!r})")


@pytest.mark.slow  # compiles the step and the update for 8 devices
@pytest.mark.parametrize("scan", [False, True])
def test_fsdp_updates_compile_the_step_and_the_update_once(scan):
    on_eight_devices(f"compiles_once_check({scan})")


def compiles_once_check(scan):
    """On data=4 x fsdp=2, the step and the update each compile one program for two updates of
    two micro-batches: the parameters are placed (logical_spec), and the running gradient
    started (zero_grads), on the shardings the programs return them with, spelled as jit
    spells them (P('fsdp') for P('fsdp', None): the other spelling compiled each twice)."""
    mesh = make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    student = shard_module(tiny(tiny_llama(vocab_size=VS, num_layers=2, scan_layers=scan), 0), mesh)
    teacher = shard_module(tiny(tiny_qwen2(vocab_size=VT, num_layers=1), 1), mesh)
    host = host_batch(samples(np.random.default_rng(5), M))
    objective = get_objective(from_dict({"algorithm": {"name": "strict", "chunked_loss_size": 8}}).algorithm)
    overlap = {"s_ids": jnp.arange(30, dtype=jnp.int32), "t_ids": jnp.arange(30, dtype=jnp.int32)}
    graphdef, params, rest = nnx.split(student, nnx.Param, ...)
    t_graph, t_state = nnx.split(teacher)
    tx = optax.adamw(1e-3)
    update = make_apply_update(tx, optax.constant_schedule(1e-3))
    opt_state = optimizer.init_state(tx, params, mesh)
    moments = [x.sharding for x in jax.tree.leaves(opt_state) if x.ndim]   # AdamW's mu, nu
    assert moments == [x.sharding for x in jax.tree.leaves(params)] * 2
    batch = to_global(stack_shards([objective.prepare(host, i, i + 1) for i in range(M)]), mesh)
    with jax.set_mesh(mesh):
        t_hidden = teacher_hidden_rows(t_graph, t_state, batch.teacher_ids, batch.teacher_mask,
                                       batch.teacher_rows, mesh=mesh)
        before = [f._cache_size() for f in STEP_PROGRAMS]
        for count in range(2):
            grads = zero_grads(params)
            for _ in range(2):
                loss, _, _, grads = micro_grad(params, rest, batch, t_hidden, lm_head_of(t_graph, t_state),
                                               overlap, jnp.float32(host.tokens(0, M)), grads,
                                               graphdef=graphdef, accumulation=2, objective=objective, mesh=mesh)
            params, opt_state, info = update(params, opt_state, grads, loss, np.int32(count))
            assert bool(info["update_applied"])
    assert [f._cache_size() for f in STEP_PROGRAMS] == [n + 1 for n in before]
    assert update._cache_size() == 1


def per_shard_check(name):
    rng = np.random.default_rng(5)
    mesh = make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    student = shard_module(tiny(tiny_llama(vocab_size=VS, num_layers=1), 0), mesh)
    teacher = shard_module(tiny(tiny_qwen2(vocab_size=VT, num_layers=1), 1), mesh)
    host = host_batch(samples(rng, M))
    if name == "span":  # one hand-made mismatch group per sample (a 2:1 group of response tokens)
        rows = [(i, 32 * i + s.teacher_prompt_len, 32 * i + s.teacher_prompt_len + 1,
                 32 * i + s.student_prompt_len - 1, 32 * i + s.student_prompt_len + 1)
                for i, s in enumerate(samples(np.random.default_rng(5), M))]
        host.alignment.mismatch_groups = np.array(rows, np.int32)
    settings = from_dict({"algorithm": {"name": name, "ctkd_topk": 5, "chunked_loss_size": 8}}).algorithm
    objective = get_objective(settings)
    overlap = {"s_ids": jnp.asarray(rng.choice(VS, 30, replace=False), jnp.int32),
               "t_ids": jnp.asarray(rng.choice(VT, 30, replace=False), jnp.int32)}
    graphdef, params, rest = nnx.split(student, nnx.Param, ...)
    t_graph, t_state = nnx.split(teacher)
    total = jnp.float32(host.tokens(0, M))

    def run(batch_arrays, step_mesh):
        batch = to_global(batch_arrays, mesh)
        t_hidden = teacher_hidden_rows(t_graph, t_state, batch.teacher_ids, batch.teacher_mask,
                                       batch.teacher_rows, mesh=step_mesh)
        args = (params, rest, batch, t_hidden, lm_head_of(t_graph, t_state), overlap, total)
        kw = dict(graphdef=graphdef, accumulation=1, objective=objective, mesh=step_mesh)
        hlo = "\n".join(lowered.compile().as_text() for lowered in lower_micro_grad(*args, zero_grads(params), **kw))
        return micro_grad(*args, zero_grads(params), **kw), hlo

    one_unit = objective.prepare(host, 0, M)
    (loss_1, _, _, grads_1), hlo_1 = run(one_unit, None)
    sharded = stack_shards([objective.prepare(host, i, i + 1) for i in range(M)])
    (loss_s, _, _, grads_s), hlo = run(sharded, mesh)
    np.testing.assert_allclose(float(loss_s), float(loss_1), rtol=2e-5)
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads_1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-7)

    def carries_rows(shape, arrays):
        tokens = int(np.prod(arrays.student_ids.shape))  # M * T hidden rows
        row_counts = set()   # the lengths of every row field (micro_batch.rows)
        map_rows(arrays, lambda rows, side, name: row_counts.add(len(rows)) or rows)
        return bool(set(shape) & ({tokens} | row_counts)) or shape[:1] == (M,)

    # the detector works: computed as one unit over batch-sharded arrays, rows are gathered
    assert any(carries_rows(shape, one_unit) for shape in gathered_shapes(hlo_1))
    # per shard, no gathered array carries the micro-batch's rows (hidden states, logits, teacher
    # rows) nor per-sample activations [M, T, ...]
    assert not [shape for shape in gathered_shapes(hlo) if carries_rows(shape, sharded)]
