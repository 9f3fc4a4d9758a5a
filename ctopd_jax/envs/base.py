"""The environment protocol for multi-turn rollouts (tool use, text games) and `run_step`.

An episode: `obs0 = env.reset(prompt)`, then per assistant turn `result = run_step(env, text,
timeout_s)`; the trainer appends `result.observation` to the context (masked out of every loss)
and keeps generating until `result.done` or its turn cap. The episode reward is the sum of the
step rewards. An environment object holds one episode at a time and is reused across episodes
(`reset` clears all of its state), so a batch of concurrent episodes needs one object each.

`run_step` is the only way the trainer calls `step`: it never raises and never waits longer than
`timeout_s`, so a broken or stuck environment ends its episode (done, reward 0) with a readable
observation instead of killing or hanging the run.
"""
from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ctopd_jax.data.prompts import Prompt

# Longest observation that `run_step` builds from an exception (one line).
_ERROR_CHARS = 200


class EnvConfigError(ValueError):
    """A bad environment name, setting or task reference; the message names the field and fix."""


@dataclass(frozen=True)
class StepResult:
    observation: str  # text appended to the context after the assistant turn ("" = nothing)
    reward: float     # reward of this step (the episode's reward is the sum)
    done: bool


@runtime_checkable
class Environment(Protocol):
    name: str
    # Text that ends a tool-calling assistant turn ("</calc>"); None: turns end at the EOS only.
    tool_stop: str | None

    def reset(self, prompt: Prompt) -> str:
        """Start an episode for `prompt` (clearing all state); the initial observation or ""."""
        ...

    def step(self, text: str) -> StepResult:
        """Answer one assistant turn (its decoded text, no special tokens)."""
        ...


def _error_result(message: str) -> StepResult:
    line = " ".join(message.split())  # one line: newlines and runs of spaces become one space
    return StepResult(line[:_ERROR_CHARS], 0.0, True)


def _describe(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails still gets reported
        return "(the exception's message could not be read)"


def run_step(env: Environment, text: str, timeout_s: float) -> StepResult:
    """`env.step(text)` in a worker thread, cut at `timeout_s` seconds; never raises.

    A timeout or any exception (also a non-StepResult return) ends the episode: done True,
    reward 0, the observation says what happened. Python cannot kill a thread, so a step that
    overruns keeps running in the background; the worker is a daemon thread (rather than a
    ThreadPoolExecutor worker, which the interpreter joins at exit) so such a step can never
    keep the process alive. The caller must not reuse that env object while it may still run
    (the built-in environments are bounded by construction and never overrun).
    """
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work():
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(env.step(text))
        except BaseException as e:  # noqa: BLE001 - reported as the step's observation
            future.set_exception(e)

    try:
        threading.Thread(target=work, name="env-step", daemon=True).start()
    except RuntimeError as e:  # no thread could be started (resource limits)
        return _error_result(f"error: {type(e).__name__}: {e}")
    # wait() rather than result(timeout): a TimeoutError raised by env.step itself must not
    # read as the environment not answering.
    if not concurrent.futures.wait([future], timeout=timeout_s).done:
        return _error_result(f"error: the environment did not answer within {timeout_s}s")
    error = future.exception()
    if error is not None:
        return _error_result(f"error: {type(error).__name__}: {_describe(error)}")
    result = future.result()
    if not isinstance(result, StepResult):
        return _error_result(f"error: TypeError: {type(env).__name__}.step returned "
                             f"{type(result).__name__}, not StepResult")
    return result
