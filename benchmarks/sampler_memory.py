"""Compile-only memory of the paged sampler's decode program at the seed's single-GPU config,
and the seconds of the optimizer-state offload against the pages it frees.

    python benchmarks/sampler_memory.py [--preset llama3_2_3b] [--slots 56] [--pages 36343]
        [--offload-gb 1.0]

1. Lowers and compiles (nothing runs, no allocation) the sampler's decode loop
   (rollout/paged_decode.decode_until_refill) for the preset in bf16 with `--slots` decode
   slots and a pool of `--pages` 16-token pages (defaults: what `python -m ctopd_jax.plan
   --config configs/single_gpu_full_workload.yaml --device h200 --set rollout.engine=jax`
   says fits beside the trainer's state: 36,343 pages, 56 full-length samples), and prints
   XLA's memory analysis against the planner's rows: arguments (decode weights + pool + slot
   buffers), outputs aliased to donated inputs, and temporaries (the step's own working set;
   a copy of the pool would show here). On CPU XLA computes bf16 in float32: with
   `--dtype bfloat16` the temporaries include float32 upcasts of the weights and of the pool
   that a GPU does not make; `--dtype float32` shows the program without them.
2. Times offload.move of an AdamW-like float32 state of `--offload-gb` GB to pinned host
   memory and back, and converts the bytes into 16-token pages of the preset. On this CPU
   "pinned host" and "device" are both host RAM: the seconds are a memcpy's, not a PCIe
   transfer's; the GPU figure is for scripts/gpu_check.py.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ctopd_jax.loop import offload
from ctopd_jax.models import PRESETS
from ctopd_jax.models.kv_cache import page_pool_token_bytes
from ctopd_jax.plan.model import param_count
from ctopd_jax.rollout.paged_decode import lower_decode

PAGE = 16


def compile_decode(cfg, slots: int, pages: int, max_new: int, prompt: int):
    start = time.perf_counter()
    compiled = lower_decode(cfg, slots, pages, PAGE, prompt, max_new).compile()
    return compiled.memory_analysis(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3_2_3b")
    parser.add_argument("--slots", type=int, default=56)
    parser.add_argument("--pages", type=int, default=36_343)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--max-new", type=int, default=8192)
    parser.add_argument("--offload-gb", type=float, default=1.0)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="weights and pool (float32: no bf16 -> f32 upcasts on CPU)")
    args = parser.parse_args()
    cfg = PRESETS[args.preset](dtype=args.dtype, param_dtype=args.dtype)
    print(f"jax {jax.__version__} on {jax.default_backend()}; {args.preset} {args.dtype}, "
          f"{args.slots} slots, {args.pages:,} pages of {PAGE} tokens")
    mem, seconds = compile_decode(cfg, args.slots, args.pages, args.max_new, args.prompt)
    weights = param_count(cfg) * jnp.dtype(args.dtype).itemsize
    pool = args.pages * PAGE * page_pool_token_bytes(cfg)   # K and V
    print(f"compiled in {seconds:.1f}s: arguments {mem.argument_size_in_bytes / 1e9:.2f} GB "
          f"(planner: decode weights {weights / 1e9:.2f} + pool {pool / 1e9:.2f} GB), outputs "
          f"{mem.output_size_in_bytes / 1e9:.2f} GB of which aliased "
          f"{mem.alias_size_in_bytes / 1e9:.2f} GB, temporaries {mem.temp_size_in_bytes / 1e9:.3f} GB")

    page_bytes = PAGE * page_pool_token_bytes(cfg)
    n = int(args.offload_gb * 1e9 / 4 / 2)
    state = {"mu": jnp.ones((n,), jnp.float32), "nu": jnp.ones((n,), jnp.float32) * 2}
    jax.block_until_ready(state)
    size = offload.tree_bytes(state)
    times = {}
    for kind in (offload.HOST, offload.DEVICE):
        start = time.perf_counter()
        state = offload.move(state, kind)
        times[kind] = time.perf_counter() - start
    assert float(state["nu"][0]) == 2.0 and np.asarray(state["mu"][:3]).tolist() == [1, 1, 1]
    print(f"offload of {size / 1e9:.2f} GB: to host {times[offload.HOST]:.3f}s, back "
          f"{times[offload.DEVICE]:.3f}s (CPU memcpy); frees {size / page_bytes:,.0f} pages "
          f"of {PAGE} tokens at {args.preset} = {size / page_bytes * PAGE:,.0f} cached tokens")


if __name__ == "__main__":
    main()
