"""``python -m ctopd_jax.demo``: the main job. Cross-tokenizer on-policy distillation on a CPU.

    python -m ctopd_jax.demo [--config configs/tiny_cpu.yaml] [--out runs/demo] [--set a.b=c]

1. Loads the committed tiny teacher (Qwen2 architecture, byte-level BPE ``tiny_bpe``) and
   student (Llama architecture, Unigram ``tiny_unigram``) named by the config
   (``demo:teacher`` / ``demo:student``; rebuilt by ``python -m ctopd_jax.demo.pretrain``).
2. Greedy accuracy of both on the task's held-out split (``ctopd_jax.loop.mean_at_k.evaluate_model``
   with the task grader); every graded sample is written under ``<out>/eval/<who>/``.
3. Runs the real trainer (``ctopd_jax.loop.trainer.Trainer``, what ``python -m ctopd_jax.train``
   runs) with the config: on-policy samples from the student, both-side re-tokenization,
   strict alignment, teacher scoring, strict top-k objective, AdamW, checkpoints, metrics.
4. Re-loads the exported HF student from disk and grades it the same way, then plots the run.
5. Prints accuracies, the share of the teacher-student gap closed, strict coverage and where
   the checkpoints, the exported student and the plots are; writes ``<out>/demo_summary.json``.

Decisions: the demo never overwrites a previous run (``runs/demo``, then ``runs/demo-2``, ...);
accuracy is greedy (temperature 0) mean@1 on all held-out problems; the exit status is 0 when
the run completed, whatever the accuracies (they are reported, not asserted).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import ctopd_jax
from ctopd_jax.algorithms import registry
from ctopd_jax.align import strict_align
from ctopd_jax.common import cli
from ctopd_jax.common.cli import Parser, at_least
from ctopd_jax.common.run_guard import SignalGuard
from ctopd_jax.config import load_config
from ctopd_jax.data.eval_sets import load_dataset
from ctopd_jax.demo import task
from ctopd_jax.demo.compare import algorithm_config, compare, episode_accuracy, gap_closed
from ctopd_jax.loop.mean_at_k import evaluate_model
from ctopd_jax.loop.model_sources import model_dir
from ctopd_jax.loop.trainer import Trainer
from ctopd_jax.models.weights import load_hf_checkpoint
from ctopd_jax.plot import plot_run
from ctopd_jax.preflight import preflight, start_served_teachers
from ctopd_jax.tokenization import retokenize_pair

STRICT_DEMO_OBJECTIVE = "topk_strict"  # the objective of DEFAULT_CONFIG, whose target is 50%
DEFAULT_CONFIG = Path(ctopd_jax.__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"


def fresh_output_dir(base: Path) -> Path:
    """``base`` if it is absent or an empty folder, else the first free ``base-2``, ``base-3``,
    ... (a file or a dangling link in the way is never used)."""
    def taken(path: Path) -> bool:
        if path.is_symlink() and not path.exists():
            return True
        return path.exists() and (not path.is_dir() or any(path.iterdir()))

    candidate, n = base, 1
    while taken(candidate):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def strict_targets_in_shared_vocab(t_tok, s_tok, overlap, problems) -> float:
    """Share of the student tokens at strict pairs of reference solutions that have a column in
    the shared vocabulary V∩. The strict objectives only see V∩ columns, so a token outside it
    cannot be taught even where the alignment is perfect (a pre-flight check of the pair)."""

    t_rt, s_rt = retokenize_pair(t_tok, s_tok, [t_tok.render_prompt(p.prompt) for p in problems],
                                 [s_tok.render_prompt(p.prompt) for p in problems],
                                 [p.solution for p in problems])
    rows = strict_align(t_rt, s_rt).student_rows
    targets = s_rt.labels.reshape(-1)[rows]
    return float(np.isin(targets, overlap.s_ids).mean()) if len(rows) else 0.0


PROG = "python -m ctopd_jax.demo"


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML run config")
    p.add_argument("--out", type=lambda s: Path(s).expanduser(), default=Path("runs/demo"),
                   help="run directory (a new sibling is used if it is not empty)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                   help="override one config value (repeatable)")
    p.add_argument("--algorithm", default=None, metavar="NAME",
                   help="run the demo with this registered objective (same-tokenizer ones on the "
                        "character pair, configs/tiny_cpu_same.yaml; see ctopd_jax.demo.compare)")
    p.add_argument("--compare", action="store_true",
                   help="train every registered objective for --steps steps; write compare.md/.png/.json")
    p.add_argument("--steps", type=at_least(1), default=None, help="training steps (with --algorithm / --compare)")
    p.add_argument("--problems", type=at_least(0), default=0,
                   help="--compare: held-out problems graded (0 = all)")
    p.add_argument("--seeds", type=at_least(1), default=3,
                   help="--compare: seeds per objective (mean ± std over them)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="--compare: these objectives only (the reference rows are added)")
    return p


def _parse(argv) -> argparse.Namespace:
    """The arguments, with --algorithm / --only names checked against the registered
    objectives (a usage error, one line, before anything is written)."""
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, names in (("--algorithm", [args.algorithm] if args.algorithm else []),
                        ("--only", args.only or [])):
        unknown = [name for name in names if name not in registry()]
        if unknown:
            parser.error(f"argument {flag}: {unknown[0]!r} is not a registered objective; "
                         f"choose from {', '.join(sorted(registry()))}")
    return args


def _config(args, out: Path):
    """The run's config. With --algorithm, that objective's pair, config and demo recipe
    (ctopd_jax/demo/compare.py), written to a temporary folder that is gone once it is read
    (the run folder gets the trainer's config.json)."""

    overrides = [*args.overrides, *([f"steps={args.steps}"] if args.steps else []),
                 f"output_dir={out}", "evaluation.dataset=''"]
    if not args.algorithm:
        return load_config(args.config, overrides)
    with tempfile.TemporaryDirectory(prefix="ctopd_demo_") as folder:
        path, recipe = algorithm_config(args.algorithm, Path(folder),
                                        None if args.config == DEFAULT_CONFIG else args.config)
        return load_config(path, [*recipe, *overrides])   # --set still wins over the recipe


def run(argv=None) -> dict:
    args = _parse(argv)
    started = time.perf_counter()
    if args.compare:   # every objective, one table (ctopd_jax/demo/compare.py)
        out = fresh_output_dir(args.out if args.out != Path("runs/demo") else Path("runs/compare"))
        return {"rows": compare(out, args.steps or 20, names=args.only, problems=args.problems,
                                overrides=tuple(args.overrides), seeds=tuple(range(args.seeds)))}
    if not args.config.is_file():
        raise FileNotFoundError(f"--config {args.config}: not found; run from the repository "
                                "root or pass --config configs/tiny_cpu.yaml")
    out = fresh_output_dir(args.out)
    config = _config(args, out)

    max_new = config.rollout.generate_max_len
    dataset = load_dataset("demo")

    def accuracy(model, side, who, engine=None) -> float:
        if config.rollout.environment:   # a tool task: the reward of greedy episodes
            value = episode_accuracy(model, side, config, engine=engine)
            print(f"[demo] {who:15s} held-out accuracy {value:.3f} (greedy {config.rollout.environment} "
                  "episodes)", flush=True)
            return value
        report = evaluate_model(model, side, dataset, engine=engine, greedy=True,
                                max_new_tokens=max_new, out_dir=out / "eval" / who)
        print(f"[demo] {who:15s} held-out accuracy {report.mean_at_k:.3f} "
              f"({len(dataset)} problems, greedy)", flush=True)
        return report.mean_at_k

    print(f"[demo] run directory {out}", flush=True)
    # the checks of `python -m ctopd_jax.train` first; `with`: a teacher server the config
    # starts itself (teacher.launch) stops when training ends, also on an error or Ctrl-C
    with preflight(config, device_count=jax.device_count()) as pre:
        start_served_teachers(pre)
        trainer = Trainer(config, preflight=pre)
        teacher_parts = trainer.default_parts   # the demo's one teacher
        in_shared = strict_targets_in_shared_vocab(teacher_parts.tokenizer, trainer.s_tok, teacher_parts.overlap,
                                                   task.split("held_out")[:64])
        print(f"[demo] |V∩| = {teacher_parts.overlap.shared}; {100 * in_shared:.1f}% of the strictly "
              "aligned tokens of reference solutions have a shared-vocabulary column", flush=True)
        if in_shared < 0.95:
            print("[demo] WARNING: the strict objectives cannot supervise aligned tokens outside "
                  "V∩; expect little or no improvement (see tokenization.overlap_map)", flush=True)
        teacher = teacher_parts.model
        if teacher is None:   # served (teacher.engine): the demo grades the same checkpoint here
            teacher, _ = load_hf_checkpoint(model_dir(config.model.teacher), dtype=config.model.dtype)
        teacher_acc = accuracy(teacher, teacher_parts.tokenizer, "teacher")
        before = accuracy(trainer.student, trainer.s_tok, "student_before", engine=trainer.engine)
        train_started = time.perf_counter()
        with SignalGuard() as stop:   # a signal: the step finishes, is checkpointed, one line
            result = trainer.train(stop=stop)
        train_s = time.perf_counter() - train_started
    if result.hf_dir is not None:   # what a user takes away, read back from disk
        after = accuracy(load_hf_checkpoint(result.hf_dir)[0], trainer.s_tok, "student_after")
    else:   # checkpoint.export_hf=false: nothing exported, the trained student in memory
        after = accuracy(trainer.student, trainer.s_tok, "student_after", engine=trainer.engine)
    plots = plot_run(result.run_dir)

    last = result.last_metrics
    summary = {
        "teacher_accuracy": teacher_acc, "student_accuracy_before": before,
        "student_accuracy_after": after, "gap_closed": gap_closed(before, after, teacher_acc),
        "coverage_student": last.get("coverage_student_cum"),
        "coverage_teacher": last.get("coverage_teacher_cum"),
        "shared_vocab": teacher_parts.overlap.shared, "aligned_targets_in_shared_vocab": in_shared,
        "steps": config.steps, "train_seconds": round(train_s, 1), "algorithm": config.algorithm.name,
        "model_teacher": config.model.teacher, "model_student": config.model.student,
        "teacher_engine": config.teacher.engine,
        "total_seconds": round(time.perf_counter() - started, 1),
        "run_dir": str(result.run_dir), "checkpoints": str(result.checkpoint_dir),
        "hf_student": str(result.hf_dir) if result.hf_dir else None, "plots": [str(p) for p in plots],
        "eval_dirs": {w: str(out / "eval" / w) for w in ("teacher", "student_before",
                                                         "student_after")},
    }
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)
    return summary


