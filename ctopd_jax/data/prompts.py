"""Prompt pipelines over jsonl / parquet files, deterministic and exactly resumable.

A prompt file holds one row per prompt with either a `prompt` string or a chat `messages`
list ([{"role": ..., "content": ...}, ...]); which column is read is `data.prompt_key` (when
that column is absent and `messages` is present, `messages` is used). Every row is validated
when the file is opened, so a bad row fails with `file:line` before any model is loaded.

Order: a grain `MapDataset` shuffled by `seed` and repeated forever; grain draws a fresh
permutation per epoch. Batch k is rows [k*B, (k+1)*B) of that infinite sequence, so the
iterator state is one integer (the next batch index): saving it and restoring it gives exactly
the same batches as an uninterrupted run (step-indexed data).

Groups (a run with several teachers: the teacher each prompt is routed to): each group is
shuffled and repeated on its own, and every batch takes the same number of prompts from each,
its share of the batch rounded by largest remainder, at least one (`batch_shares`). A teacher's
programs then see the same batch size every iteration, not a new one to compile, and its share
of an update does not swing from batch to batch; the price is a share off the data's by less
than one prompt a batch (a group of 73 rows beside one of 72 takes 16 of every 32), and each
group's epochs turn over apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import grain

from ctopd_jax.common import sources
from ctopd_jax.common.records import RecordError, chat_messages, read_jsonl, read_parquet


# A prompt file or row that cannot be used; the message names file and line.
DataError = RecordError


@dataclass(frozen=True)
class Prompt:
    """One prompt as chat messages; `source` is "file:line" for error messages and logs."""
    messages: tuple[dict[str, str], ...]
    source: str
    extra: dict[str, Any] = field(default_factory=dict)  # other columns (answer, id, ...)

    @property
    def text(self) -> str:
        """The last user turn (what a plain `prompt` row held)."""
        return self.messages[-1]["content"]


def _as_messages(value: Any, key: str, where: str) -> tuple[dict[str, str], ...]:
    messages = chat_messages(value, key, where)
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: the last message of {key!r} has role "
                        f"{messages[-1]['role']!r}; a prompt must end with a user turn")
    return messages


def _row_to_prompt(row: Any, prompt_key: str, where: str, system_prompt: str) -> Prompt:
    key = prompt_key if prompt_key in row else ("messages" if "messages" in row else None)
    if key is None:
        raise DataError(f"{where}: no {prompt_key!r} column (nor 'messages'); columns are "
                        f"{sorted(row)}; set data.prompt_key to the prompt column")
    messages = _as_messages(row[key], key, where)
    if system_prompt and messages[0]["role"] != "system":
        messages = ({"role": "system", "content": system_prompt},) + messages
    extra = {k: v for k, v in row.items() if k not in (key,)}
    return Prompt(messages=messages, source=where, extra=extra)


def load_prompts(path: str | Path, prompt_key: str = "prompt", system_prompt: str = "") -> list[Prompt]:
    """All prompts of a .jsonl / .json(l) / .parquet file, validated row by row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.path {path}: file not found; give a .jsonl or .parquet "
                                "prompt file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = read_jsonl(path)
    elif suffix == ".parquet":
        rows = read_parquet(path)
    else:
        raise DataError(f"data.path {path}: unsupported extension {suffix!r}; use .jsonl or .parquet")
    prompts = [_row_to_prompt(row, prompt_key, where, system_prompt) for where, row in rows]
    if not prompts:
        raise DataError(f"data.path {path}: the file holds no prompts")
    return prompts


def _repeated(items: list, seed: int, shuffle: bool):
    """`items` forever, a fresh permutation per epoch when shuffled."""
    dataset = grain.MapDataset.source(items)
    return (dataset.shuffle(seed=seed) if shuffle else dataset).repeat(None)


