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
    """SPEC §7 walk, literally, over per-token decoded strings (given as UTF-8 bytes) with a final
    EOS on both sides: histories are python strings compared in CHARACTERS; equal histories
    with equal current tokens (or both EOS) record a boundary and advance both; otherwise the
    shorter history advances, and equal lengths advance both.
    Returns [(t_start, t_end, s_start, s_end)] in response-token indices (EOS = len(pieces))."""
    eos = object()
    tp = [p.decode("utf-8") for p in t_dec] + [eos]
    sp = [p.decode("utf-8") for p in s_dec] + [eos]
    text = lambda p, name: f"<{name}-eos>" if p is eos else p  # noqa: E731
    i = j = 0
    ht, hs = "", ""
    st = ss = 0
    segments = []
    while i < len(tp) and j < len(sp):
        both_eos = tp[i] is eos and sp[j] is eos
        if ht == hs and (both_eos or (tp[i] is not eos and sp[j] is not eos and tp[i] == sp[j])):
            segments.append((st, i + 1, ss, j + 1))
            ht += text(tp[i], "t")
            hs += text(sp[j], "s")
            i += 1
            j += 1
            st, ss = i, j
        elif len(ht) < len(hs):
            ht += text(tp[i], "t")
            i += 1
        elif len(hs) < len(ht):
            hs += text(sp[j], "s")
            j += 1
        else:
            ht += text(tp[i], "t")
            hs += text(sp[j], "s")
            i += 1
            j += 1
    return segments


def make_batch(samples, seq_pad=3, seed=0, ids=None) -> tuple[RetokenizedBatch, RetokenizedBatch]:
    """Synthetic re-tokenized batches from [(t_pieces, s_pieces, t_pairable, s_pairable)]; token
    ids are 1, 2, ... (the EOS id is 0) unless ``ids`` = (teacher flat ids, student flat ids)."""
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
        side_ids = np.arange(1, len(flat) + 1) if ids is None else np.asarray(ids[k])
        sides.append(RetokenizedBatch(
            input_ids=input_ids, loss_mask=mask, labels=input_ids, attention_mask=mask,
            prompt_lens=prompt_lens, response_lens=response_lens,
            resp_offsets=np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64),
            resp_ids=side_ids.astype(np.int32).reshape(-1),
            resp_byte_len=np.array([len(x) for x in flat], np.int64),
            resp_pairable=np.array([x for p in pairable for x in p], bool).reshape(-1),
            resp_stripped=np.zeros(len(flat), bool),
            resp_bytes=[b"".join(p) for p in pieces],
            responses=[b"".join(p).decode("utf-8", "replace") for p in pieces], eos_id=0))
    return sides[0], sides[1]


def local_index(batch: RetokenizedBatch, sample: int, row: int) -> int:
    """Response-token index of a flat logits row."""
    return int(row - batch.row_base[sample])


ATOM_REASONS = ("empty_response", "unsupported_added_token", "replacement_character",
                "empty_decode", "normalization_mismatch", "unaligned_suffix")


def atoms_oracle(t_ids, s_ids, t_decode, s_decode, t_added, s_added, t_eos, s_eos):
    """SPEC §8 atoms of one sample, literally: returns (reason or None, [(t_tokens, s_tokens)])
    with token index lists. ``*_decode(ids) -> str`` is the side's decode (special tokens kept,
    no clean-up); ``*_added(id) -> bool`` marks the added vocabulary."""
    t_ids, s_ids = list(t_ids), list(s_ids)
    while t_ids and t_ids[-1] == t_eos:
        t_ids.pop()
    while s_ids and s_ids[-1] == s_eos:
        s_ids.pop()
    t_full, s_full = t_decode(t_ids), s_decode(s_ids)
    checks = [(not t_ids or not s_ids, "empty_response"),
              (any(map(t_added, t_ids)) or any(map(s_added, s_ids)), "unsupported_added_token"),
              ("\ufffd" in t_full or "\ufffd" in s_full, "replacement_character"),
              (t_full == "" or s_full == "", "empty_decode"),
              (t_full.encode() != s_full.encode(), "normalization_mismatch")]
    for bad, name in checks:
        if bad:
            return name, []

    def offsets(ids, decode, full):
        found = {}
        for k in range(1, len(ids) + 1):
            d = decode(ids[:k])
            if d == "" or "\ufffd" in d or not full.encode().startswith(d.encode()):
                continue
            found[len(d.encode())] = k  # later k overwrite: the largest k is kept
        return found

    t_off, s_off = offsets(t_ids, t_decode, t_full), offsets(s_ids, s_decode, s_full)
    common = sorted(set(t_off) & set(s_off))
    if not common or common[-1] != len(t_full.encode()) or t_off[common[-1]] != len(t_ids) \
            or s_off[common[-1]] != len(s_ids):
        return "unaligned_suffix", []
    atoms, tp, sp = [], 0, 0
    for o in common:
        atoms.append((list(range(tp, t_off[o])), list(range(sp, s_off[o]))))
        tp, sp = t_off[o], s_off[o]
    return None, atoms
