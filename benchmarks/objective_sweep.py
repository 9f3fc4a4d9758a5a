"""Objective sweep on the CPU demo: strict, SimCT (both span-score modes) and every MP-OPD mode.

    python benchmarks/objective_sweep.py [--only strict simct_raw_logit ...] [--steps 100]
        [--out runs/objective_sweep] [--no-append]

Per objective: `python -m ctopd_jax.train --config configs/tiny_cpu.yaml --set algorithm.name=...`
into <out>/<name> (every other setting is tiny_cpu's), then `python -m ctopd_jax.evaluate`
grades the exported student greedily on the demo's held-out split. Per-iteration time is the
median over logged steps after the first (compilation) of the step's wall time, reported as a
ratio to strict's median measured in the same sweep. Prints the table and appends it to
benchmarks/RESULTS.md. A run directory that already holds a finished run and an evaluation
summary is not re-run (delete it to redo); runs that did not finish are listed as missing.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from demo_runs import ROOT, train_then_evaluate

OBJECTIVES = {
    "strict": ["algorithm.name=strict"],
    "simct_raw_logit": ["algorithm.name=simct", "algorithm.span_score_mode=raw_logit"],
    "simct_mean_logprob": ["algorithm.name=simct", "algorithm.span_score_mode=mean_logprob"],
    **{f"mp_opd_{m}": ["algorithm.name=mp_opd", f"algorithm.mp_opd_mode={m}"]
       for m in ("atomic", "fixed1", "fixed2", "fixed3", "fixed4", "fixed5", "random1-2", "random2-5",
                 "grass_chunk", "align")},
}


def step_seconds(rows: list[dict]) -> float | None:
    """Median per-iteration seconds after the first logged step (which compiles)."""
    times = []
    for r in rows[1:]:
        parts = [v for k, v in r.items() if k.startswith("time_") and isinstance(v, (int, float))]
        if r.get("tokens_per_s") and r.get("student_response_tokens"):
            times.append(r["student_response_tokens"] / r["tokens_per_s"])
        elif parts:
            times.append(sum(parts))
    return statistics.median(times) if times else None


def run_one(name: str, steps: int, out: Path) -> dict:
    run_dir = out / name
    # tiny_cpu.yaml sets algorithm.ctkd_topk (a strict top-k field); the other objectives'
    # config sections reject it, so each run gets a copy of the config without it
    import yaml
    tree = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    tree["algorithm"].pop("ctkd_topk", None)
    config = out / f"{name}.yaml"
    out.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(tree))
    run = train_then_evaluate(run_dir, config, [f"run_name=sweep_{name}", "evaluation.dataset=",
                                                "logging.progress=false", *OBJECTIVES[name]],
                              steps, "objective_sweep")
    return {"name": name, "rows": run["rows"], "accuracy": run["accuracy"],
            "step_s": step_seconds(run["rows"])}


def last(rows, key):
    for r in reversed(rows):
        if r.get(key) is not None:
            return r[key]
    return None


def table(results: list[dict], missing: list[str]) -> str:
    base = next((r["step_s"] for r in results if r["name"] == "strict"), None)
    lines = ["| objective | held-out acc (greedy) | s/iteration | time ÷ strict | final loss | notes |",
             "|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['step_s'] / base:.2f}" if base and r["step_s"] else "n/a"
        notes = []
        for key, label in (("align_ratio", "align_ratio"), ("simct_span_row_fraction", "span rows"),
                           ("mp_opd_atoms_per_sample", "atoms/sample"), ("mp_opd_grass_alpha", "α"),
                           ("mp_opd_fallback_fraction", "fallbacks")):
            v = last(r["rows"], key)
            if v is not None:
                notes.append(f"{label} {v:.3g}")
        fails = sum(last(r["rows"], k) or 0 for k in {k for row in r["rows"] for k in row
                                                       if k.startswith("mp_opd_fail_")})
        if any(k.startswith("mp_opd_fail_") for row in r["rows"] for k in row):
            notes.append(f"failed-closed fraction (last step) {fails:.3g}")
        lines.append(f"| {r['name']} | {r['accuracy']:.3f} | {r['step_s']:.2f} | {ratio} | "
                     f"{last(r['rows'], 'loss'):.4f} | {', '.join(notes)} |")
    for name in missing:
        lines.append(f"| {name} | not run | | | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=list(OBJECTIVES))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "objective_sweep")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    unknown = [n for n in args.only if n not in OBJECTIVES]
    if unknown:
        print(f"--only: unknown {unknown}; choose from {list(OBJECTIVES)}", file=sys.stderr)
        return 2
    results = []
    missing = [n for n in OBJECTIVES if n not in args.only]
    for name in args.only:
        t0 = time.perf_counter()
        try:
            results.append(run_one(name, args.steps, args.out))
        except subprocess.CalledProcessError as err:
            print(f"[objective_sweep] {name} failed: {err}", flush=True)
            missing.append(name)
        print(f"[objective_sweep] {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    text = table(results, missing)
    print(text)
    if not args.no_append:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write(f"\n### Objective sweep on the CPU demo ({args.steps} steps, `benchmarks/objective_sweep.py`, "
                    f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor() or ''} CPU, "
                    "2 shared cores)\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
