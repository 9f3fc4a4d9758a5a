"""``python -m ctopd_jax.evaluate``: sample K responses per problem, grade them, report mean@K.

    python -m ctopd_jax.evaluate --checkpoint DIR --dataset NAME_OR_FILE --samples K \\
        [--config configs/X.yaml] [--greedy] [--out DIR] [--tokenizer NAME_OR_DIR]
    python -m ctopd_jax.evaluate --grade-only samples.jsonl [--answer-fallbacks] [--out DIR]

Definitions (decisions where SPEC is silent):
- mean@K: the mean over problems of (correct samples / samples) — the paper's "mean@32".
- pass@K: the fraction of problems with at least one correct sample among their K; with a
  different number n_i of samples per problem (``--grade-only`` files) the unbiased estimator
  1 - C(n-c, K)/C(n, K) is averaged, which equals the plain fraction when n_i == K.
- Prompt: the model's own chat template (its tokenizer's), a system turn with the SPEC §10
  instruction for math sets, one user turn with the problem. Sources that already hold chat
  messages (parquet prompts) are rendered as they are. See ``build_prompt``.
- ``--checkpoint`` is an HF safetensors directory (config.json + *.safetensors), what the
  trainer exports; the tokenizer comes from ``--tokenizer``, else ``model.student_tokenizer``
  of the config, else the checkpoint directory itself.
- Engine: ``rollout.engine`` of the config ("jax" default, or "vllm"); generation stops at the
  tokenizer's eos and at any end-of-turn marker it has (``stop_ids``).
- Sampling: ``--greedy`` sets temperature 0 (without the flag: the config's
  ``evaluation.greedy``, applied only when K == 1); otherwise the config's rollout temperature /
  top_p / top_k; max new tokens from ``--max-new-tokens`` or ``rollout.generate_max_len``.

Outputs under ``--out``: ``samples.jsonl`` (one graded sample per line; re-gradable with
``--grade-only``), ``per_problem.jsonl`` and ``summary.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ctopd_jax.datasets import EvalDataset, EvalProblem, load_dataset
from ctopd_jax.grading import MathGrader
from ctopd_jax.records import RecordError, read_jsonl


@dataclass
class EvalReport:
    dataset: str
    k: int
    n_problems: int
    mean_at_k: float
    pass_at_k: float
    samples: list[dict] = field(repr=False)
    per_problem: list[dict] = field(repr=False)
    timing: dict[str, float] = field(default_factory=dict)
    grading_methods: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "k": self.k, "n_problems": self.n_problems,
                f"mean@{self.k}": self.mean_at_k, f"pass@{self.k}": self.pass_at_k,
                "n_samples": len(self.samples), "grading_methods": self.grading_methods,
                "timing_s": self.timing}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# End-of-turn / end-of-text markers of the supported families. Generation stops on any that the
# tokenizer has, besides its configured eos: a Llama-3 config naming <|end_of_text|> must still
# stop at the chat's <|eot_id|>, a Qwen base config at <|im_end|>.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")


def stop_ids(tokenizer_side) -> tuple[int, ...]:
    ids = [tokenizer_side.eos_id]
    for marker in END_MARKERS:
        idx = tokenizer_side.tokenizer.token_to_id(marker)
        if idx is not None and idx in tokenizer_side.special_ids and idx not in ids:
            ids.append(idx)
    return tuple(ids)


def build_prompt(tokenizer_side, problem: EvalProblem, system_prompt: str | None) -> str:
    """The prompt string for one problem, rendered with the model's own chat template."""
    if problem.messages is not None:
        return tokenizer_side.render_prompt(list(problem.messages))
    return tokenizer_side.render_prompt(problem.problem, system=system_prompt)


def grade_samples(samples: list[dict], *, answer_fallbacks: bool = False,
                  grade_fn: Callable[[str, str], bool] | None = None,
                  grader: MathGrader | None = None) -> list[dict]:
    """Add ``extracted``, ``correct`` and ``method`` to each sample (needs response/answer)."""
    if grade_fn is not None:
        for s in samples:
            s.update(extracted=None, correct=bool(grade_fn(s["response"], s["answer"])),
                     method="task_grader")
        return samples
    own = grader is None
    grader = grader or MathGrader()
    try:
        results = grader.grade_many([s["response"] for s in samples],
                                    [s["answer"] for s in samples], answer_fallbacks)
    finally:
        if own:
            grader.close()
    for s, r in zip(samples, results):
        s.update(extracted=r.extracted, correct=r.correct, method=r.method)
    return samples


