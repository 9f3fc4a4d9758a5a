"""Recipe sweep: per objective on its demo pair, the learning rate, then the method's own knobs,
then the best recipe over 3 seeds (issue 23).

    python benchmarks/recipe_sweep.py --phase lr    [--objectives opd gkd ...] [--seeds 0]
    python benchmarks/recipe_sweep.py --phase knobs [--objectives ...] [--seeds 0]
    python benchmarks/recipe_sweep.py --phase seeds [--objectives ...] [--seeds 0 1 2]
    python benchmarks/recipe_sweep.py --phase shipped [--objectives ...] [--seeds 0 1 2]
    python benchmarks/recipe_sweep.py --phase report            # best recipe per objective
    python benchmarks/recipe_sweep.py --phase lr --plan         # list the runs, run nothing

Each run is `compare.train_and_grade` (the one code path of `demo --compare`): the objective on
its pair's config (tiny_cpu*.yaml, the demo's fixed settings such as opd2's temperature 0.7),
`--steps` iterations (100) from the pair's starting student, the sweep's overrides on top (not
the shipped demo recipe: `recipe="strict"` puts tiny_cpu's lr first, the grid's lr replaces it),
then greedy held-out accuracy. One JSON per run under `--out` (objective/run-id.json: accuracy,
gap closed, s/iteration, loss / response-length / EOS-rate curves); a run whose JSON exists is
skipped, so the sweep resumes and can run in slices (`--objectives`, `--seeds`) in parallel
processes. Phases:
- `lr`: every lr of LRS[pair] at the objective's default knobs.
- `knobs`: every setting of KNOBS[objective] at the objective's best lr so far (or `--lr`).
- `seeds`: the best recipe so far (lr + knobs, highest mean held-out accuracy over the seeds it
  has; ties: the earlier grid point) over `--seeds`.
- `shipped`: the objective's shipped recipe (configs/demo_recipes.yaml) over `--seeds`, whatever
  the sweep has run so far.
- `report`: prints the table and writes <out>/best_recipes.json and .png (per objective: the
  shipped recipe of configs/demo_recipes.yaml where the sweep ran it, else the best one; the
  seeds it has, mean ± std of accuracy and gap closed), and the YAML lines for those recipes.
Reusing one compiled program across lrs and seeds is not done: each run builds its Trainer (the
trainer compiles per instance; on the CPU pairs that costs ~10-20 s of a 1-6 min run).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OBJECTIVES = ("strict", "topk_strict", "span", "simct", "mp_opd", "gkd", "opd", "opd_full", "vopd",
              "opd2", "tcod", "sod", "sage_opd")
# in the order they run (the likeliest first, so a sweep cut short still has them; runs go
# grid-point-major across the objectives of one invocation)
LRS = {"cross": (1e-3, 3e-4, 2e-3, 3e-3),
       "char": (3e-4, 1e-4, 1e-3, 3e-3),
       "tools": (1e-4, 3e-4, 3e-5, 1e-3)}
LRS_OF = {"mp_opd": (3e-5, 1e-4, 3e-4, 1e-3)}   # a sampled credit: the same-family grid
# the method's own knobs SPEC names (swept at the best lr): algorithm.* overrides, or a dotted
# key as it is. rollout.top_p 0.95 (SPEC §10's example runs): the char teacher is label-smoothed,
# so a student that matches it puts ~2% on random characters; sampling at top_p 1 then draws them
TOP_P = {"rollout.top_p": 0.95}
KNOBS = {
    "gkd": ({"gkd_beta": 1.0}, {"gkd_lambda": 1.0}, {"gkd_beta": 1.0, "gkd_lambda": 1.0}),
    # the clip acts only when an iteration makes more than one update (at its first, θ = θ_old)
    "opd": (TOP_P, {"optimizer.train_batch_size": 32, "optimizer.micro_batch_size": 32, "opd_clip": "ppo"},
            {"optimizer.train_batch_size": 32, "optimizer.micro_batch_size": 32}),
    "opd_full": (TOP_P,),
    # the base: the teacher's 60-step snapshot (no response format yet) or the starting student
    # (the format, not the skill: the paper's instruct base, in the demo's terms); the gate's
    # disagreeing tokens dropped (the paper) or given A^OPD (`opd2_disagree: opd`, ours)
    "opd2": ({"model.teacher_base": "demo:char_student"}, TOP_P,
             {"model.teacher_base": "demo:char_student", "opd2_disagree": "opd"}),
    "vopd": (TOP_P,),
    "mp_opd": ({"mp_opd_eos_atom": True}, {"mp_opd_mode": "grass_chunk", "mp_opd_eos_atom": True},
               {"mp_opd_mode": "fixed2"}, {"mp_opd_mode": "grass_chunk"}, {"mp_opd_mode": "align"}),
    "sage_opd": ({"sage_proxy_skip_above": 1.0}, {"sage_proxy_skip_above": 0.95}),
    "tcod": ({"tcod_period": 2}, {"tcod_period": 10}),
}


def setting_key(knob: str) -> str:
    """The config key of a knob: an algorithm field by its name, any other key dotted."""
    return knob if "." in knob else f"algorithm.{knob}"


def run_id(lr: float, knobs: dict, seed: int) -> str:
    """The run's file name: lr, knobs, seed (a path among the values is written with "_" for "/")."""
    parts = [f"lr{lr:g}"] + [f"{k}-{str(v).replace('/', '_')}" for k, v in sorted(knobs.items())] + [f"s{seed}"]
    return "__".join(parts)


