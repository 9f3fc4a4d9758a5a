"""Compile time of a preset's random initialiser: the tensor-by-tensor draw (models/init.py)
against the one-program constructor it replaced (`nnx.jit(lambda: Decoder(cfg, rngs=...))`),
measured in the same run. Nothing runs; each program is lowered and compiled only.

    python benchmarks/init_compile.py [--presets llama3_2_3b,qwen2_5_7b] [--scan]

For the draw the time includes building the abstract module (nnx.eval_shape) and every
distinct one-tensor program; for the constructor, tracing and compiling the whole Decoder.
Prints one line per preset and the ratio (constructor / draw).
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from ctopd_jax.models import PRESETS, Decoder
from ctopd_jax.models.init import draw_plan


def compile_draw(cfg) -> tuple[float, int]:
    """(seconds, programs compiled) for models/init.py's plan of `cfg`."""
    t0 = time.perf_counter()
    _, entries = draw_plan(cfg)
    distinct = {id(draw): draw for _, _, draw, _ in entries}
    for draw in distinct.values():
        draw.lower(np.uint32(0), np.uint32(0)).compile()
    return time.perf_counter() - t0, len(distinct)


def compile_constructor(cfg) -> float:
    t0 = time.perf_counter()
    jax.jit(lambda key: nnx.state(Decoder(cfg, rngs=nnx.Rngs(key)))).lower(
        jax.random.key(0)).compile()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="llama3_2_3b,qwen2_5_7b")
    parser.add_argument("--scan", action="store_true", help="scan_layers=True (same parameters)")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.default_backend()}, {jax.device_count()} device(s)")
    for name in args.presets.split(","):
        param_dtype = "bfloat16" if name.startswith("qwen") else "float32"
        cfg = PRESETS[name](dtype="bfloat16", param_dtype=param_dtype, scan_layers=args.scan)
        draw_s, programs = compile_draw(cfg)
        ctor_s = compile_constructor(cfg)
        print(f"{name:<12} {param_dtype:<9} layers {cfg.num_layers:>2}: draw {draw_s:6.2f} s "
              f"({programs} programs), constructor {ctor_s:6.2f} s, ratio {ctor_s / draw_s:5.1f}x",
              flush=True)


if __name__ == "__main__":
    main()