def summarize(samples: list[dict], k: int | None = None) -> tuple[list[dict], float, float, int]:
    """Per-problem rows, mean@K, pass@K and K from graded samples grouped by ``id``."""
    groups: OrderedDict[str, list[dict]] = OrderedDict()
    for s in samples:
        groups.setdefault(str(s["id"]), []).append(s)
    if not groups:
        raise ValueError("no samples to summarize")
    k = k or max(len(g) for g in groups.values())
    rows = []
    for pid, group in groups.items():
        n, c = len(group), sum(bool(s["correct"]) for s in group)
        rows.append({"id": pid, "problem": group[0]["problem"], "answer": group[0]["answer"],
                     "n": n, "n_correct": c, "mean": c / n,
                     f"pass@{k}": pass_at_k(n, c, min(k, n))})
    mean = sum(r["mean"] for r in rows) / len(rows)
    passed = sum(r[f"pass@{k}"] for r in rows) / len(rows)
    return rows, mean, passed, k


def _report(dataset: str, samples: list[dict], k: int | None, timing: dict) -> EvalReport:
    rows, mean, passed, k = summarize(samples, k)
    methods: dict[str, int] = {}
    for s in samples:
        methods[s["method"]] = methods.get(s["method"], 0) + 1
    return EvalReport(dataset, k, len(rows), mean, passed, samples, rows, timing, methods)


def evaluate_model(model, tokenizer_side, problems: EvalDataset | Sequence[EvalProblem], engine=None,
                   k: int = 1, *, greedy: bool = False, temperature: float = 1.0,
                   top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 512, seed: int = 0,
                   grader: MathGrader | None = None, out_dir: str | Path | None = None,
                   mesh=None, engine_name: str = "jax") -> EvalReport:
    """Generate ``k`` samples per problem with ``engine`` (default: ``engine_name``'s engine on
    ``model``, stopping at ``stop_ids``), grade them and return the report; the trainer calls
    this at a step with its own engine (weights already synced). Writes the report files when
    ``out_dir`` is given."""
    from ctopd_jax.rollout.base import SamplingParams

    if k < 1:
        raise ValueError(f"samples per problem must be >= 1, got {k}")
    dataset = problems if isinstance(problems, EvalDataset) else EvalDataset("problems", list(problems))
    if not dataset.problems:
        raise ValueError("no problems to evaluate")
    prompts = [tokenizer_side.encode(build_prompt(tokenizer_side, p, dataset.system_prompt))
               for p in dataset.problems]
    if engine is None:
        from ctopd_jax.rollout import make_rollout_engine

        extra = ({"max_model_len": max(map(len, prompts)) + max_new_tokens}
                 if engine_name == "vllm" else {})
        engine = make_rollout_engine(engine_name, model, stop_ids(tokenizer_side),
                                     tokenizer_side.pad_id, mesh=mesh, **extra)
    params = SamplingParams(temperature=0.0 if greedy else temperature, top_p=top_p,
                            top_k=top_k, max_new_tokens=max_new_tokens, n=k, seed=seed)
    start = time.perf_counter()
    result = engine.generate(prompts, params)
    generated = time.perf_counter()
    samples = []
    for j, (tokens, prompt_index) in enumerate(zip(result.token_ids, result.prompt_index)):
        p = dataset.problems[prompt_index]
        samples.append({"id": p.id, "sample_index": j % k, "problem": p.problem,
                        "answer": p.answer, "response": tokenizer_side.decode(tokens),
                        "finish_reason": result.finish_reasons[j], "num_tokens": len(tokens)})
    grade_samples(samples, answer_fallbacks=dataset.answer_fallbacks, grade_fn=dataset.grade_fn,
                  grader=grader)
    graded = time.perf_counter()
    report = _report(dataset.name, samples, k, {"generation": generated - start,
                                                 "grading": graded - generated})
    if out_dir is not None:
        write_report(report, out_dir)
    return report


def grade_file(path: str | Path, *, answer_fallbacks: bool = False,
               grade_fn: Callable[[str, str], bool] | None = None, k: int | None = None,
               grader: MathGrader | None = None) -> EvalReport:
    """Grade an existing jsonl of samples (``problem``, ``answer``, ``response``, opt. ``id``)."""
    path = Path(path)
    samples = []
    for where, row in read_jsonl(path):
        for key in ("problem", "answer", "response"):
            if not isinstance(row.get(key), str):
                raise RecordError(f"{where}: field {key!r} must be a string "
                                  "(samples need problem, answer, response; id optional)")
        row.setdefault("id", row["problem"])
        samples.append(row)
    if not samples:
        raise ValueError(f"{path}: no samples")
    start = time.perf_counter()
    grade_samples(samples, answer_fallbacks=answer_fallbacks, grade_fn=grade_fn, grader=grader)
    return _report(str(path), samples, k, {"grading": time.perf_counter() - start})


REPORT_FILES = ("samples.jsonl", "per_problem.jsonl", "summary.json")


