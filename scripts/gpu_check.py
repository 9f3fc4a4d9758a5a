"""Staged GPU check: each stage a subprocess with a timeout, one JSON result per stage.

    python scripts/gpu_check.py [--out DIR] [--dry-run] [--only a,b]   # the driver
    python scripts/gpu_check.py --stage NAME --out DIR [--dry-run]      # one stage (what it runs)

The driver runs the stages in order, each as `--stage NAME` in its own process with its own
timeout (a hang or a crash in one stage costs only that stage), under an overall deadline of
TOTAL_BUDGET_S (8 minutes on an H100/H200). A stage that fails, crashes or times out is
recorded and the next one runs; the exit status is 1 if any stage did not end "ok" (2: bad arguments).
CTOPD_GPU_CHECK_FAIL=<stage> makes that stage raise (how the test checks the recording).
`--dry-run` runs every stage at tiny shapes on the CPU (Pallas in interpret mode) in under three
minutes: the rehearsal of the real run (tests/test_gpu_check.py runs it in CI).

Every stage writes $OUT/<stage>.json, and the driver $OUT/summary.json (8 files: what the lent
machine's tool brings back). Schema (STAGE_SCHEMA, checked by tests/test_gpu_check.py):
  stage     str    the stage's name
  status    str    "ok" | "failed" (an exception, or a check inside the stage failed)
                   | "timeout" (killed at its limit) | "crashed" (exited without a result)
  dry_run   bool   tiny CPU shapes
  seconds   float  wall time of the stage's process
  platform  str    jax's default backend ("gpu", "cpu"; "" if the stage never got that far)
  results   dict   the stage's numbers; a part that could not run holds
                   {"status": "not available" | "failed", "error": "..."} and does not fail
                   the stage unless the stage's purpose is that part
  error     str|null  one line: what went wrong
  log_tail  str    the last lines of the stage's stderr (driver-filled)
summary.json: {"stages": {name: status}, "ok": bool, "seconds": float, "dry_run": bool}.

Stages (results keys):
  env             jax version, devices, bytes_limit; copy_gbps (read + written bytes of an
                  elementwise pass over a large bf16 array), matmul_tflops (bf16 square product,
                  random data); median of repeats after a warm-up
  strict_kernels  strict full and top-16 (rkl) at V_S 128,256, V_T 151,665, V∩ 109,567, 2,048 rows
                  via kernels.api.strict_kd_sum: per implementation time, GB/s and its fraction of
                  copy_gbps, and for pallas the value and gradient error against xla
  attention       einsum vs blockwise (models/attention.py, if present) vs cuDNN
                  (jax.nn.dot_product_attention): output and gradient error against the einsum
                  in float32, time of forward + backward
  compile_memory  compile-only (no allocation) temp/argument/output bytes of teacher scoring,
                  the student step and a sampler prefill + decode step at the reference shapes,
                  against bytes_limit, with the planner's estimate beside the student step
  train_step      one Llama-3.2-3B student optimizer step (random weights): tokens/s and MFU
                  against the measured matmul rate
  sampler         JaxSampler tokens/s (random 3B weights, random prompts)
  pallas_tests    pytest tests/kernels with CTOPD_PALLAS_INTERPRET=0 (compiled for the GPU)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 480
STAGES = {  # name -> timeout in seconds on the GPU (sums to TOTAL_BUDGET_S)
    "env": 30, "strict_kernels": 70, "attention": 50, "compile_memory": 110,
    "train_step": 80, "sampler": 60, "pallas_tests": 80,
}
# Dry run: about 2 minutes of CPU time in all; the limits leave room for a loaded CI machine.
DRY_TIMEOUT_S, DRY_TOTAL_S = 300, 1500
FAIL_ENV = "CTOPD_GPU_CHECK_FAIL"  # a stage name: that stage raises (tests the recording)
STATUSES = ("ok", "failed", "timeout", "crashed")
STAGE_SCHEMA = {"stage": str, "status": str, "dry_run": bool, "seconds": float,
                "platform": str, "results": dict, "error": (str, type(None)), "log_tail": str}
V_S, V_T, V_SHARED, ROWS = 128_256, 151_665, 109_567, 2048


# ----------------------------------------------------------------------------- helpers
def _timed(fn, *args, repeat=5):
    """Median seconds of fn(*args) (blocked on its outputs) after one warm-up call."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel(a, b) -> float:
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _read(out: Path, stage: str) -> dict:
    try:
        return json.loads((out / f"{stage}.json").read_text())["results"]
    except (OSError, ValueError, KeyError):
        return {}


