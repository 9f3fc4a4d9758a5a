"""The objective interface the trainer drives.

An algorithm sees one packed micro-batch (`StudentBatch`, arrays on the mesh) and returns the
SUM of its per-position loss terms; the trainer adds the CE term for `kd_ratio < 1`, applies the
SPEC §1 normalization (÷ total student response tokens of the global batch) and differentiates.

What an algorithm may need is declared in `needs` so the host side only builds what is used:
- "strict_pairs":  flat student / teacher row indices of strict 1:1 pairs (SPEC §2)
- "teacher_shared_rows": teacher logits at the strict teacher rows, projected to V∩ (or full
  V_T with t_ids) — computed on device by the trainer's teacher scoring
Future objectives add e.g. "mismatch_groups" (span loss), "simct_segments", "mpopd_atoms",
"token_logprobs" (rollout-time student log-probs), "dataset_responses" (GKD off-policy),
"teacher_prefix_states" (TCOD B2F); the trainer fills a key only when some algorithm asks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

_REGISTRY: dict[str, type["Algorithm"]] = {}


def register(name: str):
    def wrap(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"algorithm {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def registry() -> dict[str, type["Algorithm"]]:
    return dict(_REGISTRY)


@dataclass(frozen=True)
class AlgorithmSettings:
    kd_loss_fn: str = "rkl"
    kd_ratio: float = 1.0
    kd_temperature: float = 1.0
    ctkd_topk: int = 128
    jsd_beta: float = 0.5
    skl_lambda: float = 0.1
    akl_alpha: float = 0.5
    implementation: str = "xla"
    chunked_loss_size: int = 2048

    @classmethod
    def from_config(cls, section: Any) -> "AlgorithmSettings":
        names = cls.__dataclass_fields__
        return cls(**{k: getattr(section, k) for k in names if hasattr(section, k)})

    @property
    def divergence_kwargs(self) -> dict[str, float]:
        return dict(temperature=self.kd_temperature, jsd_beta=self.jsd_beta,
                    skl_lambda=self.skl_lambda, akl_alpha=self.akl_alpha)


class Algorithm:
    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: AlgorithmSettings):
        self.settings = settings

    # The algorithm is a static argument of the jitted student step: equal settings must hash
    # equal so a second trainer in the same process reuses the compiled program.
    def __hash__(self):
        return hash((type(self), self.settings))

    def __eq__(self, other):
        return type(self) is type(other) and self.settings == other.settings

    def check_vocab(self, shared_vocab_size: int) -> None:
        """Raise a clear error for settings that cannot work with this vocabulary overlap."""

    def kd_sum(self, hidden_flat, lm_head, batch: dict, teacher_rows, overlap: dict):
        """Σ of per-position KD terms over this micro-batch (float32 scalar, differentiable).

        hidden_flat: student final hidden states [M*T, H]; lm_head: [H, V_S];
        batch: the packed micro-batch arrays; teacher_rows: what the teacher scoring produced;
        overlap: {"s_ids": [V∩], "t_ids": [V∩]} device arrays."""
        raise NotImplementedError
