"""Algorithm registry: name -> objective class (see base.Algorithm for the interface).

Registered now: `strict` (byte_align_ctkd, full shared vocabulary) and `topk_strict`
(topk_byte_align_ctkd). The span loss, SimCT, MP-OPD and the same-tokenizer family plug in as
further modules that declare which host-side records they need (`Algorithm.needs`).
"""
from __future__ import annotations

from ctopd_jax.algorithms.base import Algorithm, AlgorithmSettings, register, registry
from ctopd_jax.algorithms import strict  # noqa: F401  (registers strict, topk_strict)


def get_algorithm(name: str, settings: AlgorithmSettings) -> Algorithm:
    table = registry()
    if name not in table:
        raise ValueError(f"algorithm.name={name!r} is not registered; choose one of {sorted(table)}")
    return table[name](settings)


__all__ = ["Algorithm", "AlgorithmSettings", "get_algorithm", "register", "registry"]
