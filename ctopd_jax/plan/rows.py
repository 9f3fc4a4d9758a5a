"""A plan (plan.py): its rows (item, bytes, the note and the setting that changes it), the
totals against the device, and the table it prints."""
from __future__ import annotations

import dataclasses

from ctopd_jax.plan.model import GB, Device


@dataclasses.dataclass
class Row:
    item: str
    bytes: float
    note: str
    setting: str
    in_pool: bool = True   # inside the XLA pool (False: the rollout engine's own share)
    rollout_only: bool = False   # live during the rollout only (the sampler's pool and copy)


PERSISTENT = ("student parameters", "optimizer state", "teacher weights", "LoRA adapters")


def live_during_rollout(rows) -> float:
    """Bytes live while the JAX sampler runs: the persistent state and the rollout's rows
    (gradients and activations are not live then)."""
    return sum(row.bytes for row in rows if row.rollout_only or row.item.startswith(PERSISTENT))


@dataclasses.dataclass
class Plan:
    device: Device
    gpus: int
    mesh: dict
    pool_fraction: float
    rows: list
    transient: str         # which transient item set the peak
    verdict: str
    fits: bool
    notes: list
    time: dict
    saved: Row | None = None   # what a served teacher takes off each device (not in the total)

    @property
    def budget(self) -> float:
        return self.device.memory_gb * GB

    @property
    def pool(self) -> float:
        return self.pool_fraction * self.budget


# ----------------------------------------------------------------------------- output
def format_plan(plan: Plan, title: str = "") -> str:
    d = plan.device
    mesh = ",".join(f"{k}={v}" for k, v in plan.mesh.items())
    lines = []
    if title:
        lines.append(title)
    lines.append(f"device {d.name} ({d.memory_gb:g} GB) x {plan.gpus}, mesh {mesh}; XLA pool "
                 f"{plan.pool_fraction:g} x {d.memory_gb:g} GB = {plan.pool / GB:.1f} GB "
                 f"(export XLA_PYTHON_CLIENT_MEM_FRACTION={plan.pool_fraction:g})")
    lines.append("")
    lines.append(f"| {'item (per device)':<40} | {'GB':>7} | {'running':>7} | note |")
    lines.append(f"|{'-' * 42}|{'-' * 9}|{'-' * 9}|------|")
    total = 0.0
    for row in plan.rows:
        total += row.bytes
        lines.append(f"| {row.item:<40} | {row.bytes / GB:7.2f} | {total / GB:7.2f} | {row.note} |")
    lines.append(f"| {'total':<40} | {total / GB:7.2f} | {'':>7} | budget {d.memory_gb:g} GB |")
    if plan.saved is not None:
        lines.append(f"| {plan.saved.item:<40} | {plan.saved.bytes / GB:7.2f} | {'':>7} | "
                     f"{plan.saved.note} |")
    lines.append("")
    for note in plan.notes:
        lines.append(f"- {note}")
    t = plan.time
    parts = ", ".join(f"{k} {v:.0f} s ({t['flops'][k]:.2e} FLOP)" for k, v in t["seconds"].items())
    lines.append(f"- time per iteration ~{t['total_s']:.0f} s: {parts}")
    lines.append(f"- assumed: {t['assumed']}")
    lines.append(plan.verdict)
    return "\n".join(lines)
