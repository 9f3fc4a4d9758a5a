"""Which Pallas strict kernels lower for CUDA (Mosaic GPU), and how much shared memory each asks.

Exports every compiled chunk kernel with jax.export(platforms=["cuda"]) on this machine (no GPU
needed) at one chunk of the reference workload and prints one JSON line per kernel: status,
the shared memory Mosaic GPU allocates per program (read from its launch helper), the limit it
checks against (227 KiB when no device is present) and the export time.

    .venv/bin/python benchmarks/pallas_cuda_lowering.py [--rows 2048] [--cols 109567]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mgpu_core

from ctopd_jax.kernels.pallas_shared import passes
from ctopd_jax.kernels.strict_full import pallas as full_pallas
from ctopd_jax.kernels.strict_topk import pallas as topk_pallas

DIV_ITEMS = (("akl_alpha", 0.5), ("jsd_beta", 0.5), ("skl_lambda", 0.1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=109_567)
    parser.add_argument("--topk", type=int, nargs="*", default=[16, 128])
    args = parser.parse_args()
    seen = []
    size_of = mgpu_core._smem_tree_size

    def recording(tree):  # observe only: the size Mosaic GPU compares with its limit
        seen.append(size_of(tree))
        return seen[-1]

    mgpu_core._smem_tree_size = recording
    block = jax.ShapeDtypeStruct((args.rows, args.cols), jnp.float32)
    w = jax.ShapeDtypeStruct((args.rows,), jnp.float32)
    kernels = [("full", d, None) for d in passes.PALLAS_DIVERGENCES]
    kernels += [("topk", d, k) for k in args.topk for d in passes.PALLAS_DIVERGENCES]
    for kind, div, k in kernels:
        fn = (full_pallas.make_chunk_fn(div, 1.0, DIV_ITEMS, False) if k is None else
              topk_pallas.make_chunk_fn(div, k, 1.0, DIV_ITEMS, False))
        seen.clear()
        start = time.perf_counter()
        row = dict(kernel=kind, divergence=div, topk=k, rows=args.rows, cols=args.cols,
                   backend="mosaic_gpu")
        try:
            jax.export.export(jax.jit(fn), platforms=["cuda"])(block, block, w)
            row["status"] = "lowers"
        except Exception as err:  # noqa: BLE001  (reported, not raised)
            row["status"] = f"fails: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
        row["smem_bytes"] = max(seen) if seen else None
        row["smem_limit_bytes"] = 227 * 1024
        row["export_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
