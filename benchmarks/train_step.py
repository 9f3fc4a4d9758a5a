"""Time breakdown of one training iteration on the tiny config, tokens/s, and the share of the
iteration spent in host-side alignment (decode + both-side re-tokenization + strict alignment).

    python benchmarks/train_step.py [--config configs/tiny_cpu.yaml] [--steps 7] [--set a.b=c ...]
    python benchmarks/train_step.py --baseline REV [--rounds 2]   # after/before ratio

The first iteration (compilation) and the last (which saves the checkpoint) are reported
separately; the steady-state numbers are means over the iterations in between, and every share is a ratio of phases measured in
that same run.

`--baseline REV` checks REV out into a temporary git worktree and runs this same measurement
there and here, alternating (`--rounds` times each, best steady state kept), and prints the
per-iteration ratio after/before (this tree / REV) of the whole iteration and of its device
part (teacher + student).
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

PHASES = ("rollout", "align", "prepare", "teacher", "student", "sync", "other")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--baseline", default="", help="git revision to compare against (after/before)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if args.baseline:
        return compare(args)

    import jax
    import numpy as np

    from ctopd_jax.config import load_config
    from ctopd_jax.common.metrics import read_metrics
    from ctopd_jax.loop.trainer import Trainer

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
    print(f"first iteration (includes compilation): {first.get('time_wall', first['time_total']):.2f} s; "
          f"final checkpoint save: {last.get('time_checkpoint', 0.0):.2f} s")
    # time_wall: the iteration's wall time, which the phases and time_other partition
    total = np.mean([x.get("time_wall", x["time_total"]) for x in rest])
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


def _steady(tree: Path, args) -> tuple[float, float]:
    """(s/iteration, device s/iteration) of one run of the script in `tree` (its own code)."""
    cmd = [sys.executable, str(tree / "benchmarks" / "train_step.py"), "--config", args.config,
           "--steps", str(args.steps)] + [f"--set={o}" for o in args.overrides]
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    total = float(re.search(r"steady state over \d+ iterations: ([0-9.]+) s/iteration", out).group(1))
    device = sum(float(re.search(rf"  {phase} +([0-9.]+) s", out).group(1)) for phase in ("teacher", "student"))
    return total, device


def compare(args) -> None:
    here = Path(__file__).resolve().parents[1]
    base = Path(tempfile.mkdtemp(prefix="train_step_baseline_")) / "tree"
    subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(base), args.baseline],
                   check=True, capture_output=True)
    try:
        before, after = [], []
        for _ in range(args.rounds):  # alternate so machine load affects both alike
            before.append(_steady(base, args))
            after.append(_steady(here, args))
    finally:
        subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(base)], check=False)
    b, a = min(before), min(after)
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus; config {args.config}; "
          f"best of {args.rounds} alternating runs each, {args.steps} steps")
    print(f"before ({args.baseline}): {b[0]:.3f} s/iteration (device {b[1]:.3f} s)")
    print(f"after  (this tree):  {a[0]:.3f} s/iteration (device {a[1]:.3f} s)")
    print(f"after/before: iteration {a[0] / b[0]:.3f}, device part {a[1] / b[1]:.3f}")


if __name__ == "__main__":
    main()
