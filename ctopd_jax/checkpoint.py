"""Training checkpoints (Orbax) and HF export of the student.

One checkpoint per saved step holds two items:
- `state`: every array of the training state (student params, optimizer state, RNG key data),
  saved as a flat dict `leaf_00000 ...` in the order of `jax.tree.leaves`. Flat keys make the
  file independent of pytree node types (nnx.State, optax namedtuples) and of how Orbax would
  spell their paths; the tree structure comes from the live trainer at restore time and is
  checked against the key paths recorded in `meta`.
- `meta` (JSON): step, data-iterator state, config, the key paths of the leaves, a fingerprint
  of the parameters (float64 sum per leaf) and any extra scalars (e.g. the cumulative coverage
  counters needed so logged metrics continue exactly after a resume).

Saving is asynchronous (Orbax writes in the background; the next save or `close()` waits).
Orbax commits a step by renaming its temporary directory, so an interrupted write never shows
up as a step. A step that is listed but cannot be read (files damaged or missing) or whose
fingerprint disagrees is reported with a warning, moved aside to `<step>.corrupt`, and the
previous step is used.
"""
from __future__ import annotations

import logging
import math
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the current run."""


@dataclass
class Restored:
    step: int
    state: Any              # the pytree passed as `template`, filled with the saved arrays
    meta: dict[str, Any]


_OBJECT_REPR = re.compile(r"<(?:bound method|built-in method|function|module) [^<>]*(?:<[^<>]*>[^<>]*)*>")


def describe_error(err: BaseException, limit: int = 200) -> str:
    """`Type: first line` of an exception, without `<bound method ...>` object reprs that some
    libraries put in their messages (they name no file and help no one)."""
    text = _OBJECT_REPR.sub("", str(err))
    text = re.sub(r"\s+([:;,])", r"\1", " ".join(text.split())).strip(" :;,")
    return f"{type(err).__name__}: {text[:limit]}" if text else type(err).__name__


def _leaf_key(i: int) -> str:
    return f"leaf_{i:05d}"


def tree_paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


@jax.jit
def _leaf_sums(leaves):
    return [jnp.sum(jnp.asarray(x, jnp.float32)) for x in leaves]


def fingerprint(tree: Any) -> list[float]:
    """Per-leaf float32 sums (one compiled program per tree layout); cheap evidence that
    restored values are the saved ones. Works for multi-process arrays (sums are replicated)."""
    sums = _leaf_sums(jax.tree.leaves(tree))
    return [float(np.asarray(s.addressable_data(0) if isinstance(s, jax.Array) else s)) for s in sums]


class Checkpointer:
    """Save every `every` steps (and when forced), keep the last `keep`, restore the newest good one."""

    def __init__(self, directory: str | Path, every: int = 10, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.every = every
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    # ------------------------------------------------------------------ save
    def should_save(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def save(self, step: int, state: Any, meta: dict[str, Any], params_key: str = "params") -> None:
        """`state` is a dict of pytrees; the fingerprint covers `state[params_key]`."""
        leaves = jax.tree.leaves(state)
        arrays = {_leaf_key(i): leaf for i, leaf in enumerate(leaves)}
        full_meta = dict(meta, step=int(step), leaf_paths=tree_paths(state),
                         params_fingerprint=fingerprint(state[params_key]))
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(full_meta)), force=True)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    # ------------------------------------------------------------------ restore
    def steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def _restore_step(self, step: int, template: Any, params_key: str) -> Restored:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        paths = tree_paths(template)
        if meta.get("leaf_paths") != paths:
            saved = meta.get("leaf_paths") or []
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} holds {len(saved)} arrays with different "
                f"names than this run's {len(paths)} (another model or optimizer config?); "
                "use a fresh output_dir or the config the checkpoint was written with")
        leaves = jax.tree.leaves(template)
        abstract = {_leaf_key(i): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
                    for i, x in enumerate(leaves)}
        arrays = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract))).state
        restored = jax.tree.unflatten(jax.tree.structure(template),
                                      [arrays[_leaf_key(i)] for i in range(len(leaves))])
        got = fingerprint(restored[params_key])
        want = meta["params_fingerprint"]
        if not all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(got, want)):
            raise ValueError(f"parameter fingerprint mismatch after restoring step {step}")
        return Restored(step=step, state=restored, meta=meta)

    def restore_latest(self, template: Any, params_key: str = "params") -> Restored | None:
        """The newest readable checkpoint, or None when there is none at all.

        `template` is the live state (same structure, shapes, dtypes and shardings)."""
        steps = self.steps()
        for step in reversed(steps):
            try:
                return self._restore_step(step, template, params_key)
            except CheckpointError:
                raise
            except Exception as err:  # damaged files surface as many exception types
                message = (f"checkpoint step {step} in {self.directory} is unreadable or corrupt "
                           f"({describe_error(err)}); moving it to {step}.corrupt "
                           "and falling back to the previous checkpoint")
                # one report: a warning (shown once by Python; logging would print it again)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                self._set_aside(step)
        if steps:
            raise CheckpointError(f"no readable checkpoint in {self.directory} (tried steps {steps}); "
                                  "start without --resume or point checkpoint.dir elsewhere")
        return None

    def _set_aside(self, step: int) -> None:
        source = self.directory / str(step)
        if jax.process_index() == 0 and source.exists():
            target = self.directory / f"{step}.corrupt"
            if target.exists():
                shutil.rmtree(target)
            source.rename(target)
        self._manager.reload()


def export_student_hf(model: Any, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                      extra_config: dict | None = None) -> Path:
    """Write the student as an HF safetensors directory (config.json + weights [+ tokenizer])."""
    from ctopd_jax.models.weights import export_hf_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    export_hf_checkpoint(model, model.cfg, out, extra_config=extra_config)
    if tokenizer_dir is not None and jax.process_index() == 0:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja", "generation_config.json"):
            src = Path(tokenizer_dir) / name
            if src.is_file() and not (out / name).exists():
                shutil.copy(src, out / name)
    return out
