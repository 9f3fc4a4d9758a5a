"""An iteration's batches per teacher (`teachers:`; a run without it has one teacher).

    collected = collect(teachers, config, objective, prompts, seed, timer, rollout_index)
    for pieces in update_pieces(collected, train_batch_size, several=bool(config.teachers)):
        ...  # (name, host batch, first, last sample, offset in the iteration) per piece
    sums = IterationSums(collected)
    ...  # sums.add(name, micro-batch sums, micro-batch metrics) per micro-batch (device arrays)
    metrics = sums.metrics(objective, collected, update_infos, coverage, several)  # one transfer

Decisions: teacher g's prompts sample with seed + g, so teachers do not share random streams
(g = 0 is the single-teacher seed); with several teachers one update covers every teacher's
samples (preflight holds train_batch_size to the iteration's responses), one teacher per
micro-batch, so a teacher's last micro-batch may be short.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ctopd_jax.common.routing import route_rows
from ctopd_jax.config import default_teacher
from ctopd_jax.step.grad import host_floats
from ctopd_jax.teacher_service.batch_rows import score_teacher_batch


def collect(teachers: dict, config, objective, prompts, seed: int, timer, rollout_index: int) -> dict[str, Any]:
    """name -> the HostBatch of the prompts routed to that teacher (build.TeacherParts; a row's
    data.teacher_key field or data.default_teacher, else every prompt to the one teacher), with
    its overlap map and a served teacher's token log-probs (and top-k when the objective reads it)."""
    default = default_teacher(config)
    routed = (route_rows([p.extra for p in prompts], list(teachers), default, config.data.teacher_key)
              if config.teachers else {default: range(len(prompts))})
    collected = {}
    for g, (name, rows) in enumerate(routed.items()):
        if not rows:
            continue
        t = teachers[name]
        host = t.collector.collect([prompts[i] for i in rows], (seed + g) % 2 ** 31, timer,
                                   rollout_index=rollout_index)
        host.overlap = t.overlap
        if t.served is not None:   # the realised tokens' log-probs (and top-k), before any step
            top_k = t.served.settings.top_k if objective.needs.teacher_scores == "topk" else 0
            with timer("teacher"):
                host.served_teacher_rows = score_teacher_batch(t.served, host.teacher, top_k=top_k)
        collected[name] = host
    return collected


def update_pieces(collected: dict[str, Any], train_batch_size: int, several: bool) -> list[list[tuple]]:
    """The optimizer updates of an iteration, each a list of (teacher name, host batch, first,
    last sample, offset of that host's samples in the iteration): with one teacher, consecutive
    train_batch_size blocks; with several, one update over every teacher's samples."""
    if not several:
        (name, host), = collected.items()
        return [[(name, host, a, a + train_batch_size, 0)]
                for a in range(0, host.size, train_batch_size)]
    offsets = np.cumsum([0] + [host.size for host in collected.values()])
    return [[(name, host, 0, host.size, int(offsets[i]))
             for i, (name, host) in enumerate(collected.items())]]


def loss_metrics(objective, sums: dict[str, float], tokens: float) -> dict[str, float]:
    """Each sum ÷ `tokens` (`<name>_loss`), the trained mix (`loss`) and its KD part."""
    weights = objective.loss_weights()
    metrics = {f"{k}_loss": v / tokens for k, v in sums.items()}
    metrics["loss"] = sum(weights.get(k, 0.0) * v for k, v in sums.items() if weights.get(k)) / tokens
    metrics["kd_loss"] = sum(w * sums[k] for k, w in objective.kd_weights().items()
                             if w and k in sums) / tokens
    return metrics


def teacher_metrics(collected: dict[str, Any], by_teacher: dict, coverage: dict, objective) -> dict[str, float]:
    """Per teacher (`<name>/...`): its share of the loss over its own tokens, its samples and
    tokens, and its pair's coverage."""
    metrics = {}
    for name, host in collected.items():
        own = max(host.tokens(0, host.size), 1.0)
        metrics.update({f"{name}/{k}": v for k, v in loss_metrics(objective, by_teacher[name], own).items()})
        metrics.update({f"{name}/samples": host.size, f"{name}/student_response_tokens": int(own),
                        **{f"{name}/{k}": v for k, v in coverage[name].items()}})
    return metrics


class IterationSums:
    """What an iteration's micro-batches add up to: each objective sum, over the iteration and
    per teacher, and the objective's (numerator, denominator) metrics.

    `add` only keeps the micro-batch's device arrays (no host sync, so the host prepares the
    next micro-batch while the device computes this one); `metrics` fetches them all in one
    transfer and adds them on the host in micro-batch order, in float64 as before."""

    def __init__(self, names):
        self.names = list(names)
        self.added: list[tuple[str, dict, dict]] = []

    def add(self, name: str, sums: dict, metrics: dict) -> None:
        self.added.append((name, sums, metrics))

    def _totals(self, added) -> tuple[dict, dict, dict]:
        total: dict[str, float] = {}
        by_teacher: dict[str, dict[str, float]] = {name: {} for name in self.names}
        parts: dict[str, list] = {}
        for name, sums, metrics in added:
            for k, v in sums.items():
                total[k] = total.get(k, 0.0) + v
                by_teacher[name][k] = by_teacher[name].get(k, 0.0) + v
            for k, (num, den) in metrics.items():  # den None: a count, reported as the total
                part = parts.setdefault(k, [0.0, None if den is None else 0.0])
                part[0] += num
                part[1] = None if den is None else part[1] + den
        return total, by_teacher, parts

    def metrics(self, objective, collected: dict[str, Any], infos: list[dict], coverage: dict,
                several: bool) -> dict[str, Any]:
        """The iteration's metrics: losses over its student response tokens, the last update's
        lr and gradient norm, rollout counts, and coverage (per teacher with several)."""
        hosts = list(collected.values())
        values, infos = host_floats(([(sums, m) for _, sums, m in self.added], infos))
        total, by_teacher, parts = self._totals([(name, *v) for (name, _, _), v in zip(self.added, values)])
        tokens = max(sum(host.tokens(0, host.size) for host in hosts), 1.0)
        metrics = loss_metrics(objective, total, tokens)
        for k, (num, den) in parts.items():
            if den is None or den:  # no log-prob gap when no re-tokenized response equals its samples
                metrics[k] = num if den is None else num / den
        metrics.update({
            "lr": infos[-1]["lr"], "grad_norm": infos[-1]["grad_norm"],
            "update_applied": min(i["update_applied"] for i in infos),
            "response_length": float(np.mean(np.concatenate([h.student.response_lens for h in hosts]))),
            "truncated_samples": sum(r == "length" for h in hosts for r in h.finish_reasons),
            "rollout_shard_samples": sum(h.shard_samples for h in hosts),
            "student_response_tokens": int(tokens),
            "strict_pairs": sum(h.alignment.num_pairs for h in hosts)})
        if several:
            metrics.update(teacher_metrics(collected, by_teacher, coverage, objective))
        else:
            (one_teacher,) = coverage.values()
            metrics.update(one_teacher)
        for host in hosts:
            metrics.update({k: v for k, v in (host.turn_stats or {}).items() if v is not None})
        return metrics
