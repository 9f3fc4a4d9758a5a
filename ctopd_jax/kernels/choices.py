"""`implementation: auto`: the path each kernel takes on this device, and the kernel's tuned
sizes, from the table kept in the kernel's folder (`<kernel>/measured.json`).

`sizes` holds the tile sizes the kernel's Pallas code uses, each with why it is that size.

Its `choices` list rows {"backend", "device_kind", "choice", ...}; the first row whose backend
equals jax.default_backend() and whose device_kind is "*" or equals the first device's
`device_kind` ("NVIDIA H200", ...) gives the choice. Measured rows carry their figures (ms per
call at a shape) and where they were taken, so a new measurement is one more row; unmeasured
devices fall to the "*" row of their backend, which says why it was chosen.

The GPU check's strict_kernels stage (scripts/gpu_check.py) times pallas against xla and puts
the row it measured (`measured_row`) in its result; on the machine that fetched the result,

    python -m ctopd_jax.kernels gpu_check_out/strict_kernels.json

writes those rows into the tables (`record`: it replaces the row of the same backend and
device kind, or goes before that backend's "*" row).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax

KERNELS = ("strict_full", "strict_topk", "token_rows", "full_rows", "paged_attention")
# A Pallas kernel is chosen only where it computed what XLA did (relative error of the loss
# value and of the gradient, float32) and ran faster.
AGREEMENT = 1e-4


def _path(kernel: str, root: Path | None = None) -> Path:
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} has no table (measured.json); one of {KERNELS}")
    return (root or Path(__file__).parent) / kernel / "measured.json"


@functools.lru_cache(maxsize=None)
def _document(kernel: str) -> dict:
    return json.loads(_path(kernel).read_text())


def table(kernel: str) -> tuple[dict, ...]:
    """The kernel's rows of measured (or reasoned) choices, in the order `choose` reads them."""
    return tuple(_document(kernel)["choices"])


def sizes(kernel: str) -> dict:
    """The kernel's tuned sizes (block_rows, block_cols, ...) and why they are what they are."""
    return dict(_document(kernel)["sizes"])


def choose(kernel: str, backend: str | None = None, device_kind: str | None = None) -> str:
    """The implementation ("pallas" or "xla") `auto` means for `kernel` on this device."""
    backend = backend or jax.default_backend()
    device_kind = device_kind if device_kind is not None else jax.devices()[0].device_kind
    for row in table(kernel):
        if row["backend"] == backend and row["device_kind"] in ("*", device_kind):
            return row["choice"]
    return "xla"   # a backend the table does not list: the portable path


def measured_row(*, backend: str, device_kind: str, pallas_s: float, xla_s: float,
                 value_error: float, grad_error: float, measured: str, **shape) -> dict:
    """A table row from one timing of both paths: pallas where it agrees and is faster."""
    agrees = value_error <= AGREEMENT and grad_error <= AGREEMENT
    choice = "pallas" if agrees and pallas_s < xla_s else "xla"
    return {"backend": backend, "device_kind": device_kind, "choice": choice, **shape,
            "pallas_ms": round(pallas_s * 1e3, 2), "xla_ms": round(xla_s * 1e3, 2),
            "value_error": value_error, "grad_error": grad_error, "measured": measured}


def record(kernel: str, row: dict, root: Path | None = None) -> None:
    """Write `row` into the kernel's table (see the module docstring)."""
    path = _path(kernel, root)
    doc = json.loads(path.read_text())
    rows = [r for r in doc["choices"]
            if (r["backend"], r["device_kind"]) != (row["backend"], row["device_kind"])]
    at = next((i for i, r in enumerate(rows)
               if r["backend"] == row["backend"] and r["device_kind"] == "*"), len(rows))
    doc["choices"] = rows[:at] + [row] + rows[at:]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    _document.cache_clear()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ctopd_jax.kernels",
        description="write the rows a GPU check measured into the kernels' tables")
    parser.add_argument("result", help="the strict_kernels stage's JSON (gpu_check_out/)")
    args = parser.parse_args(argv)
    try:
        result = json.loads(Path(args.result).read_text())
        rows = result["results"]["table"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"choices: {args.result}: not a strict_kernels result with a 'table' "
              f"({type(err).__name__}); pass gpu_check_out/strict_kernels.json", file=sys.stderr)
        return 2
    if result.get("dry_run") or result.get("platform") != "gpu":
        print(f"choices: {args.result} is a dry run (interpret mode on the CPU), not a GPU "
              f"measurement: nothing written", file=sys.stderr)
        return 2
    for kernel, row in rows.items():
        record(kernel, row)
        print(f"{kernel}: {row['device_kind']} -> {row['choice']} "
              f"(pallas {row['pallas_ms']} ms, xla {row['xla_ms']} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
