"""Brute-force references for the alignment tests, written from SPEC §2/§7/§8 directly:
per-sample Python loops over byte strings, nothing shared with ctopd_jax.align."""
from __future__ import annotations

import numpy as np

from ctopd_jax.tokenization.retokenize import RetokenizedBatch


def two_pointer_groups(t_pieces, s_pieces):
    """SPEC §2 step 3 literally: walk cumulative byte ends; returns [(t_idx_list, s_idx_list)],
    the tokens left after the walk as a last group."""
    t_end, s_end, acc = [], [], 0
    for p in t_pieces:
        acc += len(p)
        t_end.append(acc)
    acc = 0
    for p in s_pieces:
        acc += len(p)
        s_end.append(acc)
    groups, i, j, gi, gj = [], 0, 0, [], []
    while i < len(t_pieces) and j < len(s_pieces):
        if t_end[i] == s_end[j]:
            groups.append((gi + [i], gj + [j]))
            gi, gj = [], []
            i += 1
            j += 1
        elif t_end[i] < s_end[j]:
            gi.append(i)
            i += 1
        else:
            gj.append(j)
            j += 1
    gi += list(range(i, len(t_pieces)))
    gj += list(range(j, len(s_pieces)))
    if gi or gj:
        groups.append((gi, gj))
    return groups


def strict_oracle(t_pieces, s_pieces, t_pairable, s_pairable):
    """(pairs [(t, s)], mismatch groups [(t_list, s_list)]) or None when bytes differ."""
    if b"".join(t_pieces) != b"".join(s_pieces):
        return None
    pairs, rest = [], []
    for ti, si in two_pointer_groups(t_pieces, s_pieces):
        if (len(ti) == 1 and len(si) == 1 and t_pieces[ti[0]] == s_pieces[si[0]]
                and t_pieces[ti[0]] and t_pairable[ti[0]] and s_pairable[si[0]]):
            pairs.append((ti[0], si[0]))
        else:
            rest.append((ti, si))
    return pairs, rest


def simct_oracle(t_dec, s_dec):
    """SPEC §7 walk over per-token decoded strings with a final EOS on both sides.
    Returns [(t_start, t_end, s_start, s_end)] in response-token indices (EOS = len(pieces))."""
    eos = object()
    tp, sp = list(t_dec) + [eos], list(s_dec) + [eos]
    text = lambda p: b"\x00EOS" if p is eos else p  # noqa: E731
    i = j = 0
    ht, hs = b"", b""
    st = ss = 0
    segments = []
    while i < len(tp) and j < len(sp):
        both_eos = tp[i] is eos and sp[j] is eos
        if ht == hs and (both_eos or (tp[i] is not eos and sp[j] is not eos and tp[i] == sp[j])):
            segments.append((st, i + 1, ss, j + 1))
            ht += text(tp[i])
            hs += text(sp[j])
            i += 1
            j += 1
            st, ss = i, j
        elif len(ht) <= len(hs):  # the shorter history advances; a tie moves the teacher
            ht += text(tp[i])
            i += 1
        else:
            hs += text(sp[j])
            j += 1
    return segments


def make_batch(samples, seq_pad=3, seed=0) -> tuple[RetokenizedBatch, RetokenizedBatch]:
    """Synthetic re-tokenized batches from [(t_pieces, s_pieces, t_pairable, s_pairable)]."""
    rng = np.random.default_rng(seed)
    sides = []
    for k in range(2):
        pieces = [s[k] for s in samples]
        pairable = [s[2 + k] for s in samples]
        prompt_lens = rng.integers(1, 4, size=len(samples)).astype(np.int32)
        response_lens = np.array([len(p) + 1 for p in pieces], np.int32)
        seq_len = int((prompt_lens + response_lens).max()) + seq_pad
        input_ids = np.zeros((len(samples), seq_len), np.int32)
        pos = np.arange(seq_len)[None]
        first = prompt_lens[:, None] - 1
        mask = (pos >= first) & (pos < first + response_lens[:, None])
        flat = [x for p in pieces for x in p]
        sides.append(RetokenizedBatch(
            input_ids=input_ids, loss_mask=mask, labels=input_ids, attention_mask=mask,
            prompt_lens=prompt_lens, response_lens=response_lens,
            resp_offsets=np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64),
            resp_ids=np.zeros(len(flat), np.int32),
            resp_byte_len=np.array([len(x) for x in flat], np.int64),
            resp_pairable=np.array([x for p in pairable for x in p], bool).reshape(-1),
            resp_stripped=np.zeros(len(flat), bool),
            resp_bytes=[b"".join(p) for p in pieces],
            responses=[b"".join(p).decode("utf-8", "replace") for p in pieces], eos_id=0))
    return sides[0], sides[1]


def local_index(batch: RetokenizedBatch, sample: int, row: int) -> int:
    """Response-token index of a flat logits row."""
    return int(row - batch.row_base[sample])
