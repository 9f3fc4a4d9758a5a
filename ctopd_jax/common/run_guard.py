"""Guards of a long run: SIGTERM / SIGINT answered at any moment, and divergence detection.

The training loop uses both at step boundaries:

    with SignalGuard() as stop:
        for step in ...:
            metrics = iteration(step)
            reason = divergence.check(step, metrics)      # DivergenceGuard
            if reason: raise TrainingDiverged(reason + last good checkpoint)
            ... save if due ...
            if stop.requested_everywhere():
                save a checkpoint of `step` (unless just saved), close the logs
                raise Stopped(stop.signum, step, checkpoint_dir)
    # cli.run prints Stopped's (TrainingDiverged's) one line and exits with its exit_code
    # (143 / 130; 3)

A signal before or after the loop is answered too (`install_startup_handlers`, called by the
package itself when it runs as a command, `python -m ctopd_jax.<command>`): while modules
load, the process exits at once with one line (nothing is written yet); once the command runs
(`cli.run`, `raising()`), the signal raises `Interrupted` where the command is, so the `with`
blocks release the locks and stop what was started, and `cli.run` prints one line. The
training loop (and the export and plots after it) runs under `SignalGuard`.

Decisions:
- One signal, one line: the first SIGTERM / SIGINT in the loop only sets a flag (no line of its
  own): the step in flight finishes, is checkpointed, and the process exits with 128 + signal
  (143 for SIGTERM, 130 for SIGINT), as shells and schedulers expect, with the line of
  `Stopped`. A second signal exits at once (`os._exit`, same status, no checkpoint): the way out
  of a step that hangs.
- A signal a library swallowed (an `Interrupted` caught by code that catches everything) is
  still remembered: `SignalGuard` adopts it, so the loop stops at its first step boundary.
- Handlers are only installed from the main thread (Python allows no other); elsewhere the
  guard is inert and `requested` stays False.
- DivergenceGuard rules (config section `guard`): a non-finite loss or gradient norm, or an
  update the optimizer refused (`update_applied` 0), always stops; the gradient norm exactly 0.0
  for `zero_grad_norm_steps` consecutive steps stops (an lr of 1e6 leaves the model saturated
  with zero gradients while every number stays finite); a loss above `loss_jump_factor` x the
  median of the last `loss_jump_window` finite losses stops, once `loss_jump_warmup` of them
  are known and the median is > 0. A flagged step does not enter the history.
"""
from __future__ import annotations

import math
import os
import signal
import statistics
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, Mapping

SIGNAL_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
_STARTUP: dict[str, Any] = {"signum": None, "raising": False, "prog": "ctopd_jax"}


def exit_code_for(signum: int) -> int:
    """128 + the signal number: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


class Interrupted(KeyboardInterrupt):
    """A signal outside the training loop (start-up, evaluation, plotting): `cli.run` prints one
    line and exits with `exit_code` once the `with` blocks have released what they held."""

    def __init__(self, signum: int):
        self.signum, self.exit_code = int(signum), exit_code_for(signum)
        super().__init__(f"stopped by {SIGNAL_NAMES.get(signum, f'signal {signum}')}")


def received() -> int | None:
    """The signal received outside the loop (even one whose Interrupted was swallowed)."""
    return _STARTUP["signum"]


def _startup_handler(signum, frame) -> None:
    name = SIGNAL_NAMES.get(signum, f"signal {signum}")
    if _STARTUP["signum"] is not None or not _STARTUP["raising"]:
        # a second signal, or one while the modules load (nothing written yet): out at once
        print(f"{_STARTUP['prog']}: stopped by {name}" + (
            "" if _STARTUP["signum"] is None else " (second signal: at once)"),
              file=sys.stderr, flush=True)
        os._exit(exit_code_for(signum))
    _STARTUP["signum"] = signum
    raise Interrupted(signum)


def install_startup_handlers(prog: str) -> None:
    """SIGTERM / SIGINT answered in one line from here on (module doc); main thread only."""
    if threading.current_thread() is threading.main_thread():
        _STARTUP["prog"] = prog
        for sig in SIGNAL_NAMES:
            signal.signal(sig, _startup_handler)


class raising:
    """`with raising():` a signal raises Interrupted (the command runs: its `with` blocks
    release what they hold) instead of exiting at once."""

    def __enter__(self) -> None:
        self._before, _STARTUP["raising"] = _STARTUP["raising"], True

    def __exit__(self, *exc) -> None:
        _STARTUP["raising"] = self._before


EXIT_DIVERGED = 3


class TrainingDiverged(RuntimeError):
    """The divergence guard stopped the run (a non-finite loss or gradient, a saturated or
    jumping loss; the flagged update was not applied). cli.run prints `training stopped: ` and
    `str(err)` as one line and exits with `exit_code` (3), from every command that trains."""
    exit_code = EXIT_DIVERGED


class Stopped(Exception):
    """Raised by the loop after it checkpointed the step in flight because a signal asked it to
    stop; cli.run prints `str(err)` as one line and exits with `exit_code`."""

    def __init__(self, signum: int, step: int, checkpoint_dir: str | Path | None = None):
        self.signum, self.step = int(signum), int(step)
        self.exit_code = exit_code_for(signum)
        where = f" in {checkpoint_dir}" if checkpoint_dir else ""
        super().__init__(f"stopped by {SIGNAL_NAMES.get(signum, f'signal {signum}')} after step "
                         f"{step}; checkpoint of step {step} saved{where}; continue with --resume")


class SignalGuard:
    """Context manager: SIGTERM / SIGINT set `requested` (checked at step boundaries); a second
    signal calls `hard_exit(128 + signum)` (default `os._exit`)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
                 hard_exit: Callable[[int], Any] = os._exit, stream=None):
        self.signals = tuple(signals)
        self.hard_exit = hard_exit
        self.stream = stream
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else exit_code_for(self.signum)

    def requested_everywhere(self) -> bool:
        """`requested`, agreed over all JAX processes: a scheduler may signal only some hosts,
        and every process must stop at the same step or the next collective hangs. Call it at
        the step boundary on every process (it is a collective when there are several)."""
        jax = sys.modules.get("jax")
        if jax is None or jax.process_count() == 1:
            return self.requested
        # start-up time: this module installs the signal handlers before jax loads (the
        # package's first instruction), so jax and numpy come in only here
        import numpy as np
        from jax.experimental import multihost_utils  # (as above)

        flags = multihost_utils.process_allgather(np.asarray([int(self.requested)], np.int32))
        agreed = bool(np.asarray(flags).any())
        if agreed and self.signum is None:
            self.signum = signal.SIGTERM     # another host was signalled: exit as it will
        return agreed

    def _say(self, message: str) -> None:
        stream = self.stream or sys.stderr
        print(message, file=stream, flush=True)

    def _handle(self, signum, frame) -> None:
        if self.signum is None:   # no line of its own: Stopped's line says what happened
            self.signum = signum
            return
        self._say(f"second {SIGNAL_NAMES.get(signum, f'signal {signum}')}: exiting now "
                  "without a checkpoint")
        self.hard_exit(exit_code_for(signum))

    def __enter__(self) -> "SignalGuard":
        self.signum = self.signum or received()   # one a library swallowed before the loop
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def _fmt(value: Any) -> str:
    try:
        return f"{float(value):.6g}"
    except (TypeError, ValueError):
        return repr(value)


