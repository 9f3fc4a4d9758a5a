"""The objectives on a real pair: by default Qwen2.5-Coder-0.5B-Instruct teaches
SmolLM2-135M-Instruct across tokenizers the real demo's task (`python -m ctopd_jax.demo.real`),
one objective at a time, each from the same untrained student, with the demo's config and recipe
otherwise.

    python benchmarks/real_objectives.py [--objectives strict topk_strict span simct mp_opd]
                                         [--seeds 0] [--steps 15] [--out runs/real_objectives]
                                         [--set A.B=C ...] [--teacher NAME [--teacher NAME]]
                                         [--student NAME] [--task one-digit]

The same-tokenizer family on the packaged same-tokenizer pair (1.5B teaches 0.5B):

    python benchmarks/real_objectives.py --teacher qwen2.5-coder-1.5b --student qwen2.5-coder-0.5b \
        --objectives gkd opd opd_full vopd opd2 --steps 8

opd2 needs a base model for its teacher; none is packaged, so it gets the starting student (the
demo recipe's choice, configs/demo_recipes.yaml) unless `--set model.teacher_base=...` names one.

Each (objective, seed) is one `demo.real` process (`--set algorithm.name=... seed=... steps=...`);
its demo_summary.json and metrics.jsonl give the row: held-out greedy accuracy of the teacher and
of the student before and after, the gap closed, the mean iteration time of the iterations that
compiled nothing and its phases (rollout, teacher, student), and the process's wall time.
Printed as a markdown table, with mean ± std over the seeds where there are several.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.models.packaged import model_dir

PHASES = ("rollout", "teacher", "student")


def one_run(name: str, seed: int, steps: int, out: Path, overrides=(), pair=()) -> dict:
    """`pair`: demo.real's --teacher / --student arguments."""
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "ctopd_jax.demo.real", "--out", str(out), *pair, "--set",
           f"algorithm.name={name}", "--set", f"seed={seed}", "--set", f"steps={steps}",
           *[a for o in overrides for a in ("--set", o)]]
    with open(out.parent / f"{out.name}.log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        return {"objective": name, "seed": seed, "failed": f"exit {code}, see {out}.log"}
    summary = json.loads((out / "demo_summary.json").read_text())
    rows = read_metrics(out)
    quiet = [r for r in rows[1:] if r.get("time_compile", 0) == 0] or rows[1:] or rows
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in quiet)   # noqa: E731
    return {"objective": name, "seed": seed, "teacher": summary["teacher_accuracy"],
            "before": summary["student_accuracy_before"],
            "after": summary["student_accuracy_after"], "gap_closed": summary["gap_closed"],
            "step_s": mean("time_wall"), **{f"{p}_s": mean(f"time_{p}") for p in PHASES},
            "wall_s": time.perf_counter() - started}


def spread(values: list[float], digits: int) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(results: list[dict]) -> str:
    lines = ["| objective | seeds | teacher | student before | student after | gap closed | "
             "iteration (s) | rollout / teacher / student (s) | wall (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["objective"] for r in results):
        runs = [r for r in results if r["objective"] == name and "failed" not in r]
        failed = [r for r in results if r["objective"] == name and "failed" in r]
        if not runs:
            lines.append(f"| {name} | - | failed: {failed[0]['failed']} |||||||")
            continue
        col = lambda key, d=3: spread([r[key] for r in runs], d)   # noqa: E731
        phases = " / ".join(col(f"{p}_s", 1) for p in PHASES)
        lines.append(f"| {name} | {len(runs)} | {col('teacher')} | {col('before')} | "
                     f"{col('after')} | {col('gap_closed', 2)} | {col('step_s', 1)} | {phases} | "
                     f"{col('wall_s', 0)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objectives", nargs="+",
                   default=["strict", "topk_strict", "span", "simct", "mp_opd"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--out", type=Path, default=Path("runs/real_objectives"))
    p.add_argument("--set", action="append", default=[], metavar="A.B=C",
                   help="another config override for every run (a recipe: optimizer.lr=...)")
    p.add_argument("--teacher", action="append", help="a packaged model (default "
                   "qwen2.5-coder-0.5b); twice: two teachers at once")
    p.add_argument("--student", default="smollm2-135m", help="a packaged model")
    p.add_argument("--task", default="one-digit", help="demo.real's --task")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    teachers = args.teacher or ["qwen2.5-coder-0.5b"]
    pair = (*[a for t in teachers for a in ("--teacher", t)], "--student", args.student,
            "--task", args.task)
    taken = [str(args.out / f"{n}-seed{s}") for n in args.objectives for s in args.seeds
             if (args.out / f"{n}-seed{s}").exists()]
    if taken:   # demo.real would pick a sibling folder, and its summary would not be found
        p.error(f"--out {args.out}: already holds {', '.join(taken)}; pass a new --out")
    results = []
    for name in args.objectives:
        sets = list(args.set)
        if name == "opd2" and not any(s.startswith("model.teacher_base=") for s in sets):
            sets.append(f"model.teacher_base={model_dir(args.student)}")
        for seed in args.seeds:
            results.append(one_run(name, seed, args.steps, args.out / f"{name}-seed{seed}", sets,
                                   pair))
            print(json.dumps(results[-1]), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
