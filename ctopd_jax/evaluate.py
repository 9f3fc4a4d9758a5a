"""``python -m ctopd_jax.evaluate``: sample K responses per problem, grade them, report mean@K.

    python -m ctopd_jax.evaluate --checkpoint DIR --dataset NAME_OR_FILE --samples K \\
        [--config configs/X.yaml] [--greedy] [--out DIR] [--tokenizer NAME_OR_DIR]
    python -m ctopd_jax.evaluate --grade-only samples.jsonl [--answer-fallbacks] [--out DIR]

`--out` is held by one evaluation at a time (`<out>/.run.lock`, as a run's output_dir): a
second one into the same folder is refused in one line before any work.

The definitions (mean@K, pass@K, prompts, engine, sampling) are ctopd_jax.loop.mean_at_k's.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import jax

from ctopd_jax.common.cli import Parser, UserError, at_least, positive, run, seed
from ctopd_jax.common.run_dir import RunDirError, RunLock, check_writable
from ctopd_jax.config import load_config, validate
from ctopd_jax.data.eval_sets import build_prompt, load_dataset
from ctopd_jax.grading import MathGrader
from ctopd_jax.loop.mean_at_k import (REPORT_FILES, REPORT_INCOMPLETE, EvalReport, evaluate_model,
                                      grade_file, write_report)
from ctopd_jax.mesh.device_mesh import make_mesh, parse_mesh
from ctopd_jax.models import weights   # weights.load_hf_checkpoint read at call time (tests trip on it)
from ctopd_jax.preflight import check_hf_checkpoint
from ctopd_jax.tokenization.side import load_tokenizer_side


def check_out(out: str | Path) -> None:
    """Before any work: `--out` is a new or empty-of-reports folder we may write (a finished
    evaluation is never lost to a target that cannot take it, nor replaces an earlier one)."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file; give a folder for {', '.join(REPORT_FILES)}")
    held = [name for name in REPORT_FILES if (out / name).exists()]
    if held and (out / REPORT_INCOMPLETE).exists():   # a killed evaluation's: this one replaces it
        print(f"{PROG}: --out {out}: replacing the report an interrupted evaluation left "
              "half-written", file=sys.stderr, flush=True)
    elif held:
        raise UserError(f"--out {out}: already holds {held[0]} of an earlier evaluation; choose "
                        "another folder or move those files away")
    try:
        check_writable(out, "--out")
    except RunDirError as err:
        raise UserError(str(err)) from None


# ----------------------------------------------------------------------------- command line
PROG = "python -m ctopd_jax.evaluate"


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__)
    p.add_argument("--config", help="run YAML (rollout sampling settings, model dtype, tokenizer)")
    p.add_argument("--set", action="append", default=[], metavar="A.B=C", help="config override")
    p.add_argument("--checkpoint", help="HF safetensors directory of the model to evaluate")
    p.add_argument("--mesh", help="shard the model, e.g. data=2,fsdp=2,tensor=2 (default: one device)")
    p.add_argument("--tokenizer", help="tokenizer name or directory (default: see module doc)")
    p.add_argument("--eos-token", help="end-of-turn token string if not the tokenizer's eos_token")
    p.add_argument("--dataset", help="dataset name or file (see ctopd_jax.data.eval_sets)")
    p.add_argument("--limit", type=at_least(1), help="evaluate only the first N problems")
    p.add_argument("--system-prompt", metavar="TEXT",
                   help="the system turn of every problem without chat messages of its own, instead "
                        "of the data set's (files: the math prompt, ask for a \\boxed answer); '' "
                        "for none (the chat template's default)")
    p.add_argument("--samples", type=at_least(1), help="samples per problem K (default: config evaluation.samples)")
    p.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=None,
                   help="temperature 0 (default: evaluation.greedy of the config when K == 1)")
    p.add_argument("--max-new-tokens", type=at_least(1))
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--out", help="directory for samples.jsonl, per_problem.jsonl, summary.json")
    p.add_argument("--grade-only", metavar="FILE", help="grade an existing samples jsonl")
    p.add_argument("--answer-fallbacks", action="store_true",
                   help="--grade-only: accept '#### X' / 'The answer is X' when unboxed")
    p.add_argument("--task-grader", choices=["math", "demo"], default="math",
                   help="--grade-only: the demo task's own grader instead of the math grader")
    p.add_argument("--timeout", type=positive, default=5.0, help="seconds per symbolic comparison")
    p.add_argument("--workers", type=at_least(1), default=1, help="sympy worker processes")
    return p


