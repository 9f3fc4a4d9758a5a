"""``MathGrader``: extract → normalise → string/numeric (in process) → sympy (bounded worker).

Verdict methods recorded per sample: "no_answer" (nothing extracted), "fast" (decided by the
string/numeric/structure rules), "symbolic", "timeout" (worker killed at the deadline: counted
wrong), "error" (sympy failed: counted wrong), "too_long" (answers over 400 characters skip
sympy: counted wrong unless the fast rules matched them).
Verdicts are cached per normalised (prediction, reference) pair: with K samples per problem
most predictions repeat.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

from ctopd_jax.grading.equivalence import compare
from ctopd_jax.grading.extract import extract_answer, last_boxed
from ctopd_jax.grading.normalize import normalize_answer
from ctopd_jax.grading.pool import SymbolicPool

_MAX_SYMBOLIC_CHARS = 400
# No real final answer is this long; capping keeps the in-process rules (regexes, list
# matching) bounded on garbage such as a runaway box holding the whole response.
_MAX_ANSWER_CHARS = 2000


@dataclass(frozen=True)
class GradeResult:
    extracted: str | None
    correct: bool
    method: str


def reference_answer(gold: str) -> str:
    """The reference as an answer string: boxed content if the reference carries a box."""
    boxed = last_boxed(gold)
    return boxed if boxed is not None else gold


class MathGrader(contextlib.AbstractContextManager):   # `with MathGrader() as g`: closed on exit
    def __init__(self, timeout_s: float = 5.0, workers: int = 1):
        self.pool = SymbolicPool(workers=workers, timeout_s=timeout_s)
        self._cache: dict[tuple[str, str], tuple[bool, str]] = {}

    def grade_many(self, responses: Sequence[str], golds: Sequence[str],
                   fallbacks: bool | Sequence[bool] = False) -> list[GradeResult]:
        """Grade responses against reference answers; symbolic cases run in parallel."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} reference answers")
        if isinstance(fallbacks, bool):
            fallbacks = [fallbacks] * len(responses)
        extracted = [extract_answer(r, f) for r, f in zip(responses, fallbacks)]
        keys = [self._key(e, g) for e, g in zip(extracted, golds)]
        undecided: list[tuple[str, str]] = []
        for key in keys:
            if key is None or key in self._cache:
                continue
            if max(len(key[0]), len(key[1])) > _MAX_ANSWER_CHARS:
                self._cache[key] = (False, "too_long")
                continue
            verdict = compare(*key)
            if verdict is not None:
                self._cache[key] = (verdict, "fast")
            elif max(len(key[0]), len(key[1])) > _MAX_SYMBOLIC_CHARS:
                self._cache[key] = (False, "too_long")
            elif key not in undecided:
                undecided.append(key)
        for key, outcome in zip(undecided, self.pool.run(undecided)):
            self._cache[key] = (outcome == "equal", "symbolic" if outcome in ("equal", "different") else outcome)
        results = []
        for e, key in zip(extracted, keys):
            if key is None:
                results.append(GradeResult(None, False, "no_answer"))
            else:
                correct, method = self._cache[key]
                shown = e if len(e) <= _MAX_ANSWER_CHARS else e[:200] + "..."
                results.append(GradeResult(shown, correct, method))
        return results

    @staticmethod
    def _key(extracted: str | None, gold: str) -> tuple[str, str] | None:
        """Normalised (prediction, reference), or None when there is no usable prediction."""
        if extracted is None:
            return None
        if len(extracted) > _MAX_ANSWER_CHARS:
            return (extracted, "")  # judged "too_long" without normalising it
        pred = normalize_answer(extracted)
        return (pred, normalize_answer(reference_answer(gold))) if pred else None

    def grade(self, response: str, gold: str, fallbacks: bool = False) -> GradeResult:
        return self.grade_many([response], [gold], fallbacks)[0]

    def equivalent(self, pred: str, gold: str) -> bool:
        """Compare two answer strings directly (no extraction from a response)."""
        return self.grade_many([f"\\boxed{{{pred}}}"], [gold])[0].correct

    def close(self) -> None:
        self.pool.close()

    def __exit__(self, *exc) -> None:
        self.close()
