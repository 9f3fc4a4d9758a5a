"""Training checkpoints (Orbax) and HF export of the student.

One checkpoint per saved step holds two items:
- `state`: every array of the training state (student params, optimizer state, RNG key data),
  saved as a flat dict `leaf_00000 ...` in the order of `jax.tree.leaves`. Flat keys make the
  file independent of pytree node types (nnx.State, optax namedtuples) and of how Orbax would
  spell their paths; the tree structure comes from the live trainer at restore time and is
  checked against the key paths recorded in `meta`.
- `meta` (JSON): step, data-iterator state, config, the key paths of the leaves, the objective's
  own state (e.g. MP-OPD's noise EMA), the divergence guard's history and any extra scalars
  (e.g. the cumulative coverage counters needed so logged metrics continue exactly).

Integrity: every array leaf of every state item (params, optimizer state, RNG) has an exact
checksum in `meta` (its bits as unsigned words, summed plain and position-weighted modulo 2**32:
any changed word changes the plain sum; sharding cannot change the result, integer addition is
exact), and `meta` carries a SHA-256 of its own other fields (data position, objective and guard
state...). A step that is listed but cannot be read, or whose checksums disagree, is reported
with a warning naming the step and the item, moved aside to `<step>.corrupt` (never over an
earlier one), and the previous step is used. A step whose arrays have other shapes or dtypes
than the run's (a checkpoint of another model pair or LoRA rank) is no damaged one: the restore
is refused with one CheckpointError and every step is left as it was.

Saving is asynchronous (Orbax writes in the background; the next save or `close()` waits).
Orbax commits a step by renaming its temporary directory, so an interrupted write never shows
up as a step. A write that fails for lack of space (or a read-only / forbidden folder) raises
one `CheckpointWriteError` naming the folder and the last whole step; the half-written
temporary folder is removed and Orbax's per-thread tracebacks are kept off the terminal.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ctopd_jax.common.kill_points import kill_point
from ctopd_jax.common.run_dir import DISK_ERRNOS, disk_errno

log = logging.getLogger(__name__)


def checkpoint_steps(directory: Path) -> list[int]:
    """Committed Orbax steps (integer-named directories; temporary ones carry a suffix)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def checkpoint_metas(directory: Path) -> list[tuple[int, dict | None]]:
    """(step, meta dict or None when unreadable) for every committed step, oldest first."""
    out = []
    for step in checkpoint_steps(directory):
        try:
            meta = json.loads((directory / str(step) / "meta" / "metadata").read_text())
            out.append((step, meta if isinstance(meta, dict) else None))
        except (OSError, ValueError):
            out.append((step, None))
    return out


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the current run."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (no space, read-only or forbidden folder); the message
    names the folder, the step and the last whole checkpoint."""


def _quiet_closed_loop_callbacks() -> None:
    """After an aborted write or a failed restore, tensorstore's callbacks of the abandoned
    operations land on Orbax's closed asyncio loop and Python prints each as an ignored
    `RuntimeError: Event loop is closed` with a traceback, from background threads while the
    run goes on and at exit, around the one line that reports the failure. They carry no
    information; this hook (installed once, by the first Checkpointer) drops exactly those, and
    the write's own error where it arrives without a traceback (`_bare_write_error`);
    every other unraisable exception reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "ctopd_quiet", False):
        return

    def hook(unraisable):
        value = unraisable.exc_value
        closed_loop = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
        if not (closed_loop or _bare_write_error(value, repr(unraisable.object))):
            previous(unraisable)
    hook.ctopd_quiet = True
    sys.unraisablehook = hook


class _QuietOrbaxThreads(logging.Filter):
    """Drop the ERROR records (with tracebacks) that Orbax's background threads log for one
    failed write, one per thread, and asyncio's "Task exception was never retrieved" for its
    sibling write tasks (one fragment's failure ends the gather; the others' exceptions are
    logged whenever their tasks are collected, at exit too): the failure reaches the caller as
    one exception, which the command reports in one line (--debug still raises it). An
    exception tensorstore set without a traceback is known by its text instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if "orbax" in record.pathname or _bare_write_error(exc, record.getMessage()):
            return False
        tb = getattr(exc, "__traceback__", None)
        while tb is not None:
            if "orbax" in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


def _bare_write_error(exc: BaseException | None, context: str) -> bool:
    """`exc` without a traceback (as tensorstore sets its write errors) whose text or `context`
    (the task or record that carried it) names a checkpoint's writers."""
    text = f"{context} {exc}".lower()
    bare = exc is not None and exc.__traceback__ is None
    return bare and any(name in text for name in ("orbax", "tensorstore", "ocdbt"))


