"""Evaluation datasets: problems with reference answers, from files or offline generators.

``load_dataset(name_or_path)`` accepts:
- a MATH500-layout directory holding ``test.jsonl``, or any ``.jsonl`` file whose rows have
  ``problem`` + ``answer`` (optional ``unique_id``/``id``) — graded boxed-only (SPEC §10);
- a GSM8K ``.jsonl`` (rows ``question`` + ``answer`` ending in ``#### 42``) — the reference is
  the text after the last ``####``; responses may answer with a box, ``#### X`` or
  ``The answer is X``;
- a generic ``.jsonl`` with ``prompt`` (string or chat messages) + ``answer`` (the demo writes
  these) — fallbacks allowed;
- a ``.parquet`` of prompts in the paper's layout: a ``prompt`` column holding a string or a
  chat-messages list, the reference in ``answer``, ``ground_truth`` or
  ``reward_model.ground_truth`` (the verl/DAPO layout) — fallbacks allowed, since those prompts
  ask for ``Answer: X``;
- ``gsm_symbolic`` / ``gsm_symbolic:N`` — N (default 200) problems from reasoning-gym's
  GSM-Symbolic generator, seed ``seed`` (deterministic);
- ``champ`` — the 270 CHAMP competition problems (champ-dataset package). Many CHAMP answers
  are prose ("No", "0 is the only possible value"); those are graded by normalised string
  equality only, so scores there are a lower bound. ``champ:numeric`` keeps the problems whose
  answer is a plain number;
- ``demo`` — the held-out split of the demo's synthetic task (``ctopd_jax.demo.task``), graded
  by the task's own grader, prompted without the math system prompt.

A malformed row raises ``DatasetError`` naming ``file:line`` (parquet: ``file:row N``) and the fix,
before any model is loaded.
"""
from __future__ import annotations

import functools
import importlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ctopd_jax.common import sources
from ctopd_jax.common.records import RecordError, chat_messages, read_jsonl, read_parquet
from ctopd_jax.grading.normalize import normalize_answer
from ctopd_jax.grading.numeric import parse_number

MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


# A dataset file or row that cannot be used; the message names file and line.
DatasetError = RecordError


@dataclass(frozen=True)
class EvalProblem:
    id: str
    problem: str  # the user-turn text
    answer: str  # the reference answer string
    messages: tuple[dict[str, str], ...] | None = None  # a full chat prompt, when the source has one
    source: str = ""  # "file:line" (or generator name) for reports


@dataclass(frozen=True)
class EvalDataset:
    name: str
    problems: list[EvalProblem]
    answer_fallbacks: bool = False  # accept "#### X" / "The answer is X" when unboxed
    system_prompt: str | None = MATH_SYSTEM_PROMPT
    grade_fn: Callable[[str, str], bool] | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.problems)


def _text_field(row: dict, key: str, where: str, layout: str) -> str:
    value = row.get(key)
    if value is None:
        raise DatasetError(f"{where}: missing field {key!r} ({layout} rows need it)")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and key == "answer":
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where}: field {key!r} must be a non-empty string, got {value!r}")
    return value


def _messages(value: Any, where: str) -> tuple[tuple[dict[str, str], ...] | None, str]:
    """(messages or None, user text) from a prompt cell: a string or a chat-messages list."""
    if isinstance(value, str):
        return None, chat_messages(value, "prompt", where)[0]["content"]
    msgs = chat_messages(value, "prompt", where)
    users = [m["content"] for m in msgs if m["role"] == "user"]
    if not users:
        raise DatasetError(f"{where}: prompt messages contain no 'user' turn")
    return msgs, users[-1]


def gsm8k_reference(answer: str, where: str) -> str:
    """The final answer of a GSM8K reference solution: the text after the last '####'."""
    if "####" not in answer:
        raise DatasetError(f"{where}: GSM8K answer has no '#### <number>' line; the reference "
                           "solution must end with '#### ' and the final answer")
    final = answer.rsplit("####", 1)[1].strip()
    if not final:
        raise DatasetError(f"{where}: GSM8K answer has an empty '####' line")
    return final


def _load_jsonl(path: Path) -> EvalDataset:
    rows = read_jsonl(path)
    if not rows:
        raise DatasetError(f"{path}: no rows; an evaluation file needs at least one problem")
    first = rows[0][1]
    if "problem" in first:
        layout = "math"
    elif "question" in first:
        layout = "gsm8k"
    elif "prompt" in first:
        layout = "prompt"
    else:
        raise DatasetError(f"{rows[0][0]}: cannot tell the layout from fields "
                           f"{sorted(first)}; use problem+answer (MATH), question+answer "
                           "(GSM8K '#### X') or prompt+answer")
    problems = []
    for where, row in rows:
        line_no = where.rsplit(":", 1)[1]
        row_id = str(row.get("unique_id", row.get("id", f"{path.stem}:{line_no}")))
        if layout == "math":
            problem = _text_field(row, "problem", where, "MATH")
            answer = _text_field(row, "answer", where, "MATH")
            problems.append(EvalProblem(row_id, problem, answer, None, where))
        elif layout == "gsm8k":
            question = _text_field(row, "question", where, "GSM8K")
            answer = gsm8k_reference(_text_field(row, "answer", where, "GSM8K"), where)
            problems.append(EvalProblem(row_id, question, answer, None, where))
        else:
            if "prompt" not in row:
                raise DatasetError(f"{where}: missing field 'prompt' (prompt rows need it)")
            messages, text = _messages(row["prompt"], where)
            answer = _text_field(row, "answer", where, "prompt")
            problems.append(EvalProblem(row_id, text, answer, messages, where))
    return EvalDataset(str(path), problems, answer_fallbacks=layout != "math")


