"""Peak memory of the teacher-to-loss path at the real shapes: before vs after the one teacher path.

    python benchmarks/teacher_path_memory.py [--rows 8192] [--dtype bfloat16]

Both programs start from the teacher's final hidden rows at the strict pairs [R, H_T] and the
student's hidden rows [R, H_S], and end with the strict-full rkl loss and its gradient w.r.t.
the student hidden rows and lm_head (the chunked kernel, chunked_loss_size 2048):

- before: the teacher's V∩ logits are formed for all rows first ([R, V∩], what the earlier
  `teacher_scores` stage handed to the student step), then the kernel reads them chunk by chunk;
- after: the kernel computes each chunk's teacher V∩ logits from (hidden rows, lm_head) beside
  the student's, so only [R, H_T] crosses.

Shapes: Qwen2.5-7B teacher (H_T 3,584, V_T 151,665), Llama-3.2-3B student (H_S 3,072,
V_S 128,256), V∩ 109,567. Memory is XLA's compile-only accounting (temp + output bytes,
`memory_analysis()`), so nothing of that size is allocated here; the ratio is what matters.
"""
from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp

from ctopd_jax.kernels import strict_kd_rows

H_T, V_T, H_S, V_S, V_SHARED = 3584, 151_665, 3072, 128_256, 109_567


def program(before: bool, chunk: int):
    def loss_and_grad(s_hidden, s_head, t_hidden, t_head, s_ids, t_ids, weight):
        if before:  # the [R, V∩] teacher array of the old stage boundary
            teacher, cols = jnp.dot(t_hidden, jnp.take(t_head, t_ids, axis=1),
                                    preferred_element_type=jnp.float32).astype(t_hidden.dtype), None
        else:
            teacher, cols = (t_hidden, t_head), t_ids

        def f(h, w):
            return strict_kd_rows((h, w), teacher, s_ids, weight, t_ids=cols, divergence="rkl",
                                  chunk_rows=chunk)[0]
        return jax.value_and_grad(f, argnums=(0, 1))(s_hidden, s_head)
    return jax.jit(loss_and_grad)


def measure(before: bool, rows: int, dtype, chunk: int) -> int:
    spec = jax.ShapeDtypeStruct
    args = (spec((rows, H_S), dtype), spec((H_S, V_S), dtype), spec((rows, H_T), dtype),
            spec((H_T, V_T), dtype), spec((V_SHARED,), jnp.int32), spec((V_SHARED,), jnp.int32),
            spec((rows,), jnp.float32))
    stats = program(before, chunk).lower(*args).compile().memory_analysis()
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--chunk", type=int, default=2048)
    a = p.parse_args()
    dtype = jnp.dtype(a.dtype)
    before, after = measure(True, a.rows, dtype, a.chunk), measure(False, a.rows, dtype, a.chunk)
    print(f"machine: {platform.machine()} {platform.processor() or ''} jax {jax.__version__} "
          f"({jax.default_backend()})")
    print(f"rows {a.rows}, {a.dtype}, chunk {a.chunk}: teacher-to-loss peak (temp + output) "
          f"before {before / 2**30:.2f} GiB, after {after / 2**30:.2f} GiB, "
          f"before/after {before / after:.2f}x")


if __name__ == "__main__":
    main()