def _quiet_orbax_write_tasks() -> None:
    """Installed once, for the process's life: the tasks' records come when they are collected."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietOrbaxThreads) for f in asyncio_log.filters):
        asyncio_log.addFilter(_QuietOrbaxThreads())


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
    """Per-leaf float32 sums: what checkpoints written before the exact checksums carry
    (`params_fingerprint`), still verified when such a step is restored."""
    sums = _leaf_sums(jax.tree.leaves(tree))
    return [float(np.asarray(s.addressable_data(0) if isinstance(s, jax.Array) else s)) for s in sums]


_WORD = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@jax.jit
def _leaf_checksum(x):
    """[plain, position-weighted] sums of one leaf's words. One program per leaf shape and dtype,
    not one over the whole tree: a model's leaves share a handful of shapes, and the program of
    a whole tree (hundreds of leaves) took seconds to compile at a run's first checkpoint."""
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    words = jax.lax.bitcast_convert_type(x, _WORD[x.dtype.itemsize]).astype(jnp.uint32).reshape(-1)
    weights = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


def checksums(tree: Any) -> list[list[int]]:
    """Per leaf [plain, position-weighted] sums of its bits as uint32 words, modulo 2**32: exact
    (any changed word changes the plain sum) and the same for any sharding (module doc).

    One leaf at a time, each fetched before the next is dispatched: with several processes a
    leaf's sums are a collective, and collectives must run in the same order in every process;
    leaf programs dispatched back to back ran concurrently on the CPU runtime and deadlocked
    two processes at their first checkpoint."""
    def fetched(s):
        return [int(v) for v in np.asarray(s.addressable_data(0) if isinstance(s, jax.Array) else s)]

    return [fetched(_leaf_checksum(jnp.asarray(x))) for x in jax.tree.leaves(tree)]