def load_runs(out: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / name).glob("*.json"))]


def grouped(runs: list[dict]) -> dict[tuple, list[dict]]:
    """Runs by recipe (lr, knobs), in the order the recipes were first run."""
    groups: dict[tuple, list[dict]] = {}
    for r in sorted(runs, key=lambda r: r["finished_at"]):
        groups.setdefault((r["lr"], json.dumps(r["knobs"], sort_keys=True)), []).append(r)
    return groups


def best(runs: list[dict], knobs_too: bool = True) -> tuple[float, dict] | None:
    """(lr, knobs) of the highest mean held-out accuracy (ties: the first run)."""
    groups = {k: v for k, v in grouped(runs).items() if knobs_too or k[1] == "{}"}
    if not groups:
        return None
    key = max(groups, key=lambda k: statistics.fmean(r["after"] for r in groups[k]))
    return key[0], json.loads(key[1])


def planned(phase: str, name: str, out: Path, seeds: list[int],
            lr: float | None = None, lrs: list[float] | None = None,
            settings: list[dict] | None = None) -> list[tuple[float, dict, int]]:
    """The runs of `phase` for objective `name`; `lr` replaces the best lr so far (knobs),
    `lrs` the grid (lr), `settings` KNOBS[name] (knobs)."""
    from ctopd_jax.demo.compare import pair_of

    if phase == "shipped":
        lr, knobs = shipped(name)
        return [(lr, knobs, s) for s in seeds]
    runs = load_runs(out, name)
    if phase == "lr":
        return [(x, {}, s) for x in (lrs or LRS_OF.get(name, LRS[pair_of(name)])) for s in seeds]
    chosen = best(runs, knobs_too=phase == "seeds")
    if chosen is None and (phase == "seeds" or lr is None):
        return []
    lr, knobs = (lr or chosen[0]), (chosen[1] if chosen else {})
    if phase == "knobs":
        return [(lr, k, s) for k in (settings or KNOBS.get(name, ())) for s in seeds]
    return [(lr, knobs, s) for s in seeds]


def run(name: str, lr: float, knobs: dict, seed: int, steps: int, out: Path, problems: int,
        baselines: dict) -> dict:
    from ctopd_jax.demo.compare import pair_of, train_and_grade

    path = out / name / f"{run_id(lr, knobs, seed)}.json"
    if path.is_file():
        return json.loads(path.read_text())
    started = time.perf_counter()
    row = train_and_grade(name, pair_of(name), out / "runs" / name / path.stem, steps, seed, "strict",
                          (f"optimizer.lr={lr}", *(f"{setting_key(k)}={v}" for k, v in knobs.items())),
                          problems, baselines)
    row.update(knobs=knobs, lr=lr, wall_seconds=round(time.perf_counter() - started, 1),
               finished_at=time.time())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(row, indent=1) + "\n")
    tmp.replace(path)   # a run is done only once its whole JSON is there
    return row


def shipped(name: str) -> tuple[float, dict]:
    """(lr, knobs) of the objective's entry in configs/demo_recipes.yaml (its pair's lr when the
    entry has none)."""
    from ctopd_jax.config import load_yaml
    from ctopd_jax.demo.compare import RECIPES, config_tree

    entry = dict((load_yaml(RECIPES.read_text()) or {}).get(name) or {})
    lr = entry.pop("optimizer.lr", None) or config_tree(name)["optimizer"]["lr"]
    return float(lr), {k.removeprefix("algorithm."): v for k, v in entry.items()}


def shipped_recipe(name: str, runs: list[dict]) -> tuple[float, dict] | None:
    """The shipped recipe when the sweep ran it."""
    lr, knobs = shipped(name)
    return (lr, knobs) if (lr, json.dumps(knobs, sort_keys=True)) in grouped(runs) else None


def plot_best(out: Path, summary: dict) -> Path | None:
    """<out>/best_recipes.png: compare.plot of each objective's best recipe (its seeds' runs)."""
    from ctopd_jax.demo.compare import plot

    rows = []
    for name, s in summary.items():
        group = grouped(load_runs(out, name))[(s["lr"], json.dumps(s["knobs"], sort_keys=True))]
        strict = next((r["seconds_per_iteration"] for r in load_runs(out, "strict")), None)
        t = statistics.median(r["seconds_per_iteration"] or 0 for r in group)
        rows.append({"algorithm": name, "pair_key": s["pair"], "before": s["before"], "teacher": s["teacher"],
                     "after": s["after_mean"], "after_std": s["after_std"],
                     "time_vs_strict": t / strict if strict and t else None,
                     "curves": [r["curves"] for r in group]})
    return plot(rows, out / "best_recipes.png")