def batch_shares(sizes: Sequence[int], batch_size: int) -> list[int]:
    """Prompts a batch takes from each group of `sizes` rows: its share of `batch_size` by
    largest remainder, at least one each."""
    if batch_size < len(sizes):
        raise DataError(f"batch size {batch_size} is smaller than the {len(sizes)} groups of prompts "
                        f"(teachers); raise it to at least {len(sizes)}")
    quotas = [batch_size * n / sum(sizes) for n in sizes]
    shares = [max(1, int(q)) for q in quotas]
    while sum(shares) < batch_size:
        shares[max(range(len(shares)), key=lambda g: quotas[g] - shares[g])] += 1
    while sum(shares) > batch_size:
        shares[max((g for g in range(len(shares)) if shares[g] > 1),
                   key=lambda g: shares[g] - quotas[g])] -= 1
    return shares


class PromptStream:
    """Batches of prompts by index; `state()` / `restore()` carry the next batch index.
    `groups` (one label per prompt): every batch takes a fixed share of each (module doc)."""

    def __init__(self, prompts: Sequence[Prompt], batch_size: int, seed: int = 0, shuffle: bool = True,
                 groups: Sequence[Any] | None = None):
        if batch_size < 1:
            raise DataError(f"batch size must be >= 1, got {batch_size}")
        self.prompts = list(prompts)
        self.batch_size = batch_size
        labels = list(groups) if groups is not None else [None] * len(self.prompts)
        members = [[p for p, label in zip(self.prompts, labels) if label == name]
                   for name in dict.fromkeys(labels)]
        self._groups = [_repeated(m, seed + g, shuffle) for g, m in enumerate(members)]
        self._shares = batch_shares([len(m) for m in members], batch_size)
        self.position = 0

    def batch(self, index: int) -> list[Prompt]:
        return [group[index * share + k] for group, share in zip(self._groups, self._shares)
                for k in range(share)]

    def next_batch(self) -> list[Prompt]:
        batch = self.batch(self.position)
        self.position += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state(self) -> dict[str, int]:
        return {"position": self.position}

    def restore(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def resolve_named_source(name: str) -> Path:
    """`owner:split` prompt files (e.g. `demo:train`), written by the module that owns them."""
    try:
        return Path(sources.resolve("prompts", name, "data.path"))
    except (sources.SourceError, ValueError) as err:
        raise DataError(str(err)) from None


SOURCE_FIELDS = ("response", "completion")


def response_text(prompt) -> str:
    """The dataset response of a prompt row (`response` or `completion` column, or the assistant
    turn that ended its chat messages); one line naming file:line when it has none."""
    for key in SOURCE_FIELDS:
        value = prompt.extra.get(key)
        if isinstance(value, str) and value:
            return value
    raise RecordError(f"{prompt.source}: no dataset response: the row needs a non-empty "
                      f"'response' or 'completion' string or chat messages ending in an assistant "
                      "turn (the objective trains on dataset responses: needs.responses)")


def load_response_prompts(path, prompt_key: str = "prompt", system_prompt: str = ""):
    """Prompt rows that carry a dataset response; chat messages ending in an assistant turn are
    split into the prompt (the turns before) and the response (that turn's content)."""

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.path {path}: file not found; give a .jsonl or .parquet file")
    rows = read_parquet(path) if path.suffix.lower() == ".parquet" else read_jsonl(path)
    prompts = []
    for where, row in rows:
        key = prompt_key if prompt_key in row else ("messages" if "messages" in row else None)
        if key is not None and not isinstance(row[key], str):
            messages = chat_messages(row[key], key, where)
            if messages[-1]["role"] == "assistant":
                if len(messages) < 2:
                    raise RecordError(f"{where}: {key!r} holds only an assistant turn; a prompt turn "
                                      "must come before it")
                row = {**{k: v for k, v in row.items() if k != key}, key: list(messages[:-1]),
                       "response": messages[-1]["content"]}
        prompt = _row_to_prompt(row, prompt_key, where, system_prompt)
        response_text(prompt)   # every row checked now, before any model loads
        prompts.append(prompt)
    if not prompts:
        raise RecordError(f"data.path {path}: the file holds no prompts")
    return prompts


def response_prompts(data_section):
    """The prompt rows of `data:` with their dataset responses (load_response_prompts)."""
    d = data_section
    path = resolve_named_source(d.path) if sources.is_named(d.path) else d.path
    return load_response_prompts(path, d.prompt_key, d.system_prompt)
