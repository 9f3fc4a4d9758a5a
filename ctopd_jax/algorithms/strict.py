"""Strict full (`strict`, byte_align_ctkd) and strict top-k (`topk_strict`) of SPEC §4.

Both gather the student hidden states at the strict pairs' student rows and hand
(hidden rows, lm_head) to the chunked kernel, so the lm_head, the V∩ projection and the
divergence run per chunk of `chunked_loss_size` rows and no [R, V] student logits exist.
"""
from __future__ import annotations

import jax.numpy as jnp

from ctopd_jax.algorithms.base import Algorithm, register
from ctopd_jax.kernels.api import strict_kd_sum


@register("strict")
class StrictFull(Algorithm):
    needs = frozenset({"strict_pairs", "teacher_shared_rows"})
    topk: int | None = None

    def _topk(self) -> int | None:
        return None

    def check_vocab(self, shared_vocab_size: int) -> None:
        k = self._topk()
        if k is not None and k > shared_vocab_size:
            raise ValueError(f"algorithm.ctkd_topk={k} exceeds the shared vocabulary |V∩|="
                             f"{shared_vocab_size}; lower ctkd_topk")

    def kd_sum(self, hidden_flat, lm_head, batch, teacher_rows, overlap):
        s = self.settings
        rows = jnp.take(hidden_flat, batch["strict_student_rows"], axis=0)
        return strict_kd_sum((rows, lm_head), teacher_rows, overlap["s_ids"], batch["strict_weight"],
                             divergence=s.kd_loss_fn, topk=self._topk(), temperature=s.kd_temperature,
                             implementation=s.implementation, chunk_rows=s.chunked_loss_size,
                             jsd_beta=s.jsd_beta, skl_lambda=s.skl_lambda, akl_alpha=s.akl_alpha)


@register("topk_strict")
class StrictTopK(StrictFull):
    def _topk(self) -> int | None:
        return int(self.settings.ctkd_topk)