def _bytes_limit() -> int | None:
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _try(fn):
    """A part of a stage: its result, or {"status": "failed", "error": ...}."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - recorded, the stage goes on
        traceback.print_exc(limit=4)
        return {"status": "failed", "error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"}


def _failed(*parts) -> bool:
    return any(isinstance(p, dict) and p.get("status") == "failed" for p in parts)


def _chunked_nll(hidden_flat, lm_head, rows, targets, chunk: int):
    """-sum log softmax(hidden @ lm_head)[target] over `rows`, the lm_head applied `chunk` rows
    at a time under jax.checkpoint (the trainer's chunked-loss shape, kept here so the check
    does not depend on where the trainer keeps its own)."""
    import jax
    import jax.numpy as jnp
    h = jnp.take(hidden_flat, rows, axis=0)
    r = h.shape[0]
    c = max(1, min(chunk, r))
    pad = (-r) % c
    h = jnp.pad(h, ((0, pad), (0, 0)))
    t = jnp.pad(targets, (0, pad))
    w = lm_head.astype(h.dtype)

    @jax.checkpoint
    def one(pair):
        hc, tc = pair
        logits = jnp.einsum("rh,hv->rv", hc, w, preferred_element_type=jnp.float32)
        picked = jnp.take_along_axis(logits, tc[:, None], axis=1)[:, 0]
        return jax.nn.logsumexp(logits, axis=1) - picked

    out = jax.lax.map(one, (h.reshape(-1, c, h.shape[1]), t.reshape(-1, c)))
    return jnp.sum(out.reshape(-1)[:r])


# ----------------------------------------------------------------------------- stages
def stage_env(dry: bool, out: Path) -> dict:
    import jax
    import jax.numpy as jnp
    n = (1 << 20) if dry else (1 << 30)                # bf16 elements: 2 MB / 2 GB
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    seconds = _timed(copy, x, repeat=10)
    m = 256 if dry else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = _timed(jax.jit(jnp.matmul), a, b, repeat=10)
    import flax
    return {"jax": jax.__version__, "flax": flax.__version__, "devices": [str(d) for d in jax.devices()],
            "device_kind": jax.devices()[0].device_kind, "bytes_limit": _bytes_limit(),
            "copy_gbps": 2 * n * 2 / seconds / 1e9, "copy_bytes": 2 * n * 2,
            "matmul_tflops": 2 * m ** 3 / mm / 1e12, "matmul_n": m}


def stage_strict_kernels(dry: bool, out: Path) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from ctopd_jax.kernels import api
    vs, vt, vx, rows = (500, 600, 400, 32) if dry else (V_S, V_T, V_SHARED, ROWS)
    rng = np.random.default_rng(0)
    s_ids = jnp.asarray(rng.permutation(vs)[:vx].astype(np.int32))
    t_ids = jnp.asarray(rng.permutation(vt)[:vx].astype(np.int32))
    zs = jnp.asarray(rng.standard_normal((rows, vs), np.float32) * 3)
    zt = jnp.asarray(rng.standard_normal((rows, vt), np.float32) * 3)
    weight = jnp.ones((rows,), jnp.float32)
    copy_gbps = _read(out, "env").get("copy_gbps")
    moved = 4 * rows * (2 * vs + vt)                    # read both logits, write the gradient
    results = {"shape": {"rows": rows, "V_S": vs, "V_T": vt, "V_shared": vx}}
    for label, topk in (("full", None), ("top16", 16)):
        outs = {}
        for impl in ("xla", "pallas"):
            def loss(zs, zt, impl=impl):
                return api.strict_kd_sum(zs, zt, s_ids, weight, divergence="rkl", topk=topk,
                                         implementation=impl, chunk_rows=min(2048, rows),
                                         t_ids=t_ids, interpret=True if dry else False)

            def run(loss=loss):
                fn = jax.jit(jax.value_and_grad(loss))
                value, grad = fn(zs, zt)
                seconds = _timed(fn, zs, zt, repeat=1 if dry else 5)
                outs[impl] = (value, grad)
                gbps = moved / seconds / 1e9
                return {"seconds": seconds, "gbps": gbps, "value": float(value),
                        "fraction_of_copy": gbps / copy_gbps if copy_gbps else None}
            results[f"{label}/{impl}"] = _try(run)
        if "xla" in outs and "pallas" in outs:
            results[f"{label}/pallas"].update(
                value_rel_error=_rel(outs["pallas"][0], outs["xla"][0]),
                grad_rel_error=_rel(outs["pallas"][1], outs["xla"][1]))
    if _failed(*results.values()):
        raise RuntimeError("a strict kernel path failed: " + ", ".join(
            k for k, v in results.items() if _failed(v)))
    return results


def _attention_functions():
    """name -> fn(q, k, v) causal GQA attention, or a 'not available' reason."""
    import jax
    import jax.numpy as jnp
    fns, missing = {}, {}
    try:
        from ctopd_jax.models import attention as attn_mod
    except ImportError as err:
        attn_mod = None
        missing["blockwise"] = f"ctopd_jax.models.attention: {err}"
    mask_cls = getattr(attn_mod, "AttentionMask", None)

    def mask_for(q):
        b, t = q.shape[:2]
        return mask_cls(jnp.arange(t, dtype=jnp.int32), jnp.ones((b, t), bool))

    einsum = getattr(attn_mod, "attend_einsum", None)
    if einsum is not None and mask_cls is not None:
        fns["einsum"] = lambda q, k, v: einsum(q, k, v, mask_for(q))
    else:
        from ctopd_jax.models import decoder
        old = getattr(decoder, "attend", None)

        def dense(q, k, v):
            t = q.shape[1]
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (q.shape[0], t, t))
            return old(q, k, v, mask)
        fns["einsum"] = dense
    blockwise = getattr(attn_mod, "attend_blockwise", None)
    if blockwise is not None and mask_cls is not None:
        fns["blockwise"] = lambda q, k, v: blockwise(q, k, v, mask_for(q))
    else:
        missing.setdefault("blockwise", "models/attention.py has no attend_blockwise")
    if jax.default_backend() == "gpu":
        fns["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")
    else:
        missing["cudnn"] = f"cuDNN needs a GPU (backend {jax.default_backend()})"
    return fns, missing


def stage_attention(dry: bool, out: Path) -> dict:
    import jax
    import jax.numpy as jnp
    b, t, nq, nkv, d = (1, 256, 4, 2, 32) if dry else (1, 4096, 24, 8, 128)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, nq, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, t, nkv, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, t, nkv, d), jnp.float32)
    cot = jax.random.normal(keys[3], (b, t, nq, d), jnp.float32)
    fns, missing = _attention_functions()
    results = {"shape": {"batch": b, "seq": t, "q_heads": nq, "kv_heads": nkv, "head_dim": d}}
    ref_out = ref_grad = None
    for name in ("einsum", "blockwise", "cudnn"):
        if name not in fns:
            results[name] = {"status": "not available", "error": missing.get(name, "")}
            continue
        fn = fns[name]
        dtype = jnp.float32 if name == "einsum" else jnp.bfloat16

        def run(fn=fn, dtype=dtype, name=name):
            nonlocal ref_out, ref_grad

            def fwd_bwd(q, k, v):
                o, vjp = jax.vjp(fn, q, k, v)
                return o, vjp(cot.astype(o.dtype))
            step = jax.jit(fwd_bwd)
            args = [x.astype(dtype) for x in (q, k, v)]
            o, grads = step(*args)
            seconds = _timed(step, *args, repeat=1 if dry else 10)
            res = {"dtype": jnp.dtype(dtype).name, "seconds_fwd_bwd": seconds}
            if name == "einsum":
                ref_out, ref_grad = o, grads
            elif ref_out is not None:
                res["out_rel_error"] = _rel(o.astype(jnp.float32), ref_out)
                res["dq_rel_error"] = _rel(grads[0].astype(jnp.float32), ref_grad[0])
            return res
        results[name] = _try(run)
    if _failed(*results.values()):  # "not available" is not a failure
        raise RuntimeError("an attention path failed: " + ", ".join(
            k for k, v in results.items() if _failed(v)))
    return results


def _abstract_model(cfg):
    from flax import nnx
    from ctopd_jax.models import Decoder
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def _memory(compiled, limit) -> dict:
    mem = compiled.memory_analysis()
    res = {k: getattr(mem, f"{k}_size_in_bytes", None) for k in ("temp", "argument", "output")}
    total = sum(v for v in res.values() if v)
    res.update(total_bytes=total, bytes_limit=limit,
               fraction_of_limit=(total / limit) if limit else None)
    return res


def stage_compile_memory(dry: bool, out: Path) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from ctopd_jax import plan
    from ctopd_jax.models import PRESETS
    limit = _bytes_limit()
    if dry:
        s_name, t_name, batch, seq, chunk, slots, prompt = "tiny_llama", "tiny_qwen2", 2, 128, 64, 4, 32
    else:  # the reference workload, one GPU's share of micro_batch_size 16 over 8 GPUs;
        # 2,048 + 8,192 tokens (the EOS of a full-length response would make it 10,241; a
        # multiple of 128 keeps the attention kernels' tiling out of the question)
        s_name, t_name, batch, seq, chunk, slots, prompt = ("llama3_2_3b", "qwen2_5_7b", 2,
                                                            10_240, 2048, 64, 2048)
    common = {"dtype": "bfloat16", "remat": True}
    s_cfg = PRESETS[s_name](param_dtype="float32", **common)
    t_cfg = PRESETS[t_name](param_dtype="bfloat16", **common)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, seq), jnp.bool_)
    results = {"shapes": {"batch": batch, "seq": seq, "chunk": chunk, "sampler_slots": slots,
                          "sampler_prompt": prompt}}

    def teacher():
        from ctopd_jax.teacher import teacher_hidden_rows
        graphdef, state = _abstract_model(t_cfg)
        rows = jax.ShapeDtypeStruct((batch * seq // 2,), jnp.int32)
        lowered = teacher_hidden_rows.lower(graphdef, state, ids, mask, rows)
        return _memory(lowered.compile(), limit)

    def student():
        graphdef, state = _abstract_model(s_cfg)
        rows = jax.ShapeDtypeStruct((batch * seq // 2,), jnp.int32)

        def loss(state, ids, mask, rows):
            model = nnx.merge(graphdef, state)
            pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), ids.shape)
            hidden = model.hidden_states(ids, pos, mask)
            flat = hidden.reshape(-1, hidden.shape[-1])
            targets = jnp.take(ids.reshape(-1), rows)
            return _chunked_nll(flat, model.lm_head_weight(), rows, targets, chunk)
        lowered = jax.jit(jax.value_and_grad(loss)).lower(state, ids, mask, rows)
        res = _memory(lowered.compile(), limit)
        attention = plan.attention_kind(s_cfg, gpu=jax.default_backend() == "gpu")
        res["planner_activation_bytes"] = plan.activation_bytes(
            s_cfg, batch, seq, remat=True, attention=attention)
        res["planner_attention"] = attention
        return res

    def sampler():
        from ctopd_jax.models.kv_cache import init_cache
        s_bf16 = s_cfg.replace(param_dtype="bfloat16")
        graphdef, state = _abstract_model(s_bf16)
        cache_len = prompt + (64 if dry else 8192)

        def prefill_and_step(state, ids, mask):
            model = nnx.merge(graphdef, state)
            cache = init_cache(s_bf16, slots, cache_len)
            pos = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), ids.shape)
            logits, cache = model(ids, pos, mask, cache)
            nxt = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
            logits, cache = model(nxt, pos[:, -1:] + 1, jnp.ones_like(nxt, bool), cache)
            return logits
        p_ids = jax.ShapeDtypeStruct((slots, prompt), jnp.int32)
        p_mask = jax.ShapeDtypeStruct((slots, prompt), jnp.bool_)
        return _memory(jax.jit(prefill_and_step).lower(state, p_ids, p_mask).compile(), limit)

    for name, fn in (("teacher_scoring", teacher), ("student_step", student), ("sampler", sampler)):
        results[name] = _try(fn)
    if _failed(results["teacher_scoring"], results["student_step"], results["sampler"]):
        raise RuntimeError("a compile failed (see results)")
    return results


def stage_train_step(dry: bool, out: Path) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from ctopd_jax import plan
    from ctopd_jax.models import Decoder, PRESETS
    name, batch, seq = ("tiny_llama", 2, 64) if dry else ("llama3_2_3b", 2, 4096)
    cfg = PRESETS[name](dtype="bfloat16", param_dtype="float32", remat=True)
    model = nnx.jit(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))()
    graphdef, params = nnx.split(model)
    tx = optax.adamw(1e-6, b1=0.9, b2=0.98)
    opt_state = jax.jit(tx.init)(params)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, jnp.int32)
    rows = jnp.arange(batch * seq - 1, dtype=jnp.int32)

    def loss(params, ids):
        m = nnx.merge(graphdef, params)
        pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), ids.shape)
        flat = m.hidden_states(ids, pos).reshape(batch * seq, -1)
        targets = jnp.take(ids.reshape(-1), rows + 1)
        return _chunked_nll(flat, m.lm_head_weight(), rows, targets, 2048) / rows.shape[0]

    @jax.jit
    def step(params, opt_state, ids):
        value, grads = jax.value_and_grad(loss)(params, ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    t0 = time.perf_counter()
    params, opt_state, value = jax.block_until_ready(step(params, opt_state, ids))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(2 if dry else 3):
        t0 = time.perf_counter()
        params, opt_state, value = jax.block_until_ready(step(params, opt_state, ids))
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    tokens = batch * seq
    n_params = plan.param_count(cfg)
    flops = 8 * (n_params - cfg.vocab_size * cfg.hidden_size) * tokens + 8 * batch * (
        plan._attention_flops(cfg, seq, "causal")) + 6 * cfg.hidden_size * cfg.vocab_size * tokens
    peak = _read(out, "env").get("matmul_tflops")
    return {"model": name, "batch": batch, "seq": seq, "compile_s": compile_s,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "loss": float(value),
            "flops": flops, "tflops": flops / seconds / 1e12, "mfu_of_measured_matmul":
            (flops / seconds / 1e12 / peak) if peak else None,
            "flops_note": "8 x non-embedding params x tokens (remat: forward twice) + causal "
                          "attention + 6 x lm_head"}


def stage_sampler(dry: bool, out: Path) -> dict:
    import jax
    import numpy as np
    from flax import nnx
    from ctopd_jax.models import Decoder, PRESETS
    from ctopd_jax.rollout.base import SamplingParams
    from ctopd_jax.rollout.jax_sampler import JaxSampler
    name, prompts, prompt_len, new = ("tiny_llama", 4, 16, 16) if dry else ("llama3_2_3b", 64, 256, 256)
    cfg = PRESETS[name](dtype="bfloat16", param_dtype="bfloat16")
    model = nnx.jit(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))()
    rng = np.random.default_rng(0)
    batch = [list(map(int, rng.integers(1, cfg.vocab_size, prompt_len))) for _ in range(prompts)]
    sampler = JaxSampler(model, eos_ids=[0], pad_id=0)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=new, seed=0)
    t0 = time.perf_counter()
    sampler.generate(batch, params)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = sampler.generate(batch, params)
    seconds = time.perf_counter() - t0
    generated = sum(len(t) for t in result.token_ids)
    return {"model": name, "prompts": prompts, "prompt_len": prompt_len, "max_new_tokens": new,
            "first_call_s": first, "seconds": seconds, "generated_tokens": generated,
            "tokens_per_s": generated / seconds, "backend": jax.default_backend()}


def stage_pallas_tests(dry: bool, out: Path) -> dict:
    env = dict(os.environ, CTOPD_PALLAS_INTERPRET="1" if dry else "0")
    if not dry:
        env["JAX_PLATFORMS"] = "cuda"        # the conftest sets cpu only when unset
    target = (["tests/kernels/test_strict_pallas.py", "-k", "kernel_terms_match_row_terms"]
              if dry else ["tests/kernels"])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
           *target]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=(DRY_TIMEOUT_S if dry else STAGES["pallas_tests"]) - 10)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next((l for l in reversed(lines) if " passed" in l or " failed" in l
                    or " error" in l), lines[-1] if lines else "")
    res = {"command": " ".join(cmd[2:]), "returncode": proc.returncode, "summary": summary,
           "failures": [l for l in lines if l.startswith(("FAILED", "ERROR"))][:30]}
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exited {proc.returncode}: {summary}")
    return res


STAGE_FUNCTIONS = {"env": stage_env, "strict_kernels": stage_strict_kernels,
                   "attention": stage_attention, "compile_memory": stage_compile_memory,
                   "train_step": stage_train_step, "sampler": stage_sampler,
                   "pallas_tests": stage_pallas_tests}


# ----------------------------------------------------------------------------- running
def _record(out: Path, stage: str, **fields) -> dict:
    record = {"stage": stage, "status": "crashed", "dry_run": False, "seconds": 0.0,
              "platform": "", "results": {}, "error": None, "log_tail": ""}
    record.update(fields)
    (out / f"{stage}.json").write_text(json.dumps(record, indent=1, default=str))
    return record


def run_stage(stage: str, dry: bool, out: Path) -> int:
    """In the stage's own process: run it and write its JSON (the driver adds log_tail)."""
    t0 = time.perf_counter()
    platform, results, error, status = "", {}, None, "ok"
    try:
        import jax
        platform = jax.default_backend()
        if not dry and platform != "gpu":
            raise RuntimeError(f"jax backend is {platform!r}, not gpu: use --dry-run on a CPU")
        if os.environ.get(FAIL_ENV) == stage:
            raise RuntimeError(f"{FAIL_ENV}={stage}: failure requested")
        results = STAGE_FUNCTIONS[stage](dry, out)
    except Exception as err:  # noqa: BLE001 - the failure is the result
        traceback.print_exc()
        status, error = "failed", f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"
    _record(out, stage, status=status, dry_run=dry, seconds=time.perf_counter() - t0,
            platform=platform, results=results, error=error)
    return 0 if status == "ok" else 1