def _print(report: EvalReport, out: str | None) -> None:
    print(f"{report.dataset}: {report.n_problems} problems x {report.k} samples  "
          f"mean@{report.k}={report.mean_at_k:.4f}  pass@{report.k}={report.pass_at_k:.4f}  "
          f"methods={report.grading_methods}" + (f"  -> {out}" if out else ""))


def main(argv: Sequence[str] | None = None) -> EvalReport:
    """The command as a function: returns the report, raises on bad input (see `cli_main`)."""
    args = _parser().parse_args(argv)
    with contextlib.ExitStack() as held:
        if args.out:   # one writer per --out: a second evaluation into it is refused at once
            args.out = str(Path(args.out).expanduser())
            check_out(args.out)
            held.enter_context(RunLock(args.out, "--out"))
        return _evaluate(args)


def _evaluate(args) -> EvalReport:
    grader = MathGrader(timeout_s=args.timeout, workers=args.workers)
    try:
        if args.grade_only:
            grade_fn = None
            if args.task_grader == "demo":  # the grader the demo registered with its data set
                grade_fn = load_dataset("demo").grade_fn
            report = grade_file(args.grade_only, answer_fallbacks=args.answer_fallbacks,
                                grade_fn=grade_fn, k=args.samples, grader=grader)
        else:
            report = _generate_from_cli(args, grader)
    finally:
        grader.close()
    if args.out:
        write_report(report, args.out)
    _print(report, args.out)
    return report


def _generate_from_cli(args, grader: MathGrader) -> EvalReport:
    cfg = load_config(args.config, args.set, mesh=args.mesh)
    dataset_name = args.dataset or cfg.evaluation.dataset
    if not args.checkpoint:
        raise SystemExit("--checkpoint DIR is required unless --grade-only is given")
    if not dataset_name:
        raise SystemExit("--dataset is required (or set evaluation.dataset in the config)")
    k = args.samples if args.samples is not None else cfg.evaluation.samples
    limit = args.limit if args.limit is not None else (cfg.evaluation.max_problems or None)
    dataset = load_dataset(dataset_name, limit=limit, seed=args.seed)  # bad rows fail here, first
    if args.system_prompt is not None:   # a task of its own (bare numbers, code) asks its own way
        dataset = dataclasses.replace(dataset, system_prompt=args.system_prompt or None)
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"--checkpoint {checkpoint}: no config.json; pass an HF safetensors "
                         "directory (the trainer's export)")
    model_cfg = check_hf_checkpoint(checkpoint, "--checkpoint")   # shard headers, before any weight
    if args.mesh:
        validate(cfg, device_count=jax.device_count())

    tokenizer = load_tokenizer_side(args.tokenizer or cfg.model.student_tokenizer or checkpoint,
                                    eos_token=args.eos_token)
    new_tokens = args.max_new_tokens or cfg.rollout.generate_max_len
    longest = max(len(e.ids) for e in tokenizer.tokenizer.encode_batch(
        [build_prompt(tokenizer, p, dataset.system_prompt) for p in dataset.problems],
        add_special_tokens=False))
    if longest + new_tokens > model_cfg.max_position_embeddings:   # else found after the load
        flag = "--max-new-tokens" if args.max_new_tokens else "rollout.generate_max_len"
        raise SystemExit(f"{flag} {new_tokens}: the longest prompt of {dataset_name} has {longest} "
                         f"tokens, and {longest} + {new_tokens} is over the model's "
                         f"max_position_embeddings {model_cfg.max_position_embeddings}; lower "
                         f"{flag} to <= {model_cfg.max_position_embeddings - longest}")
    mesh = None
    if args.mesh:
        mesh = make_mesh(parse_mesh(args.mesh))
    model, _ = weights.load_hf_checkpoint(checkpoint, mesh=mesh, dtype=cfg.model.dtype,
                                  param_dtype=cfg.model.param_dtype)
    # --greedy / --no-greedy win; otherwise the config's evaluation.greedy, but only for K == 1
    # (K greedy samples would be K copies of one response).
    greedy = args.greedy if args.greedy is not None else (cfg.evaluation.greedy and k == 1)
    return evaluate_model(
        model, tokenizer, dataset, k=k, greedy=greedy, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=max(0, cfg.rollout.top_k),
        max_new_tokens=new_tokens, seed=args.seed,
        grader=grader, mesh=mesh, engine_name=cfg.rollout.engine)


def cli_main(argv: Sequence[str] | None = None) -> int:
    """Entry point: bad input ends with one line naming the problem and exit status 2
    (`ctopd_jax.common.cli`; --debug shows the traceback)."""
    return run(lambda a: (main(a), 0)[1], argv, PROG)


if __name__ == "__main__":
    sys.exit(cli_main())
