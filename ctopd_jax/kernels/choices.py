"""`implementation: auto`: the path each kernel takes on this device, from a table of measured
choices kept in the kernel's folder (`<kernel>/measured.json`).

Each table lists rows {"backend", "device_kind", "choice", ...}; the first row whose backend
equals jax.default_backend() and whose device_kind is "*" or equals the first device's
`device_kind` ("NVIDIA H200", ...) gives the choice. Measured rows carry their figures (ms per
call at a shape) and where they were taken, so a new measurement is one more row; unmeasured
devices fall to the "*" row of their backend, which says why it was chosen.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jax

KERNELS = ("strict_full", "strict_topk")


@functools.lru_cache(maxsize=None)
def table(kernel: str) -> tuple[dict, ...]:
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} has no table of measured choices; one of {KERNELS}")
    return tuple(json.loads((Path(__file__).parent / kernel / "measured.json").read_text())["choices"])


def choose(kernel: str, backend: str | None = None, device_kind: str | None = None) -> str:
    """The implementation ("pallas" or "xla") `auto` means for `kernel` on this device."""
    backend = backend or jax.default_backend()
    device_kind = device_kind if device_kind is not None else jax.devices()[0].device_kind
    for row in table(kernel):
        if row["backend"] == backend and row["device_kind"] in ("*", device_kind):
            return row["choice"]
    return "xla"   # a backend the table does not list: the portable path
