"""`python -m ctopd_jax.demo --algorithm NAME` and `--compare`: every registered objective on
the demo task.

- Cross-tokenizer objectives (strict, topk_strict, span, simct, mp_opd, ...) run on the demo's
  cross pair (configs/tiny_cpu.yaml: Qwen2/tiny_bpe teacher → Llama/tiny_unigram student).
- Same-tokenizer objectives (the OPD family of SPEC §9: gkd, opd, opd_full, vopd, opd2; every
  objective whose `needs.reuse_sampled_ids`) run on the character pair
  (configs/tiny_cpu_same.yaml, ctopd_jax/assets/demo_char/). opd2 samples at
  rollout.temperature 0.7 (the paper's recipe; SPEC §9).
- LoRA row: whenever `opd` runs on the character pair it runs there a second time with a LoRA
  student (pair `char_lora`, configs/tiny_cpu_same_lora.yaml: rank-8 adapters on every
  projection, base weights frozen; the seed runner's recipe). Its accuracy is measured like the
  char pair's (the same teacher and starting student: a fresh adapter leaves the model
  unchanged, so it shares the char pair's teacher / before figures), and its "× opd" is the
  ratio to full fine-tuning `opd` on the char pair.
- Turn-structured objectives (tcod, sod, sage_opd: `needs.turns`) run on the tool-use task
  (configs/tiny_cpu_tools.yaml, ctopd_jax/assets/demo_char_tools/) with the calculator
  environment, and so does a reference `opd` row for their time ratio; their accuracy is the
  mean reward of greedy episodes on the task's held-out prompts. sage_opd judges with the
  labelled proxy (the tiny teacher cannot read a judge prompt).

Recipes: each objective runs in its demo recipe, configs/demo_recipes.yaml (`--set` overrides
chosen by benchmarks/recipe_sweep.py, applied on its own pair only; `python -m ctopd_jax.demo
--algorithm NAME` applies them too). The strict recipe is the pair's config with tiny_cpu.yaml's
learning rate (the strict family's recipe).

`--compare` trains every registered objective for the same number of steps (`--steps`, from the
same starting student of its pair, same prompts per seed) in its demo recipe once per seed
(`--seeds`, default 3: `seed` and `data.seed` set to 0, 1, 2), and once more (seed 0) in the
strict recipe where that gives a different config, and writes `<out>/compare.md` (a Markdown
table), `<out>/compare.png` and `<out>/compare.json`: greedy held-out accuracy of the teacher and
of the student before and after (mean ± std over seeds), the share of the teacher-student gap
closed (mean ± std), the strict recipe's after / gap closed, and seconds per iteration as a
ratio to `strict` and to `opd` on the same pair, measured in the same run; the PNG has the
accuracies, the time ratios and each row's loss curve (mean over seeds, ± std). Every run goes
through `train_and_grade`, which benchmarks/recipe_sweep.py calls too.

Decisions: seconds per iteration is the median over seeds of the median per-step wall time (differences of the
cumulative `elapsed_s` of metrics.jsonl: rollout, alignment, teacher, student step, sync,
logging) over steps 2.. (step 1 carries the compilation); accuracy is greedy mean@1 on the held-out split (all 200 problems unless
`--problems`); an objective that fails is reported in the table with its one-line error, and
the others still run. Algorithm-specific keys of the base config that the chosen objective does
not know (e.g. `ctkd_topk` for opd) are dropped from its algorithm section.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np
import yaml

import ctopd_jax
from ctopd_jax.algorithms import default_objective, objectives_that, registry
from ctopd_jax.config import load_config, load_yaml
from ctopd_jax.data.eval_sets import load_dataset
from ctopd_jax.data.prompts import load_prompts, resolve_named_source
from ctopd_jax.envs import make_environment
from ctopd_jax.loop.mean_at_k import evaluate_model
from ctopd_jax.loop.trainer import Trainer
from ctopd_jax.rollout import make_rollout_engine
from ctopd_jax.rollout.episodes import greedy_reward

CONFIGS = Path(ctopd_jax.__file__).resolve().parent.parent / "configs"
CROSS_CONFIG = CONFIGS / "tiny_cpu.yaml"
SAME_CONFIG = CONFIGS / "tiny_cpu_same.yaml"
TOOLS_CONFIG = CONFIGS / "tiny_cpu_tools.yaml"
LORA_CONFIG = CONFIGS / "tiny_cpu_same_lora.yaml"
RECIPES = CONFIGS / "demo_recipes.yaml"   # each objective's demo recipe (benchmarks/recipe_sweep.py)
PAIRS = {"cross": (CROSS_CONFIG, "cross (tiny_bpe → tiny_unigram)"),
         "char": (SAME_CONFIG, "char (same tokenizer)"),
         "char_lora": (LORA_CONFIG, "char + LoRA student (rank 8)"),
         "tools": (TOOLS_CONFIG, "char tools (calculator episodes)")}
REFERENCE = "strict"
SAME_REFERENCE = "opd"
# Pairs whose teacher and starting student are another pair's (baselines and the × opd reference
# come from that pair): the LoRA student starts as the char student (B = 0).
BASE_PAIR = {"char_lora": "char"}


def gap_closed(before: float, after: float, teacher: float) -> float | None:
    """Share of the teacher-student gap closed; None when the student did not start behind."""
    gap = teacher - before
    return None if gap <= 0 else (after - before) / gap

def _needs(name: str):
    if name not in registry():
        raise ValueError(f"--algorithm {name!r} is not registered; choose one of {', '.join(sorted(registry()))}")
    return default_objective(name).needs


def is_same_tokenizer(name: str) -> bool:
    return bool(_needs(name).reuse_sampled_ids)


def pair_of(name: str) -> str:
    """The demo pair objective `name` runs on: cross, char or tools."""
    needs = _needs(name)
    return "tools" if needs.turns else ("char" if needs.reuse_sampled_ids else "cross")


def config_tree(name: str, base: Path | None = None, pair: str | None = None) -> dict:
    """The demo config of objective `name` as a tree: its pair's YAML, algorithm.name = name,
    algorithm keys the objective does not know dropped, its `demo_settings` set."""

    pair = pair or pair_of(name)
    path = base or PAIRS[pair][0]
    tree = load_yaml(path.read_text(encoding="utf-8")) or {}
    objective = registry()[name]
    known = {f.name for f in dataclasses.fields(objective.settings_class)}
    algo = {k: v for k, v in (tree.get("algorithm") or {}).items() if k in known}
    algo["name"] = name
    tree["algorithm"] = algo
    for dotted, value in objective.demo_settings.items():   # the objective's own demo settings
        *head, key = dotted.split(".")
        node = tree
        for part in head:
            node = node.setdefault(part, {})
        node[key] = value
    return tree


def write_config(name: str, out_dir: Path, base: Path | None = None, pair: str | None = None) -> Path:
    """`config_tree(name)` written as YAML under out_dir (what --algorithm runs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"config_{name}{'_' + pair if pair else ''}.yaml"
    path.write_text(yaml.safe_dump(config_tree(name, base, pair), sort_keys=False))
    return path


def iteration_seconds(run_dir: Path) -> float | None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    clock = {r["step"]: r["elapsed_s"] for r in rows if "elapsed_s" in r and "step" in r}  # cumulative
    times = [clock[s] - clock[s - 1] for s in sorted(clock) if s >= 2 and s - 1 in clock]
    return statistics.median(times) if times else None


def _accuracy(model, side, problems, max_new, out_dir, engine=None) -> float:
    return evaluate_model(model, side, problems, engine=engine, greedy=True, max_new_tokens=max_new,
                          out_dir=out_dir).mean_at_k


def episode_accuracy(model, side, config, limit: int = 0, engine=None) -> float:
    """Mean reward of greedy episodes with the config's environment on the tool task's
    held-out prompts (the first `limit` of them when set)."""
    r = config.rollout
    prompts = load_prompts(resolve_named_source("demo:tools_held_out"))
    prompts = prompts[:limit] if limit else prompts
    engine = engine or make_rollout_engine("jax", model, eos_ids=[side.eos_id], pad_id=side.pad_id,
                                           max_prompt_len=r.max_prompt_len + r.generate_max_len)
    return greedy_reward(engine, side, prompts, lambda: make_environment(r.environment),
                         max_new_tokens=r.generate_max_len, max_turns=r.max_turns,
                         step_timeout_s=r.step_timeout_s)[0]


def jobs(names: list[str]) -> list[tuple[str, str]]:
    """(objective, pair) runs: each objective on its pair; `strict` first as the reference, and
    `opd` on the tool task too when a turn objective runs (their time reference), and `opd`
    with a LoRA student (`char_lora`) right after `opd` on the char pair."""
    runs = [(n, pair_of(n)) for n in names]
    if REFERENCE in registry() and (REFERENCE, "cross") not in runs:
        runs.insert(0, (REFERENCE, "cross"))
    if any(p == "tools" for _, p in runs) and (SAME_REFERENCE, "tools") not in runs:
        first = next(i for i, (_, p) in enumerate(runs) if p == "tools")
        runs.insert(first, (SAME_REFERENCE, "tools"))
    if (SAME_REFERENCE, "char") in runs and (SAME_REFERENCE, "char_lora") not in runs:
        runs.insert(runs.index((SAME_REFERENCE, "char")) + 1, (SAME_REFERENCE, "char_lora"))
    return runs


def recipe_overrides(name: str, pair: str, recipe: str = "demo") -> list[str]:
    """`--set` overrides of objective `name` on `pair`: `recipe="demo"` its demo recipe
    (configs/demo_recipes.yaml, on its own pair only: the LoRA and time-reference rows keep
    their pair's config), `"strict"` the strict family's recipe (tiny_cpu.yaml's optimizer lr)."""
    if recipe == "strict":
        lr = (load_yaml(CROSS_CONFIG.read_text(encoding="utf-8")) or {})["optimizer"]["lr"]
        return [f"optimizer.lr={lr}"]
    if recipe != "demo":
        raise ValueError(f"recipe must be 'demo' or 'strict', got {recipe!r}")
    if pair != pair_of(name):
        return []
    recipes = load_yaml(RECIPES.read_text(encoding="utf-8")) or {}
    return [f"{k}={v}" for k, v in (recipes.get(name) or {}).items()]


def algorithm_config(name: str, out_dir: Path, base: Path | None = None) -> tuple[Path, list[str]]:
    """What `demo --algorithm NAME` runs: its config written under out_dir, and its demo recipe
    as overrides (none with a user's `--config`: the recipe belongs to the pair's config)."""
    path = write_config(name, out_dir, base)
    return path, ([] if base is not None else recipe_overrides(name, pair_of(name)))


def recipes_differ(name: str, pair: str, config_dir: Path) -> bool:
    """Whether the demo recipe and the strict recipe give different configs (else one run)."""
    path = write_config(name, config_dir, pair=pair)
    return (load_config(path, recipe_overrides(name, pair, "demo")).to_dict()
            != load_config(path, recipe_overrides(name, pair, "strict")).to_dict())


def curves(run_dir: Path, samples_per_step: int) -> dict:
    """Per-step loss, mean sampled response length and EOS rate (share of the step's samples that
    ended with the EOS rather than at the length limit) from the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = list({r["step"]: r for r in rows if "loss" in r}.values())   # one row per step (the last)
    return {"loss": [r["loss"] for r in rows],
            "response_length": [r["response_length"] for r in rows],
            "eos_rate": [1.0 - r["truncated_samples"] / samples_per_step for r in rows]}


def train_and_grade(name: str, pair: str, run_dir: Path, steps: int, seed: int = 0,
                    recipe: str = "demo", overrides: tuple[str, ...] = (), problems: int = 0,
                    baselines: dict | None = None) -> dict:
    """One demo run: objective `name` on `pair` in `recipe` (recipe_overrides) with `overrides`
    on top, `seed` for the run and its prompt order, `steps` iterations from the pair's starting
    student; then greedy held-out accuracy (the first `problems`, 0 = all). `baselines` caches
    (teacher, before) accuracies per base pair across calls. The row: accuracies, gap closed,
    seconds per iteration, final loss and the curves."""
    baselines = {} if baselines is None else baselines
    cfg_path = write_config(name, run_dir.parent / "configs", pair=pair)
    applied = [*recipe_overrides(name, pair, recipe), *overrides]
    config = load_config(cfg_path, [*applied, f"steps={steps}", f"seed={seed}", f"data.seed={seed}",
                                    f"output_dir={run_dir}", "evaluation.dataset=''",
                                    "logging.progress=false", "logging.tensorboard=false",
                                    "checkpoint.export_hf=false", "checkpoint.every=0"])
    trainer = Trainer(config)
    dataset = None if pair == "tools" else load_dataset("demo", limit=problems or None)

    def accuracy(model, side, out_dir=None, engine=None):
        if pair == "tools":
            return episode_accuracy(model, side, config, problems, engine)
        return _accuracy(model, side, dataset, config.rollout.generate_max_len, out_dir, engine=engine)

    base = BASE_PAIR.get(pair, pair)
    if base not in baselines:
        baselines[base] = (accuracy(trainer.default_parts.model, trainer.default_parts.tokenizer),
                           accuracy(trainer.student, trainer.s_tok, engine=trainer.engine))
    teacher_acc, before = baselines[base]
    result = trainer.train()
    after = accuracy(trainer.student, trainer.s_tok, run_dir / "eval_after", engine=trainer.engine)
    r = config.rollout
    return {"algorithm": name, "pair_key": pair, "recipe": recipe, "seed": seed, "steps": steps,
            "lr": config.optimizer.lr, "overrides": applied,
            "teacher": teacher_acc, "before": before, "after": after,
            "gap_closed": gap_closed(before, after, teacher_acc),
            "seconds_per_iteration": iteration_seconds(result.run_dir),
            "final_loss": result.last_metrics.get("loss"),
            "curves": curves(result.run_dir, r.rollout_batch_size * r.n_samples_per_prompt)}


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def compare(out: Path, steps: int, names: list[str] | None = None, problems: int = 0,
            overrides: tuple[str, ...] = (), seeds: tuple[int, ...] = (0, 1, 2),
            strict_recipe: bool = True, log=print) -> list[dict]:
    """Train every objective in `names` (default: all registered that run with the demo's
    local teacher, i.e. not the served teacher's top-k ones) for `steps` steps in its demo
    recipe, once per seed, and (`strict_recipe`) once more, seed 0, in the strict recipe where
    that differs; write the table, plot and json under `out`; return one row per (objective,
    pair) with the mean and standard deviation over seeds."""
    names = names or objectives_that(lambda o: o.needs.teacher_scores != "topk")
    baselines: dict[str, tuple[float, float]] = {}
    rows = []
    for name, pair in jobs(names):
        started = time.perf_counter()
        row = {"algorithm": name, "pair": PAIRS[pair][1], "pair_key": pair,
               "recipe": recipe_overrides(name, pair)}
        stem = name if pair == pair_of(name) else f"{name}_{pair}"
        try:
            runs = [train_and_grade(name, pair, out / f"{stem}_seed{s}", steps, s, "demo", overrides,
                                    problems, baselines) for s in seeds]
            afters = [r["after"] for r in runs]
            row.update(teacher=runs[0]["teacher"], before=runs[0]["before"], seeds=list(seeds),
                       after_seeds=afters, curves=[r["curves"] for r in runs])
            row["after"], row["after_std"] = _mean_std(afters)
            row["gap_closed"], row["gap_closed_std"] = _mean_std([r["gap_closed"] for r in runs])
            row["seconds_per_iteration"] = statistics.median(
                [r["seconds_per_iteration"] for r in runs if r["seconds_per_iteration"]] or [0]) or None
            if strict_recipe and recipes_differ(name, pair, out / "configs"):
                strict = train_and_grade(name, pair, out / f"{stem}_strict_recipe", steps, seeds[0],
                                         "strict", overrides, problems, baselines)
                row.update(strict_recipe_after=strict["after"], strict_recipe_gap_closed=strict["gap_closed"])
        except Exception as err:  # noqa: BLE001  (one objective failing must not hide the others)
            row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        row["wall_seconds"] = round(time.perf_counter() - started, 1)
        log(f"[compare] {json.dumps({k: v for k, v in row.items() if k != 'curves'})}")
        rows.append(row)
    ref = next((r.get("seconds_per_iteration") for r in rows if r["algorithm"] == REFERENCE), None)
    same_ref = {r["pair_key"]: r.get("seconds_per_iteration") for r in rows if r["algorithm"] == SAME_REFERENCE}
    for r in rows:
        t = r.get("seconds_per_iteration")
        t_opd = same_ref.get(BASE_PAIR.get(r["pair_key"], r["pair_key"]))
        r["time_vs_strict"] = (t / ref) if (t and ref) else None
        r["time_vs_opd"] = (t / t_opd) if (t and t_opd) else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "compare.md").write_text(markdown_table(rows, steps))
    plot(rows, out / "compare.png")
    return rows


def markdown_table(rows: list[dict], steps: int) -> str:
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"
    num = lambda v, f="{:.3f}": "n/a" if v is None else f.format(v)
    pm = lambda m, sd, f=num: f(m) if sd is None or m is None else f"{f(m)} ± {f(sd)}"
    lines = [f"| objective | pair | recipe | teacher | before | after ({steps} steps, mean ± std) | "
             "gap closed | strict recipe: after / gap closed | s / iteration | × strict | × opd (same pair) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | {r.get('pair', '')} | | failed: {r['error']} | | | | | | | |")
            continue
        strict = (f"{num(r['strict_recipe_after'])} / {pct(r['strict_recipe_gap_closed'])}"
                  if "strict_recipe_after" in r else "= recipe")
        lines.append(f"| {r['algorithm']} | {r['pair']} | {', '.join(r['recipe']) or 'pair config'} | "
                     f"{num(r['teacher'])} | {num(r['before'])} | {pm(r['after'], r['after_std'])} "
                     f"(n={len(r['seeds'])}) | {pm(r['gap_closed'], r['gap_closed_std'], pct)} | {strict} | "
                     f"{num(r['seconds_per_iteration'], '{:.2f}')} | {num(r['time_vs_strict'], '{:.2f}')} | "
                     f"{num(r.get('time_vs_opd'), '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path | None:
    """Accuracy before / after (mean ± std over seeds, the teacher marked), the time ratio to
    strict, and each row's loss curve (mean over seeds, ± std shaded)."""
    import matplotlib   # heavy: imported only when the comparison is plotted
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # (as above)
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    a, b, c = axes
    x = np.arange(len(ok))
    labels = [r["algorithm"] + ("+LoRA" if r.get("pair_key") == "char_lora" else "")
              + (" (tools)" if r["pair_key"] == "tools" and r["algorithm"] == SAME_REFERENCE else "") for r in ok]
    a.bar(x - 0.2, [r["before"] for r in ok], 0.4, label="before")
    a.bar(x + 0.2, [r["after"] for r in ok], 0.4, yerr=[r["after_std"] or 0 for r in ok], capsize=3,
          label="after (mean ± std over seeds)")
    a.scatter(x, [r["teacher"] for r in ok], color="k", marker="_", s=300, label="teacher", zorder=3)
    a.set_xticks(x, labels, rotation=45, ha="right")
    a.set_ylabel("held-out accuracy (greedy)")
    a.set_title("accuracy before / after, each in its recipe")
    a.legend(fontsize=7)
    b.bar(x, [r["time_vs_strict"] or 0 for r in ok])
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xticks(x, labels, rotation=45, ha="right")
    b.set_ylabel("seconds per iteration / strict")
    b.set_title("time per iteration (ratio to strict)")
    for r, label in zip(ok, labels):
        n = min(len(cv["loss"]) for cv in r["curves"])
        if n == 0:
            continue
        loss = np.array([cv["loss"][:n] for cv in r["curves"]])
        scale = max(abs(loss[:, 0].mean()), 1e-9)   # objectives' losses differ in scale
        mean, std = loss.mean(0) / scale, loss.std(0) / scale
        steps = np.arange(1, n + 1)
        c.plot(steps, mean, label=label)
        c.fill_between(steps, mean - std, mean + std, alpha=0.15)
    c.set_xlabel("iteration")
    c.set_ylabel("loss / its mean first-iteration value")
    c.set_title("training loss (mean over seeds, ± std)")
    c.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
