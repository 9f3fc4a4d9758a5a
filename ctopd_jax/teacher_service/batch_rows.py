"""Served scores laid out on the teacher batch's own flat logits rows.

The local teacher path hands the objectives rows of the flattened [B * T] teacher logits (the
row that PREDICTS a token: `b * T + prompt_len - 1 + k` for response token k, EOS included;
tokenization/retokenize.py). `score_teacher_batch` asks a served teacher about the same
`RetokenizedBatch` and returns its answers on exactly those rows, so an objective indexes them
with the indices it already has (`StrictAlignment.teacher_rows`, mismatch groups, MP-OPD atoms)
instead of hidden rows:

    rows = score_teacher_batch(teacher, batch.teacher)
    rows.token_logprobs[strict.teacher_rows]   # log p_T of each paired teacher token
    rows.topk_ids[strict.teacher_rows]         # the teacher's top-k there (topk.py)

Rows outside the loss mask hold token log-prob 0, top-k id 0 and top-k log-prob -inf, with
`row_mask` False. Sizes are [B*T] and [B*T, k]: small next to the [R, H] hidden rows they
replace for any k < H.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class ServedRows:
    token_logprobs: np.ndarray  # float32 [B*T]
    topk_ids: np.ndarray        # int32 [B*T, k]
    topk_logprobs: np.ndarray   # float32 [B*T, k]
    row_mask: np.ndarray        # bool [B*T]: rows that predict a response token or the EOS


def teacher_sequences(batch) -> tuple[list[list[int]], list[int]]:
    """Each sample's unpadded teacher input (prompt + response + EOS) and first response
    position, from a RetokenizedBatch. The whole attended sequence: in an episode
    (host.token_batch) environment observations sit between the trained tokens, and
    response_lens counts only the trained ones."""
    ends = batch.attention_mask.sum(axis=1).astype(np.int64)
    sequences = [batch.input_ids[b, :ends[b]].tolist() for b in range(batch.batch_size)]
    return sequences, [int(p) for p in batch.prompt_lens]


def score_teacher_batch(teacher, batch, top_k: int | None = None) -> ServedRows:
    """`teacher`: anything with `.score(sequences, starts)` and `.settings.top_k` (ServedTeacher;
    LocalTeacherScorer with `top_k`). `top_k`: passed to `score` when given (0: the realised
    tokens' log-probs only, what the sampled objectives read; the top-k arrays are then [B*T, 0])."""
    sequences, starts = teacher_sequences(batch)
    scored = teacher.score(sequences, starts) if top_k is None else \
        teacher.score(sequences, starts, top_k=top_k)
    k = scored[0].topk_ids.shape[1] if scored else (_top_k(teacher) if top_k is None else top_k)
    rows = batch.batch_size * batch.seq_len
    token = np.zeros(rows, np.float32)
    top_ids = np.zeros((rows, k), np.int32)
    top_lps = np.full((rows, k), -np.inf, np.float32)
    for b, (got, start) in enumerate(zip(scored, starts)):
        first = b * batch.seq_len + start - 1
        span = slice(first, first + len(got))
        token[span], top_ids[span], top_lps[span] = (got.token_logprobs, got.topk_ids,
                                                     got.topk_logprobs)
    mask = batch.loss_mask.reshape(-1).astype(bool)
    token[~mask], top_ids[~mask], top_lps[~mask] = 0.0, 0, -np.inf   # observations, padding
    return ServedRows(token, top_ids, top_lps, mask)


def _top_k(teacher) -> int:
    settings = getattr(teacher, "settings", None)
    return settings.top_k if settings is not None else teacher.top_k
