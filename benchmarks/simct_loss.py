"""SimCT loss path vs Strict full at the real vocabulary shapes (Qwen2.5 → Llama-3.2).

    python benchmarks/simct_loss.py [--rows 512] [--hidden 256] [--span-fraction 0.1] [--chunk 128]

|V_S| = 128,256, |V_T| = 151,665, |V∩| = 109,567 (SPEC §10). Hidden sizes are reduced (default
256; the paper models use 3,072 / 3,584) so the lm_heads fit a small CPU: the loss path's cost is
dominated by the vocabulary dimension. Both objectives get the same aligned rows (R segments =
R strict pairs); SimCT additionally has `span-fraction` of its rows as spans of 3 student and 2
teacher tokens. Measured, in the same process: the forward+backward time of the objective's
sums w.r.t. (hidden, lm_head) (median of 3 after compilation) and XLA's compile-time memory
analysis (temp bytes) of that program. Prints ratios SimCT ÷ strict for both span-score modes.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ctopd_jax.algorithms import get_objective
from ctopd_jax.algorithms.base import StepInputs
from ctopd_jax.algorithms.micro_batch import MicroBatch
from ctopd_jax.algorithms.simct import SimctTerms
from ctopd_jax.algorithms.strict import StrictPairs
from ctopd_jax.config import from_dict

V_S, V_T, V_SHARED = 128_256, 151_665, 109_567


def inputs(rows: int, hidden: int, span_fraction: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    n_flat = 4 * rows
    hs = jnp.asarray(rng.normal(size=(n_flat, hidden)).astype(np.float32) * 0.1)
    ws = jnp.asarray(rng.normal(size=(hidden, V_S)).astype(np.float32) * 0.05)
    wt = jnp.asarray(rng.normal(size=(hidden, V_T)).astype(np.float32) * 0.05)
    s_ids = jnp.asarray(np.sort(rng.choice(V_S, V_SHARED, replace=False)).astype(np.int32))
    t_ids = jnp.asarray(rng.choice(V_T, V_SHARED, replace=False).astype(np.int32))
    first = np.sort(rng.choice(n_flat, rows, replace=False)).astype(np.int32)
    span = rng.random(rows) < span_fraction
    spans = np.flatnonzero(span)
    s_tok = np.concatenate([first[spans] + k for k in range(3)]) % n_flat if len(spans) else np.zeros(0, np.int32)
    s_grp = np.concatenate([spans] * 3) if len(spans) else np.zeros(0, np.int64)
    t_grp = np.concatenate([spans] * 2) if len(spans) else np.zeros(0, np.int64)
    pad = lambda a, n: np.pad(a, (0, n - len(a)))  # noqa: E731
    ns, nt = max(64, len(s_tok)), max(64, len(t_grp))
    simct = SimctTerms(**{
        "simct_student_first": first, "simct_teacher_first": first,
        "simct_weight": np.ones(rows, np.float32), "simct_is_span": span.astype(np.float32),
        "simct_student_count": np.where(span, 3, 0).astype(np.float32),
        "simct_teacher_count": np.where(span, 2, 0).astype(np.float32),
        "simct_student_rows": pad(s_tok, ns).astype(np.int32),
        "simct_student_targets": rng.integers(0, V_S, ns).astype(np.int32),
        "simct_student_group": pad(s_grp, ns).astype(np.int32),
        "simct_student_token_weight": pad(np.ones(len(s_tok)), ns).astype(np.float32),
        "simct_teacher_targets": rng.integers(0, V_T, nt).astype(np.int32),
        "simct_teacher_group": pad(t_grp, nt).astype(np.int32),
        "simct_teacher_token_weight": pad(np.ones(len(t_grp)), nt).astype(np.float32),
        "simct_aligned_tokens": np.float32(rows), "simct_sample_tokens": np.float32(rows),
        "simct_samples": np.float32(1),
    })
    t_hidden_simct = jnp.asarray(rng.normal(size=(rows + nt, hidden)).astype(np.float32) * 0.1)
    strict = StrictPairs(strict_student_rows=first, strict_weight=np.ones(rows, np.float32))
    t_hidden_strict = t_hidden_simct[:rows]
    return hs, ws, wt, {"s_ids": s_ids, "t_ids": t_ids}, simct, t_hidden_simct, strict, t_hidden_strict


def program(name: str, mode: str | None, chunk: int, wt, overlap, terms, t_hidden):
    algo = {"name": name, "chunked_loss_size": chunk, "kd_loss_fn": "rkl"}
    if mode:
        algo["span_score_mode"] = mode
    obj = get_objective(from_dict({"algorithm": algo}).algorithm)
    batch = jax.tree.map(jnp.asarray, MicroBatch(terms=terms))
    key = "strict" if name == "strict" else "simct"

    def f(h, w):
        x = StepInputs(h, w, t_hidden, wt, batch, overlap, None)
        return obj.kd_sums(x)[0][key]

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def measure(fn, hs, ws):
    compiled = fn.lower(hs, ws).compile()
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    jax.block_until_ready(fn(hs, ws))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(hs, ws))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), temp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--span-fraction", type=float, default=0.1)
    ap.add_argument("--chunk", type=int, default=128)
    args = ap.parse_args(argv)
    hs, ws, wt, overlap, simct, th_simct, strict, th_strict = inputs(args.rows, args.hidden, args.span_fraction)
    base_t, base_m = measure(program("strict", None, args.chunk, wt, overlap, strict, th_strict), hs, ws)
    print(f"machine: {platform.machine()} {jax.devices()[0].platform}, rows {args.rows}, hidden {args.hidden}, "
          f"chunk {args.chunk}, span rows {args.span_fraction:.0%}, |V_S| {V_S}, |V_T| {V_T}, |V∩| {V_SHARED}")
    print("| loss path | time (s) | time ÷ strict | temp memory (MB) | memory ÷ strict |")
    print("|---|---|---|---|---|")
    print(f"| strict full | {base_t:.3f} | 1.00 | {base_m / 2**20:.1f} | 1.00 |")
    for mode in ("raw_logit", "mean_logprob"):
        t, m = measure(program("simct", mode, args.chunk, wt, overlap, simct, th_simct), hs, ws)
        print(f"| simct {mode} | {t:.3f} | {t / base_t:.2f} | {m / 2**20:.1f} | {m / base_m:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
