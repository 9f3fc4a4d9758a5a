"""What a failed checkpoint write leaves behind stays off stderr, and nothing else is hidden.

A full disk once printed `ValueError: RESOURCE_EXHAUSTED: Error writing ... in OCDBT database`
after the run's one-line error: an exception tensorstore set on an Orbax write task without a
traceback, logged by asyncio when the task was collected."""
from __future__ import annotations

import logging
import sys
import types

from ctopd_jax.loop import checkpoint

WRITE_ERROR = ValueError('RESOURCE_EXHAUSTED: Error writing "leaf_00057/2.0.0" in OCDBT database at '
                         'local file "/ck/4.orbax-checkpoint-tmp/": No space left on device')


def never_retrieved(exc: BaseException, coro: str) -> logging.LogRecord:
    """The record asyncio's default handler logs for a task whose exception nobody read."""
    message = f"Task exception was never retrieved\nfuture: <Task finished name='Task-9' coro=<{coro}> " \
              f"exception={exc!r}>"
    return logging.LogRecord("asyncio", logging.ERROR, "/usr/lib/python3.11/asyncio/base_events.py", 1,
                             message, None, (type(exc), exc, exc.__traceback__))


def test_a_write_tasks_error_without_a_traceback_is_dropped_and_others_are_kept():
    quiet = checkpoint._QuietOrbaxThreads()
    assert not quiet.filter(never_retrieved(WRITE_ERROR, "_write() done, defined at /x/tensorstore_utils.py:5"))
    assert not quiet.filter(never_retrieved(WRITE_ERROR, "run() done, defined at /x/app.py:5"))   # its text
    other = ValueError("the served teacher answered 500")
    assert quiet.filter(never_retrieved(other, "score() done, defined at /x/client.py:5"))


def test_the_unraisable_hook_drops_the_bare_write_error_and_passes_the_rest(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    checkpoint._quiet_closed_loop_callbacks()
    unraisable = lambda exc: types.SimpleNamespace(exc_value=exc, object="<Task>")   # noqa: E731
    sys.unraisablehook(unraisable(WRITE_ERROR))
    sys.unraisablehook(unraisable(RuntimeError("Event loop is closed")))
    other = ValueError("a bug elsewhere")
    sys.unraisablehook(unraisable(other))
    assert seen == [other]