class DivergenceGuard:
    """Fed each step's metrics (`loss`, `grad_norm`, optional `update_applied`); `check` returns
    None, or one line naming the step, the rule and the values that tripped it."""

    def __init__(self, zero_grad_norm_steps: int = 3, loss_jump_factor: float = 10.0,
                 loss_jump_window: int = 20, loss_jump_warmup: int = 5):
        self.zero_grad_norm_steps = int(zero_grad_norm_steps)
        self.loss_jump_factor = float(loss_jump_factor)
        self.loss_jump_warmup = int(loss_jump_warmup)
        self.losses: deque[float] = deque(maxlen=int(loss_jump_window))
        self.zero_steps: list[int] = []

    @classmethod
    def from_config(cls, section) -> "DivergenceGuard":
        """From `config.guard` (a GuardSection)."""
        return cls(section.zero_grad_norm_steps, section.loss_jump_factor,
                   section.loss_jump_window, section.loss_jump_warmup)

    # the history survives a resume through the checkpoint meta
    def state(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "zero_steps": list(self.zero_steps)}

    def restore(self, state: Mapping[str, Any] | None) -> None:
        if state:
            self.losses.clear()
            self.losses.extend(float(x) for x in state.get("losses", ()))
            self.zero_steps = [int(s) for s in state.get("zero_steps", ())]

    def check(self, step: int, metrics: Mapping[str, Any]) -> str | None:
        loss, grad_norm = metrics.get("loss"), metrics.get("grad_norm")
        values = f"loss {_fmt(loss)}, grad norm {_fmt(grad_norm)}"
        bad = [k for k in ("loss", "grad_norm", "kd_loss", "ce_loss")
               if k in metrics and not _finite(metrics[k])]
        if bad:
            return (f"step {step}: {' and '.join(bad)} not finite ({values}); the update was not "
                    "applied. Lower optimizer.lr or inspect the data of this step")
        if "update_applied" in metrics and not metrics["update_applied"]:
            return (f"step {step}: the optimizer refused the update (non-finite gradient inside "
                    f"the step; {values}). Lower optimizer.lr or inspect the data of this step")
        if self.zero_grad_norm_steps and grad_norm is not None:
            if float(grad_norm) == 0.0:
                self.zero_steps.append(step)
                if len(self.zero_steps) >= self.zero_grad_norm_steps:
                    first = self.zero_steps[-self.zero_grad_norm_steps]
                    return (f"step {step}: gradient norm 0.0 for {self.zero_grad_norm_steps} steps "
                            f"in a row (steps {first}-{step}; {values}); the model no longer "
                            "learns (saturated by a too large optimizer.lr?). Set "
                            "guard.zero_grad_norm_steps=0 to allow it")
            else:
                self.zero_steps = []
        if loss is not None:
            loss = float(loss)
            if self.loss_jump_factor and len(self.losses) >= self.loss_jump_warmup:
                median = statistics.median(self.losses)
                if median > 0 and loss > self.loss_jump_factor * median:
                    return (f"step {step}: loss {_fmt(loss)} is {loss / median:.3g}x the median "
                            f"{_fmt(median)} of the last {len(self.losses)} steps (limit "
                            f"guard.loss_jump_factor={self.loss_jump_factor:g}; {values}). Lower "
                            "optimizer.lr, or raise / zero guard.loss_jump_factor")
            self.losses.append(loss)
        return None


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
