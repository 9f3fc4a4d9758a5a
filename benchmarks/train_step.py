"""Time breakdown of one training iteration on the tiny config, tokens/s, and the share of the
iteration spent in host-side alignment (decode + both-side re-tokenization + strict alignment).

    python benchmarks/train_step.py [--config configs/tiny_cpu.yaml] [--steps 7] [--set a.b=c ...]

The first iteration (compilation) and the last (which saves the checkpoint) are reported
separately; the steady-state numbers are means over the iterations in between, and every share is a ratio of phases measured in
that same run.
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

PHASES = ("rollout", "align", "teacher", "student", "sync")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from ctopd_jax.config import load_config
    from ctopd_jax.metrics import read_metrics
    from ctopd_jax.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench_train_step_")
    overrides = [f"steps={args.steps}", f"output_dir={out}", "evaluation.dataset=", "checkpoint.every=0",
                 "checkpoint.export_hf=false", "logging.tensorboard=false", "logging.progress=false",
                 *args.overrides]
    config = load_config(args.config, overrides)
    Trainer(config).train()
    records = read_metrics(out)
    # the first iteration compiles; the last one also writes the (only) checkpoint
    first, rest, last = records[0], records[1:-1], records[-1]
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__} "
          f"{jax.default_backend()} x{jax.device_count()}, config {args.config}")
    r = config.rollout
    print(f"iteration: {r.rollout_batch_size * r.n_samples_per_prompt} responses, "
          f"generate_max_len {r.generate_max_len}, algorithm {config.algorithm.name}")
    print(f"first iteration (includes compilation): {first['time_total']:.2f} s; "
          f"final checkpoint save: {last.get('time_checkpoint', 0.0):.2f} s")
    total = np.mean([x["time_total"] for x in rest])
    print(f"steady state over {len(rest)} iterations: {total:.3f} s/iteration")
    for phase in PHASES:
        values = [x.get(f"time_{phase}", 0.0) for x in rest]
        mean = float(np.mean(values))
        print(f"  {phase:10s} {mean:8.4f} s  {100 * mean / total:5.1f} %")
    tokens = np.mean([x["student_response_tokens"] for x in rest])
    print(f"student response tokens/iteration: {tokens:.0f}; "
          f"tokens/s (whole iteration): {np.mean([x['tokens_per_s'] for x in rest]):.1f}")
    align = np.mean([x["time_align"] for x in rest])
    device = np.mean([x["time_teacher"] + x["time_student"] for x in rest])
    print(f"host-side alignment share of the iteration: {100 * align / total:.2f} % "
          f"(align / (teacher + student) = {align / device:.3f})")


if __name__ == "__main__":
    main()
