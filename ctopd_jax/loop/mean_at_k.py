"""Evaluation as a library: sample K responses per problem, grade them, mean@K and pass@K.

The command line (`python -m ctopd_jax.evaluate`, evaluate.py) and the trainer's in-run
evaluation (`evaluation:`, `evaluate_during_training`) both use these.
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

import json
import math
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ctopd_jax.common.kill_points import kill_point
from ctopd_jax.common.records import RecordError, read_jsonl
from ctopd_jax.data.eval_sets import EvalDataset, EvalProblem, build_prompt, load_dataset
from ctopd_jax.grading import MathGrader
from ctopd_jax.rollout import make_rollout_engine
from ctopd_jax.rollout.base import SamplingParams


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
    if k < 1:
        raise ValueError(f"samples per problem must be >= 1, got {k}")
    dataset = problems if isinstance(problems, EvalDataset) else EvalDataset("problems", list(problems))
    if not dataset.problems:
        raise ValueError("no problems to evaluate")
    prompts = [tokenizer_side.encode(build_prompt(tokenizer_side, p, dataset.system_prompt))
               for p in dataset.problems]
    if engine is None:
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
        raise RecordError(f"{path}: holds no samples (no non-blank line); give a jsonl with one "
                          "{problem, answer, response} object per line")
    start = time.perf_counter()
    grade_samples(samples, answer_fallbacks=answer_fallbacks, grade_fn=grade_fn, grader=grader)
    return _report(str(path), samples, k, {"grading": time.perf_counter() - start})


REPORT_FILES = ("samples.jsonl", "per_problem.jsonl", "summary.json")
# Beside the report files while they are moved into place, one by one: found in a folder, the
# report there is half-written (a kill in between), never an earlier evaluation's.
REPORT_INCOMPLETE = ".report-incomplete"


def write_report(report: EvalReport, out_dir: str | Path) -> Path:
    """The report files under `out_dir`, written in a temporary sibling folder first and then
    moved into place, `REPORT_INCOMPLETE` marking the moves: a write that fails (no space) or a
    kill leaves `out_dir` without a report taken for whole (summary.json comes last)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):   # a killed write's (one writer: --out's lock)
        shutil.rmtree(stale, ignore_errors=True)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
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
        (out / REPORT_INCOMPLETE).write_text("the report files here are being replaced\n")
        for name in REPORT_FILES:
            os.replace(staging / name, out / name)
            kill_point("report_write")
        (out / REPORT_INCOMPLETE).unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def evaluate_during_training(config, step: int, student, s_tok, engine, run_dir) -> dict[str, float]:
    """`evaluation:` of a run at `step` (every N steps and at the end): mean@K and pass@K with the
    run's sampling settings, graded samples under <run_dir>/eval/step_N (run_dir None: not
    written, e.g. on processes other than the first)."""
    e = config.evaluation
    if not e.dataset or not (step == config.steps or (e.every and step % e.every == 0)):
        return {}
    dataset = load_dataset(e.dataset, limit=e.max_problems or None)
    r = config.rollout
    report = evaluate_model(student, s_tok, dataset, engine=engine, k=e.samples, greedy=e.greedy,
                            temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.generate_max_len,
                            seed=step, out_dir=None if run_dir is None else Path(run_dir) / "eval" / f"step_{step}")
    return {"eval_mean_at_k": report.mean_at_k, "eval_pass_at_k": report.pass_at_k}
