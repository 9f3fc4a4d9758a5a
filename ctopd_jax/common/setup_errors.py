"""The errors of setting a run up, before training: a leaf, so the checks, the objective factory
and the builders (any layer) raise the same classes."""
from __future__ import annotations


class TrainerSetupError(ValueError):
    """A model, tokenizer or data setting that cannot be used (raised before training)."""


class PreflightError(TrainerSetupError):
    """A run that cannot start; the message names the field or file and the fix."""


def fail(message: str) -> PreflightError:
    """A PreflightError of `message` on one line (its line breaks and runs of spaces joined)."""
    return PreflightError(" ".join(message.split()))