def write_report(report: EvalReport, out_dir: str | Path) -> Path:
    """The report files under `out_dir`, written in a temporary sibling folder first and then
    moved into place: a write that fails (no space) leaves `out_dir` as it was."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        texts = {"samples.jsonl": "".join(json.dumps(s, ensure_ascii=False) + "\n"
                                          for s in report.samples),
                 "per_problem.jsonl": "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                              for r in report.per_problem),
                 "summary.json": json.dumps(report.summary(), indent=2) + "\n"}
        for name, text in texts.items():
            (staging / name).write_text(text, encoding="utf-8")
        out.mkdir(exist_ok=True)
        for name in REPORT_FILES:
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def check_out(out: str | Path) -> None:
    """Before any work: `--out` is a new or empty-of-reports folder we may write (a finished
    evaluation is never lost to a target that cannot take it, nor replaces an earlier one)."""
    from ctopd_jax.cli import UserError
    from ctopd_jax.run_dir import RunDirError, check_writable

    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file; give a folder for {', '.join(REPORT_FILES)}")
    held = [name for name in REPORT_FILES if (out / name).exists()]
    if held:
        raise UserError(f"--out {out}: already holds {held[0]} of an earlier evaluation; choose "
                        "another folder or move those files away")
    try:
        check_writable(out, "--out")
    except RunDirError as err:
        raise UserError(str(err)) from None


# ----------------------------------------------------------------------------- command line
PROG = "python -m ctopd_jax.evaluate"


def _parser() -> argparse.ArgumentParser:
    from ctopd_jax.cli import Parser, at_least, positive, seed

    p = Parser(prog=PROG, description=__doc__)
    p.add_argument("--config", help="run YAML (rollout sampling settings, model dtype, tokenizer)")
    p.add_argument("--set", action="append", default=[], metavar="A.B=C", help="config override")
    p.add_argument("--checkpoint", help="HF safetensors directory of the model to evaluate")
    p.add_argument("--mesh", help="shard the model, e.g. data=2,fsdp=2,tensor=2 (default: one device)")
    p.add_argument("--tokenizer", help="tokenizer name or directory (default: see module doc)")
    p.add_argument("--eos-token", help="end-of-turn token string if not the tokenizer's eos_token")
    p.add_argument("--dataset", help="dataset name or file (see ctopd_jax.datasets)")
    p.add_argument("--limit", type=at_least(1), help="evaluate only the first N problems")
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
    if args.out:
        args.out = str(Path(args.out).expanduser())
        check_out(args.out)
    grader = MathGrader(timeout_s=args.timeout, workers=args.workers)
    try:
        if args.grade_only:
            grade_fn = None
            if args.task_grader == "demo":  # the grader the demo registered with its data set
                from ctopd_jax.datasets import load_dataset
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
    from ctopd_jax.config import load_config

    cfg = load_config(args.config, args.set, mesh=args.mesh)
    dataset_name = args.dataset or cfg.evaluation.dataset
    if not args.checkpoint:
        raise SystemExit("--checkpoint DIR is required unless --grade-only is given")
    if not dataset_name:
        raise SystemExit("--dataset is required (or set evaluation.dataset in the config)")
    k = args.samples if args.samples is not None else cfg.evaluation.samples
    limit = args.limit if args.limit is not None else (cfg.evaluation.max_problems or None)
    dataset = load_dataset(dataset_name, limit=limit, seed=args.seed)  # bad rows fail here, first
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"--checkpoint {checkpoint}: no config.json; pass an HF safetensors "
                         "directory (the trainer's export)")
    from ctopd_jax.preflight import check_hf_checkpoint

    model_cfg = check_hf_checkpoint(checkpoint, "--checkpoint")   # shard headers, before any weight
    if args.mesh:
        import jax

        from ctopd_jax.config import validate
        validate(cfg, device_count=jax.device_count())

    from ctopd_jax.models.weights import load_hf_checkpoint
    from ctopd_jax.tokenization.side import load_tokenizer_side

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
        from ctopd_jax.mesh import make_mesh, parse_mesh

        mesh = make_mesh(parse_mesh(args.mesh))
    model, _ = load_hf_checkpoint(checkpoint, mesh=mesh, dtype=cfg.model.dtype,
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
    (`ctopd_jax.cli`; --debug shows the traceback)."""
    from ctopd_jax.cli import run

    return run(lambda a: (main(a), 0)[1], argv, PROG)



def evaluate_during_training(config, step: int, student, s_tok, engine, run_dir) -> dict[str, float]:
    """`evaluation:` of a run at `step` (every N steps and at the end): mean@K and pass@K with the
    run's sampling settings, graded samples under <run_dir>/eval/step_N (run_dir None: not
    written, e.g. on processes other than the first)."""
    e = config.evaluation
    if not e.dataset or not (step == config.steps or (e.every and step % e.every == 0)):
        return {}
    from ctopd_jax.datasets import load_dataset

    dataset = load_dataset(e.dataset, limit=e.max_problems or None)
    r = config.rollout
    report = evaluate_model(student, s_tok, dataset, engine=engine, k=e.samples, greedy=e.greedy,
                            temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.generate_max_len,
                            seed=step, out_dir=None if run_dir is None else Path(run_dir) / "eval" / f"step_{step}")
    return {"eval_mean_at_k": report.mean_at_k, "eval_pass_at_k": report.pass_at_k}

if __name__ == "__main__":
    sys.exit(cli_main())