def report(out: Path, names: list[str]) -> str:
    from ctopd_jax.demo.compare import pair_of

    lines = ["| objective | pair | runs | recipe (shipped) | seeds | held-out after (mean ± std) | before → teacher | "
             "gap closed (mean ± std) | every lr at default knobs: mean after |",
             "|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for name in names:
        runs = load_runs(out, name)
        chosen = shipped_recipe(name, runs) or best(runs)
        if chosen is None:
            lines.append(f"| {name} | {pair_of(name)} | 0 | not run | | | | | |")
            continue
        lr, knobs = chosen
        group = grouped(runs)[(lr, json.dumps(knobs, sort_keys=True))]
        after = [r["after"] for r in group]
        gaps = [r["gap_closed"] for r in group if r["gap_closed"] is not None]
        sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
        per_lr = ", ".join(f"{k[0]:g}: {statistics.fmean(r['after'] for r in v):.3f}"
                           for k, v in sorted(grouped(runs).items()) if k[1] == "{}")
        summary[name] = {"pair": pair_of(name), "lr": lr, "knobs": knobs,
                         "seeds": [r["seed"] for r in group], "after": after,
                         "after_mean": statistics.fmean(after), "after_std": sd(after),
                         "gap_closed_mean": statistics.fmean(gaps) if gaps else None,
                         "gap_closed_std": sd(gaps) if gaps else None,
                         "before": group[0]["before"], "teacher": group[0]["teacher"]}
        s = summary[name]
        recipe = ", ".join([f"lr {lr:g}"] + [f"{k} {v}" for k, v in knobs.items()])
        gap = "n/a" if s["gap_closed_mean"] is None else \
            f"{100 * s['gap_closed_mean']:.1f}% ± {100 * s['gap_closed_std']:.1f}%"
        lines.append(f"| {name} | {s['pair']} | {len(runs)} | {recipe} | {len(group)} | "
                     f"{s['after_mean']:.3f} ± {s['after_std']:.3f} | {s['before']:.3f} → {s['teacher']:.3f} | "
                     f"{gap} | {per_lr} |")
    (out / "best_recipes.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_best(out, summary)
    yaml_lines = []
    for name, s in summary.items():
        yaml_lines += [f"{name}:", f"  optimizer.lr: {s['lr']:.1e}"]
        yaml_lines += [f"  {setting_key(k)}: {v}" for k, v in s["knobs"].items()]
    return "\n".join(lines) + "\n\nconfigs/demo_recipes.yaml entries:\n" + "\n".join(yaml_lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("lr", "knobs", "seeds", "shipped", "report"), required=True)
    ap.add_argument("--objectives", nargs="+", default=list(OBJECTIVES))
    ap.add_argument("--seeds", nargs="+", type=int, default=None,
                    help="default: 0 for lr and knobs, 0 1 2 for seeds")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--problems", type=int, default=0, help="held-out problems graded (0 = all 200)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "recipe_sweep")
    ap.add_argument("--plan", action="store_true", help="list the runs this phase would do")
    ap.add_argument("--lr", type=float, default=None,
                    help="knobs: sweep them at this lr instead of the best one so far")
    ap.add_argument("--lrs", type=float, nargs="+", default=None,
                    help="lr: these learning rates instead of the pair's grid (a slice of it)")
    ap.add_argument("--knobs", type=json.loads, nargs="+", default=None,
                    help='knobs: these settings (JSON objects, e.g. \'{"gkd_beta": 1.0}\') instead of KNOBS')
    args = ap.parse_args(argv)
    unknown = [n for n in args.objectives if n not in OBJECTIVES]
    if unknown:
        print(f"--objectives: unknown {unknown}; choose from {list(OBJECTIVES)}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.problems < 0:
        print("--steps must be >= 1 and --problems >= 0", file=sys.stderr)
        return 2
    if args.phase == "report":
        print(report(args.out, args.objectives))
        return 0
    seeds = args.seeds or ([0, 1, 2] if args.phase in ("seeds", "shipped") else [0])
    baselines: dict = {}
    per_objective = [[(name, *p) for p in planned(args.phase, name, args.out, seeds, args.lr, args.lrs, args.knobs)]
                     for name in args.objectives]
    queue = [r for grid_point in itertools.zip_longest(*per_objective) for r in grid_point if r]
    for name, lr, knobs, seed in queue:
        done = (args.out / name / f"{run_id(lr, knobs, seed)}.json").is_file()
        print(f"[recipe_sweep] {name} {run_id(lr, knobs, seed)}{' (done)' if done else ''}", flush=True)
        if args.plan or done:
            continue
        row = run(name, lr, knobs, seed, args.steps, args.out, args.problems, baselines)
        print(f"[recipe_sweep] {name} lr {lr:g} {knobs} seed {seed}: {row['before']:.3f} -> "
              f"{row['after']:.3f} (teacher {row['teacher']:.3f}) in {row['wall_seconds']:.0f} s, "
              f"{row['seconds_per_iteration'] or 0:.2f} s/iteration", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