def drive(stages, dry: bool, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    statuses = {}
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    if dry:
        env["JAX_PLATFORMS"] = "cpu"
    for stage in stages:
        budget = DRY_TIMEOUT_S if dry else STAGES[stage]
        left = (DRY_TOTAL_S if dry else TOTAL_BUDGET_S) - (time.perf_counter() - start)
        timeout = max(1, min(budget, int(left)))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--out", str(out)]
        if dry:
            cmd.append("--dry-run")
        t0 = time.perf_counter()
        (out / f"{stage}.json").unlink(missing_ok=True)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            stderr, timed_out = proc.stderr, False
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            timed_out = True
        seconds = time.perf_counter() - t0
        tail = "\n".join(stderr.strip().splitlines()[-25:])
        path = out / f"{stage}.json"
        if timed_out:
            record = _record(out, stage, status="timeout", dry_run=dry, seconds=seconds,
                             error=f"killed after its {timeout} s limit", log_tail=tail)
        elif path.is_file():
            record = json.loads(path.read_text())
            record["log_tail"] = tail
            path.write_text(json.dumps(record, indent=1, default=str))
        else:
            record = _record(out, stage, status="crashed", dry_run=dry, seconds=seconds,
                             error=f"exited {proc.returncode} without a result", log_tail=tail)
        statuses[stage] = record["status"]
        print(f"[gpu_check] {stage:<15} {record['status']:<8} {seconds:6.1f} s"
              + (f"  {record['error']}" if record.get("error") else ""), flush=True)
    ok = all(s == "ok" for s in statuses.values())
    summary = {"stages": statuses, "ok": ok, "seconds": time.perf_counter() - start,
               "dry_run": dry}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[gpu_check] {'all stages ok' if ok else 'some stages did not pass'} in "
          f"{summary['seconds']:.0f} s; results in {out}", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "gpu_check_out"))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--stage", choices=sorted(STAGE_FUNCTIONS), help="run one stage here")
    parser.add_argument("--only", default="", help="comma-separated stages for the driver")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.stage:
        out.mkdir(parents=True, exist_ok=True)
        return run_stage(args.stage, args.dry_run, out)
    stages = [s for s in STAGES if not args.only or s in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - set(STAGES)
    if unknown:
        print(f"gpu_check: error: --only {','.join(sorted(unknown))}: unknown stage(s); use "
              f"{', '.join(STAGES)}", file=sys.stderr)
        return 2
    return drive(stages, args.dry_run, out)


if __name__ == "__main__":
    sys.exit(main())
