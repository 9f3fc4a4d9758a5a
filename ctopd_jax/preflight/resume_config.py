"""Resuming with a changed config: which fields may differ, the refusal, and the change log.

`--resume` continues a run from its checkpoint; the saved config is `<output_dir>/config.json`
(else the `config` stored in the newest checkpoint's meta). `check_resume_config` compares it
with the new config field by field and refuses (ConfigChangeError naming every changed field)
unless each change is harmless or `--allow-config-change` is given; the accepted changes are
appended to `<output_dir>/config_changes.jsonl` by `record_config_changes`.

A run is the one whose checkpoints `output_dir` / `checkpoint.dir` lead to, not the spelling
of those paths: `runs/x/`, `./runs/x`, the absolute path and a folder moved elsewhere are all
the same run, so both fields are harmless. Harmless too (they change neither the data order,
the models, the objective nor the optimizer trajectory): every `logging.*`, `evaluation.*` and
`guard.*` field; `checkpoint.every / keep / async_save / export_hf`; `run_name`; `mesh.*` (the
checkpoint is resharded on restore); `model.remat`, `algorithm.implementation`,
`algorithm.chunked_loss_size`,
`optimizer.micro_batch_tokens` (same numbers up to float rounding);
`rollout.vllm_gpu_memory_utilization`; how a served teacher is reached (`teacher.url`,
`timeout_s`, `max_concurrency`, `retries`, `backoff_s`, `max_tokens_per_request`, `launch`,
`launch_python`: a server restarted elsewhere scores the same ids alike; its engine, model and
top_k still count). `steps` may grow when `optimizer.schedule` is `constant`; with a cosine
schedule the lr curve is defined over the total number of steps, so a different `steps` bends
the remaining schedule and needs `--allow-config-change`; `steps` below the checkpoint's step
is refused by preflight whatever the flag. A field that the saved config lacks (written by an
older version) is harmless when the new value is that field's default.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ctopd_jax.config import TrainConfig
from ctopd_jax.loop.checkpoint import checkpoint_metas

HARMLESS_PREFIXES = ("logging.", "evaluation.", "guard.", "mesh.")
HARMLESS_FIELDS = frozenset({
    "output_dir", "checkpoint.dir", "run_name", "checkpoint.every", "checkpoint.keep", "checkpoint.async_save",
    "checkpoint.export_hf", "model.remat", "algorithm.implementation",
    "algorithm.chunked_loss_size", "optimizer.micro_batch_tokens", "rollout.vllm_gpu_memory_utilization",
    "teacher.url", "teacher.timeout_s", "teacher.max_concurrency", "teacher.retries",
    "teacher.backoff_s", "teacher.max_tokens_per_request", "teacher.launch",
    "teacher.launch_python"})
CHANGES_FILE = "config_changes.jsonl"
_ABSENT = "<absent>"


class ConfigChangeError(ValueError):
    """--resume with a config that differs from the saved one in fields that matter."""


@dataclass(frozen=True)
class ConfigChange:
    field: str
    old: Any
    new: Any
    harmless: bool

    def describe(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r}"


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def _defaults() -> dict[str, Any]:
    return flatten(dataclasses.asdict(TrainConfig()))


def config_changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[ConfigChange]:
    """Every field whose value differs (fields only in `saved` are ignored: they were removed)."""
    old, cur, defaults = flatten(saved), flatten(new), _defaults()
    changes = []
    for name in sorted(cur):
        if name in old and old[name] == cur[name]:
            continue
        if name not in old:
            changes.append(ConfigChange(name, _ABSENT, cur[name],
                                        harmless=defaults.get(name, _ABSENT) == cur[name]))
            continue
        harmless = name.startswith(HARMLESS_PREFIXES) or name in HARMLESS_FIELDS
        if name == "steps":
            harmless = (cur.get("optimizer.schedule") == "constant"
                        and old.get("optimizer.schedule") == "constant" and cur[name] > old[name])
        changes.append(ConfigChange(name, old[name], cur[name], harmless))
    return changes


def check_resume_config(saved: Mapping[str, Any] | None, new: Mapping[str, Any],
                        allow_change: bool = False, where: str = "") -> list[ConfigChange]:
    """The changes between the saved and the new config; raises ConfigChangeError when one is
    not harmless and `allow_change` is False. `saved` None (nothing saved): no changes."""
    if saved is None:
        return []
    changes = config_changes(saved, new)
    blocking = [c for c in changes if not c.harmless]
    if blocking and not allow_change:
        listed = "; ".join(c.describe() for c in blocking)
        raise ConfigChangeError(
            f"--resume: the config differs from the saved one{' in ' + where if where else ''} "
            f"in {listed}; restore those values, or pass --allow-config-change to continue with "
            "them (the changes are then logged to config_changes.jsonl)")
    return changes


def read_saved_config(run_dir: str | Path, checkpoint_dir: str | Path | None = None
                      ) -> tuple[dict[str, Any] | None, str]:
    """(saved config dict, where it was read) from run_dir/config.json, else from the newest
    checkpoint meta that holds one; (None, "") when neither exists."""
    path = Path(run_dir) / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8")), str(path)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigChangeError(f"{path}: not valid JSON; repair it or remove it to resume "
                                    "against the checkpoint's own config") from None
    if checkpoint_dir is not None:
        for step, meta in reversed(checkpoint_metas(Path(checkpoint_dir))):
            if meta and isinstance(meta.get("config"), dict):
                return meta["config"], f"{checkpoint_dir}/{step}"
    return None, ""


def record_config_changes(run_dir: str | Path, changes: list[ConfigChange],
                          resumed_step: int | None = None) -> Path | None:
    """Append one JSON line with the accepted changes to <run_dir>/config_changes.jsonl."""
    if not changes:
        return None
    path = Path(run_dir) / CHANGES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_from_step": resumed_step,
           "changes": [dataclasses.asdict(c) for c in changes]}
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row, default=str) + "\n")
    return path