def _parquet_answer(row: dict, where: str) -> str:
    candidates = [row.get("answer"), row.get("ground_truth")]
    reward = row.get("reward_model")
    if isinstance(reward, dict):
        candidates.append(reward.get("ground_truth"))
    for value in candidates:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str) and value.strip():
            return value
    raise DatasetError(f"{where}: no reference answer; add an 'answer' column (or verl's "
                       "reward_model.ground_truth) to evaluate these prompts")


def _load_parquet(path: Path) -> EvalDataset:
    rows = read_parquet(path)
    if rows and "prompt" not in rows[0][1]:
        raise DatasetError(f"{path}: no 'prompt' column (columns: {sorted(rows[0][1])})")
    problems = []
    for i, (where, row) in enumerate(rows):
        messages, text = _messages(row["prompt"], where)
        answer = _parquet_answer(row, where)
        row_id = str(row.get("id") or (row.get("extra_info") or {}).get("index", f"{path.stem}:{i}"))
        problems.append(EvalProblem(row_id, text, answer, messages, where))
    if not problems:
        raise DatasetError(f"{path}: no rows")
    return EvalDataset(str(path), problems, answer_fallbacks=True)


def _eval_extra(module: str, name: str):
    """The package behind a named evaluation set; it ships in the `eval` extra, not the base
    install (training needs none of it)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DatasetError(f"the evaluation set {name!r} needs the package {module}: "
                           "pip install -e '.[eval]' (or pass a .jsonl/.parquet file)") from None


def _load_gsm_symbolic(size: int, seed: int) -> EvalDataset:
    reasoning_gym = _eval_extra("reasoning_gym", "gsm_symbolic")

    generated = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    problems = [EvalProblem(f"gsm_symbolic:{seed}:{i}", item["question"], str(item["answer"]),
                            None, f"reasoning_gym gsm_symbolic seed={seed} index={i}")
                for i, item in enumerate(generated)]
    return EvalDataset(f"gsm_symbolic:{size}", problems, answer_fallbacks=True)


@functools.lru_cache(maxsize=1)
def _champ_problems() -> tuple[EvalProblem, ...]:
    """CHAMP's file also holds every model conversation (tens of MB): parse it once."""
    data = _eval_extra("champ_dataset", "champ").load("v0")
    return tuple(EvalProblem(pid, p.text, p.answer, None, f"champ_dataset v0 {pid}")
                 for pid, p in data.problems.items())


def _load_champ(numeric_only: bool) -> EvalDataset:
    problems = [p for p in _champ_problems()
                if not numeric_only or parse_number(normalize_answer(p.answer)) is not None]
    return EvalDataset("champ:numeric" if numeric_only else "champ", problems)


def _load_named(name: str) -> EvalDataset:
    """A set registered by its owner (ctopd_jax.common.sources), e.g. `demo` (the demo's held-out split)."""
    try:
        return sources.resolve("dataset", f"{name}:held_out", "--dataset")
    except (sources.SourceError, ValueError) as err:
        raise DatasetError(str(err)) from None


def load_dataset(name_or_path: str | os.PathLike, *, limit: int | None = None,
                 seed: int = 0) -> EvalDataset:
    """Load an evaluation set by registry name or path (see module docstring)."""
    name = str(name_or_path)
    if limit is not None and limit < 1:
        raise DatasetError(f"limit must be >= 1, got {limit}")
    m = re.fullmatch(r"gsm_symbolic(?::(\d+))?", name)
    if m:
        dataset = _load_gsm_symbolic(int(m.group(1) or 200), seed)
    elif name in ("champ", "champ:numeric"):
        dataset = _load_champ(name == "champ:numeric")
    elif name == "demo":
        dataset = _load_named(name)
    else:
        path = Path(name)
        if path.is_dir():
            path = path / "test.jsonl"
        if not path.exists():
            raise DatasetError(f"{name!r} is neither a dataset name (gsm_symbolic[:N], champ, "
                               "champ:numeric, demo) nor an existing file or MATH500 directory")
        if path.suffix == ".parquet":
            dataset = _load_parquet(path)
        elif path.suffix in (".jsonl", ".json"):
            dataset = _load_jsonl(path)
        else:
            raise DatasetError(f"{path}: unknown file type {path.suffix!r}; use .jsonl or .parquet")
    if limit is not None:
        dataset = EvalDataset(dataset.name, dataset.problems[:limit], dataset.answer_fallbacks,
                              dataset.system_prompt, dataset.grade_fn)
    return dataset


def build_prompt(tokenizer_side, problem: EvalProblem, system_prompt: str | None) -> str:
    """The prompt string for one problem, rendered with the model's own chat template."""
    if problem.messages is not None:
        return tokenizer_side.render_prompt(list(problem.messages))
    return tokenizer_side.render_prompt(problem.problem, system=system_prompt)
