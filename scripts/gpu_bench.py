"""GPU timing of the strict loss + gradient at the real shapes: pallas vs xla vs PyTorch.

Called by scripts/gpu_check.sh (self-contained: needs jax with CUDA and torch with CUDA, nothing
else installed; the repository is imported from its checkout). Prints one line per
(implementation, objective) with time, peak device memory and the loss difference to torch,
plus a JSON summary at the end. Every implementation is wrapped in try/except so one failing
lowering (for example the Pallas Mosaic GPU backend) does not hide the others' numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

V_S, V_T, V_SHARED = 128_256, 151_665, 109_567


def _inputs(rows, seed=0):
    import numpy as np
    rng = np.random.default_rng(seed)
    s_ids = rng.permutation(V_S)[:V_SHARED].astype(np.int32)
    t_ids = rng.permutation(V_T)[:V_SHARED].astype(np.int32)
    zs = (rng.standard_normal((rows, V_S), np.float32) * 3)
    zt = (rng.standard_normal((rows, V_T), np.float32) * 3)
    return zs, zt, s_ids, t_ids


def bench_torch(data, topk, repeat):
    import torch
    zs_np, zt_np, s_ids, t_ids = data
    dev = torch.device("cuda")
    zs = torch.from_numpy(zs_np).to(dev).requires_grad_(True)
    zt = torch.from_numpy(zt_np).to(dev)
    s_idx = torch.from_numpy(s_ids).long().to(dev)
    t_idx = torch.from_numpy(t_ids).long().to(dev)

    def step():
        zs.grad = None
        loss = _torch_rows(zs, zt, s_idx, t_idx, topk).sum()
        loss.backward()
        return loss

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base
    value = float(loss.detach())
    del zs, zt
    torch.cuda.empty_cache()
    return dict(seconds=min(times), peak_gb=peak / 1e9, value=value)


def _torch_rows(zs, zt, s_idx, t_idx, topk):
    """The PyTorch reference's math on device tensors (project, optional top-k, rkl)."""
    import torch
    zs_bar = zs.index_select(1, s_idx)
    zt_bar = zt.index_select(1, t_idx)
    if topk is not None:
        idx = torch.topk(zs_bar.detach(), topk, dim=-1).indices
        zs_bar, zt_bar = zs_bar.gather(1, idx), zt_bar.gather(1, idx)
    log_ps = torch.log_softmax(zs_bar.float(), -1)
    log_pt = torch.log_softmax(zt_bar.float(), -1)
    return (log_ps.exp() * (log_ps - log_pt)).sum(-1)


def bench_jax(data, topk, implementation, repeat, chunk_rows):
    import jax
    import jax.numpy as jnp
    from ctopd_jax.kernels import api
    zs_np, zt_np, s_ids, t_ids = data
    rows = zs_np.shape[0]

    def loss(zs, zt, s, t):
        return api.strict_kd_sum(zs, zt, s, jnp.ones((rows,), jnp.float32), divergence="rkl",
                                 topk=topk, implementation=implementation,
                                 chunk_rows=chunk_rows, t_ids=t, interpret=False)

    fn = jax.jit(jax.value_and_grad(loss))
    args = [jnp.asarray(x) for x in (zs_np, zt_np, s_ids, t_ids)]
    compiled = fn.lower(*args).compile()
    value, grad = compiled(*args)
    jax.block_until_ready(grad)
    del grad
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        value, grad = compiled(*args)
        jax.block_until_ready(grad)
        times.append(time.perf_counter() - t0)
        del grad
    mem = compiled.memory_analysis()
    temp_gb = getattr(mem, "temp_size_in_bytes", 0) / 1e9 if mem is not None else float("nan")
    out_gb = getattr(mem, "output_size_in_bytes", 0) / 1e9 if mem is not None else float("nan")
    return dict(seconds=min(times), peak_gb=temp_gb + out_gb, value=float(value))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunk-rows", type=int, default=2048)
    args = parser.parse_args()
    import jax
    print(f"jax {jax.__version__} devices {jax.devices()} rows={args.rows} "
          f"chunk_rows={args.chunk_rows}", flush=True)
    data = _inputs(args.rows)
    results = {}
    for label, topk in (("full", None), ("top16", 16)):
        runs = [("torch", lambda: bench_torch(data, topk, args.repeat))]
        for impl in ("xla", "pallas"):
            runs.append((impl, lambda impl=impl: bench_jax(data, topk, impl, args.repeat,
                                                          args.chunk_rows)))
        if os.environ.get("CTOPD_PALLAS_GPU_BACKEND") is None:
            runs.append(("pallas[triton]", lambda: _with_backend(
                "triton", lambda: bench_jax(data, topk, "pallas", args.repeat, args.chunk_rows))))
        for name, run in runs:
            try:
                res = run()
            except Exception as err:  # report and go on: one lowering failure must not hide others
                res = dict(error=f"{type(err).__name__}: {str(err)[:400]}")
                traceback.print_exc(limit=3)
            results[f"{label}/{name}"] = res
            print(f"[{label}] {name}: {res}", flush=True)
        ref = results.get(f"{label}/torch", {})
        for name in ("xla", "pallas", "pallas[triton]"):
            ours = results.get(f"{label}/{name}", {})
            if "seconds" in ours and "seconds" in ref:
                print(f"[{label}] {name}/torch time ratio {ours['seconds'] / ref['seconds']:.2f}x, "
                      f"loss rel.diff {abs(ours['value'] - ref['value']) / abs(ref['value']):.1e}",
                      flush=True)
    print("SUMMARY " + json.dumps(results))


def _with_backend(name, fn):
    os.environ["CTOPD_PALLAS_GPU_BACKEND"] = name
    try:
        return fn()
    finally:
        os.environ.pop("CTOPD_PALLAS_GPU_BACKEND", None)


if __name__ == "__main__":
    main()
