"""Blockwise attention vs the einsum reference, and the 3B student gradient's memory.

    python benchmarks/attention.py [--seq 4096] [--repeat 3] [--skip-preset]

Part 1, attention alone (CPU, float32, causal, GQA 8 query / 2 kv heads, head_dim 64, batch 1):
time of one jitted forward+backward (best of `repeat` after a warm-up) and XLA's compile-only
temporary bytes of that call, blockwise (block 512) vs einsum, printed as ratios.

Part 2, the llama3_2_3b preset with 2 layers, batch 2: compile-only temporary bytes of
d(sum of final hidden states)/d(params) (ctopd_jax.models.memory_probe) at T = 5,120 and
10,240 for the einsum reference, blockwise attention, and blockwise with layers under scan,
full remat and a 1,024-token MLP chunk (bf16 and float32 master weights).  Nothing is
allocated, so the einsum figures (100+ GB) are only asked for, never held.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ctopd_jax.models.attention import AttentionMask, attend_blockwise, attend_einsum  # noqa: E402
from ctopd_jax.models.config import llama3_2_3b  # noqa: E402
from ctopd_jax.models.memory_probe import student_grad_temp_bytes  # noqa: E402


def attention_alone(seq: int, repeat: int) -> None:
    b, nq, nkv, d = 1, 8, 2, 64
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(b, seq, nq, d), jnp.float32)
    k = jnp.asarray(rng.randn(b, seq, nkv, d), jnp.float32)
    v = jnp.asarray(rng.randn(b, seq, nkv, d), jnp.float32)
    mask = AttentionMask(jnp.arange(seq, dtype=jnp.int32), jnp.ones((b, seq), bool))
    impls = {"einsum": lambda q, k, v: attend_einsum(q, k, v, mask),
             "blockwise": lambda q, k, v: attend_blockwise(q, k, v, mask, 512, 512)}
    results = {}
    for name, fn in impls.items():
        step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2),
                                          argnums=(0, 1, 2)))
        compiled = step.lower(q, k, v).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        jax.block_until_ready(compiled(q, k, v))
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            best = min(best, time.perf_counter() - start)
        results[name] = (best, temp)
        print(f"  {name:9s} fwd+bwd {best * 1e3:9.1f} ms   temp {temp / 1e9:7.3f} GB", flush=True)
    (t_b, m_b), (t_e, m_e) = results["blockwise"], results["einsum"]
    print(f"  blockwise / einsum: time {t_b / t_e:.2f}x, temp memory {m_b / m_e:.3f}x")


def preset_memory() -> None:
    variants = {
        "einsum, unrolled, no remat": dict(attention="einsum"),
        "blockwise, unrolled, no remat": dict(attention="blockwise"),
        "blockwise, scan, remat full, mlp_chunk 1024 (bf16 params)":
            dict(attention="blockwise", scan_layers=True, remat_policy="full", mlp_chunk=1024),
        "blockwise, scan, remat full, mlp_chunk 1024 (f32 params)":
            dict(attention="blockwise", scan_layers=True, remat_policy="full", mlp_chunk=1024,
                 param_dtype="float32"),
    }
    for name, options in variants.items():
        cfg = llama3_2_3b(num_layers=2, **options)
        temps = {}
        for seq in (5120, 10240):
            start = time.perf_counter()
            temps[seq] = student_grad_temp_bytes(cfg, 2, seq)
            print(f"  {name}: T={seq:6d} temp {temps[seq] / 1e9:8.2f} GB "
                  f"(compile {time.perf_counter() - start:.0f} s)", flush=True)
        print(f"  {name}: T=10,240 / T=5,120 = {temps[10240] / temps[5120]:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-preset", action="store_true")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} cpus")
    print(f"attention alone, T={args.seq}:")
    attention_alone(args.seq, args.repeat)
    if not args.skip_preset:
        print("llama3_2_3b, 2 layers, B=2, student gradient (compile only):")
        preset_memory()


if __name__ == "__main__":
    main()