def print_summary(s: dict) -> None:
    # the 50% target is the strict demo's (configs/tiny_cpu.yaml, topk_strict): other
    # objectives have no stated target, so none is printed beside them
    target = " (target >= 50%)" if s.get("algorithm", STRICT_DEMO_OBJECTIVE) == \
        STRICT_DEMO_OBJECTIVE else ""
    closed = "n/a (the student did not start behind)" if s["gap_closed"] is None \
        else f"{100 * s['gap_closed']:.0f}% of the gap closed{target}"
    cov = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"
    print("\n".join([
        "",
        f"=== ctopd_jax demo: {s.get('model_teacher', 'demo:teacher')} -> {s.get('model_student', 'demo:student')}, "
        f"objective {s.get('algorithm', 'topk_strict')} ===",
        f"teacher accuracy          {s['teacher_accuracy']:.3f}",
        f"student accuracy before   {s['student_accuracy_before']:.3f}",
        f"student accuracy after    {s['student_accuracy_after']:.3f}   ({closed})",
        f"strict coverage           student tokens {cov(s['coverage_student'])}, "
        f"teacher tokens {cov(s['coverage_teacher'])} (cumulative)",
        f"time                      {s['train_seconds']:.0f} s training, "
        f"{s['total_seconds']:.0f} s in all ({s['steps']} steps)",
        f"checkpoints               {s['checkpoints']}",
        f"exported student (HF)     {s['hf_student']}",
        f"plots                     {Path(s['plots'][0]).parent if s['plots'] else 'none'}",
        f"graded samples            {Path(next(iter(s['eval_dirs'].values()))).parent}/*/samples.jsonl",
        f"summary                   {Path(s['run_dir']) / 'demo_summary.json'}",
    ]), flush=True)


def main(argv=None) -> int:
    """Bad input: one line and exit status 2 (`ctopd_jax.common.cli`; --debug for the traceback)."""
    return cli.run(lambda a: (run(a), 0)[1], argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
