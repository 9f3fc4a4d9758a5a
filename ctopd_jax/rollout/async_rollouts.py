"""An iteration's rollouts, collected now or in the background (`rollout.async_rollouts`).

    rollouts = Rollouts(draw, collect, rollout, steps)
    collected, drawn, metrics = rollouts.take(index, timer)   # iteration `index`'s host batches
    ... train on them ...
    rollouts.before_push(timer)   # a weight push never lands while a generation is in flight
    engine.update_weights(student)
    rollouts.after_push(index)
    rollouts.close()              # waits for a collection in flight (the run's end or failure)

`draw(index)` takes iteration `index`'s prompts and sampling seed (it advances the data stream
and the RNG); `collect(drawn, timer)` renders, generates, re-tokenizes, aligns and scores them
(teacher_batches.collect).

Without async, `take` draws and collects there and then: the synchronous loop. With async the
next iteration's collection runs in one background thread beside training (the served engine's
requests and the host's decoding, alignment and served-teacher scoring: host work and a server's
work, not the trainer's device), started
- `async_staleness: 1`: when iteration k takes its batch, so iteration k+1's responses come from
  the weights that iteration k starts with (the push after k's update serves k+2): one update
  stale, corrected per objective (rollout/staleness.py);
- `async_staleness: 0`: right after the push, so it overlaps only the end of the iteration
  (metrics, evaluation, checkpoint): the synchronous run's numbers, a smaller saving.
`rollout_staleness` (0/1) is logged per iteration, and `time_rollout_wait` the time the loop
waited for a background collection. A draw made ahead is not part of a checkpoint (`ahead()`
gives the RNG and data state from before it): a resumed run draws that iteration again and
generates it from the restored weights (staleness 0 for that one iteration).
"""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any, Callable

from ctopd_jax.common.metrics import StepTimer


@dataclass(frozen=True)
class Drawn:
    """What iteration `index` samples: its prompts, sampling seed, LoRA dropout key, and the
    (rng, data state) from before the draw (where a resume starts if the draw was made ahead)."""
    index: int
    prompts: list
    seed: int
    dropout_key: Any
    before: tuple


class Rollouts:
    def __init__(self, draw: Callable[[int], Drawn], collect: Callable[[Drawn, Any], dict],
                 rollout, steps: int):
        self.draw, self.collect, self.steps = draw, collect, steps
        self.staleness = rollout.async_staleness if rollout.async_rollouts else None
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")
                      if self.staleness is not None else None)
        self._next: tuple[Drawn, concurrent.futures.Future] | None = None

    def ahead(self) -> Drawn | None:
        """The draw made ahead for the next iteration, if any."""
        return self._next[0] if self._next is not None else None

    def _start(self, index: int) -> None:
        if index >= self.steps:   # no iteration will take it
            return
        drawn = self.draw(index)

        def collect():   # its phases on a timer of its own: the loop's measures the loop
            began = time.perf_counter()
            return self.collect(drawn, StepTimer()), time.perf_counter() - began

        self._next = drawn, self._pool.submit(collect)

    def _wait(self, timer) -> tuple[Drawn, dict, float]:
        drawn, future = self._next
        with timer("rollout_wait"):
            collected, seconds = future.result()
        return drawn, collected, seconds

    def take(self, index: int, timer) -> tuple[dict, Drawn, dict[str, float]]:
        """(name -> host batch, its draw, metrics) of iteration `index`."""
        if self._next is not None and self._next[0].index == index:
            drawn, collected, seconds = self._wait(timer)
            self._next, stale = None, self.staleness
            metrics = {"rollout_background_s": seconds}
        else:   # the synchronous loop, or the first iteration (of a run or a resume)
            drawn = self.draw(index)
            collected, stale, metrics = self.collect(drawn, timer), 0, {}
        if self.staleness == 1:
            self._start(index + 1)
        if self.staleness is not None:
            metrics["rollout_staleness"] = float(stale)
        return collected, drawn, metrics

    def before_push(self, timer) -> None:
        """Staleness 1: the collection in flight ends before the weights change under it."""
        if self._next is not None:
            drawn, collected, seconds = self._wait(timer)
            future = concurrent.futures.Future()
            future.set_result((collected, seconds))
            self._next = drawn, future

    def after_push(self, index: int) -> None:
        """Staleness 0: iteration index + 1's collection starts from the pushed weights."""
        if self.staleness == 0:
            self._start(index + 1)

    def close(self) -> None:
        """Wait for a collection in flight (its error, if any, is the run's no longer)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
