"""How a teacher's failure names its entry (the checks' error itself is setup_errors.py's)."""
from __future__ import annotations

import contextlib

from ctopd_jax.common.setup_errors import PreflightError, fail
from ctopd_jax.config import TrainConfig


@contextlib.contextmanager
def as_teacher(config: TrainConfig, name: str):
    """With `teachers:`, a failure of one teacher's checks names its entry."""
    try:
        yield
    except PreflightError as err:
        if not config.teachers:
            raise
        raise fail(f"teachers[{name}] (as model.teacher / teacher:): {err}") from None