def meta_checksum(meta: dict[str, Any]) -> str:
    """SHA-256 of the meta's JSON without its own checksum field (keys sorted)."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


ITEM_NAMES = {"params": "parameters", "opt_state": "optimizer state", "rng": "RNG state"}


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
        self._pending: int | None = None      # the step whose asynchronous write is in flight
        self._quiet = _QuietOrbaxThreads()
        _quiet_closed_loop_callbacks()
        _quiet_orbax_write_tasks()
        logging.getLogger("absl").addFilter(self._quiet)
        # left by a process killed in the middle of a save; the Checkpointer is the folder's one
        # writer (the trainer, under the run lock), so no write of another is in flight
        self._remove_partial_writes()

    # ------------------------------------------------------------------ save
    def should_save(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def save(self, step: int, state: Any, meta: dict[str, Any], params_key: str = "params") -> None:
        """`state` is a dict of pytrees (params, opt_state, rng); each item's leaves get exact
        checksums, and the meta its own (module doc). A refused write of this step or of the
        one still in flight raises CheckpointWriteError."""
        leaves = jax.tree.leaves(state)
        arrays = {_leaf_key(i): leaf for i, leaf in enumerate(leaves)}
        full_meta = json.loads(json.dumps(dict(
            meta, step=int(step), leaf_paths=tree_paths(state),
            checksums={key: checksums(item) for key, item in state.items()})))
        full_meta["meta_sha256"] = meta_checksum(full_meta)
        self.wait()                  # a failure of the write in flight names its own step
        self._pending = int(step)
        with self._write_errors():
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(full_meta)), force=True)
        kill_point("checkpoint_write")   # the asynchronous write in flight

    def wait(self) -> None:
        with self._write_errors():
            self._manager.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()
            logging.getLogger("absl").removeFilter(self._quiet)

    @contextlib.contextmanager
    def _write_errors(self):
        """A refused write becomes one CheckpointWriteError, the half-written folder of the
        failed step is removed, and the newest whole step is named."""
        try:
            yield
        except Exception as err:
            code = disk_errno(err)
            if code is None:
                raise
            failed, self._pending = self._pending, None
            self._remove_partial_writes()
            whole = self.steps()
            raise CheckpointWriteError(
                f"checkpoint.dir {self.directory}: {DISK_ERRNOS[code]} ({errno.errorcode[code]}) "
                f"while writing the checkpoint{f' of step {failed}' if failed is not None else ''}; "
                f"the last whole checkpoint is {f'step {whole[-1]}' if whole else 'none'}. Free "
                "space or point checkpoint.dir at a writable disk, then continue with --resume") \
                from err

    def _remove_partial_writes(self) -> None:
        """Orbax's temporary step folders (`<step>.orbax-checkpoint-tmp*`): never committed,
        never resumable, only in the way of the space a later save needs."""
        if jax.process_index() != 0 or not self.directory.is_dir():
            return
        for path in self.directory.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(path, ignore_errors=True)

    def newest_whole(self) -> str:
        """"step N" for the newest committed checkpoint once writes in flight have finished (a
        step still being written, or one whose write failed, is no last good checkpoint), or
        "none"."""
        self.wait()
        steps = self.steps()
        return f"step {steps[-1]}" if steps else "none"

    # ------------------------------------------------------------------ restore
    def steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def _restore_step(self, step: int, template: Any, params_key: str) -> Restored:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        paths = tree_paths(template)
        if meta.get("leaf_paths") != paths:
            saved = meta.get("leaf_paths") or []
            raise self._not_this_run(step, f"it holds {len(saved)} arrays with other names than "
                                           f"this run's {len(paths)}")
        leaves = jax.tree.leaves(template)
        self._check_fits(step, leaves, paths)
        abstract = {_leaf_key(i): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
                    for i, x in enumerate(leaves)}
        arrays = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract))).state
        restored = jax.tree.unflatten(jax.tree.structure(template),
                                      [arrays[_leaf_key(i)] for i in range(len(leaves))])
        self._verify(step, restored, meta, params_key)
        return Restored(step=step, state=restored, meta=meta)

    def _check_fits(self, step: int, leaves: list, paths: list[str]) -> None:
        """CheckpointError when the arrays of `step` have other shapes or dtypes than this run's
        (another model pair, another lora.rank): a checkpoint of another run is no damaged one,
        and is left as it is. Orbax's own array metadata says it, without reading the arrays."""
        try:
            saved = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
        except Exception:   # unreadable metadata is damage: restore_latest's fallback reports it
            return
        spell = lambda x: f"{np.dtype(x.dtype).name}{list(x.shape)}"   # dtype[shape]
        for i, (leaf, path) in enumerate(zip(leaves, paths)):
            got = saved.get(_leaf_key(i))
            if got is not None and spell(got) != spell(leaf):
                raise self._not_this_run(step, f"{path} is {spell(got)} there, {spell(leaf)} in "
                                               "this run")

    def _not_this_run(self, step: int, detail: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint step {step} in {self.directory} was written for another model ({detail}: "
            "another model pair, lora.rank, optimizer or dtype?); it is left as it is: resume "
            "with the config it was written with, or train in another output_dir")

    @staticmethod
    def _verify(step: int, restored: dict[str, Any], meta: dict[str, Any], params_key: str) -> None:
        """Every item against its checksums, the meta against its own; ValueError naming the
        item (restore_latest then falls back to the previous step)."""
        if "checksums" not in meta:   # written before the exact checksums: parameters only
            got, want = fingerprint(restored[params_key]), meta["params_fingerprint"]
            if not all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(got, want)):
                raise ValueError(f"fingerprint mismatch in the parameters of step {step}")
            return
        if meta.get("meta_sha256") != meta_checksum(meta):
            raise ValueError(f"checksum mismatch in the meta of step {step} (data position, "
                             "objective and guard state)")
        for key, item in restored.items():
            got, want = checksums(item), meta["checksums"].get(key)
            if got != want:
                bad = next((i for i, (a, b) in enumerate(zip(got, want or [])) if a != b), 0)
                path = tree_paths(item)[bad] if got else ""
                raise ValueError(f"checksum mismatch in the {ITEM_NAMES.get(key, key)} of step "
                                 f"{step} (first at {key}{path})")

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
            target, n = self.directory / f"{step}.corrupt", 1
            while target.exists():   # an earlier one is kept: nothing set aside is deleted
                n += 1
                target = self.directory / f"{step}.corrupt-{n}"
            source.rename(target)
        self._manager.reload()
