"""Synchronised groups of two token sequences on a shared byte ruler, vectorised over a batch.

This is the one machine behind strict pairs (SPEC §2), mismatch groups, SimCT segments (§7) and
MP-OPD atoms (§8). It reproduces, without a per-token Python loop, the two-pointer walk::

    i = j = 0; start = (0, 0)
    while i < n_t and j < n_s:
        if end_t[i] == end_s[j]: close group (start .. i, start .. j); i += 1; j += 1
        elif end_t[i] < end_s[j]: i += 1
        else: j += 1
    tokens left after the walk (only zero-length ones can be) form one trailing group

where ``end`` are the cumulative byte end offsets. For each end value ``v`` present on both
sides with ``k_t`` and ``k_s`` tokens ending there, the walk closes ``min(k_t, k_s)`` groups at
``v``, pairing the first tokens of each run; a token is a "closer" exactly when its rank in its
run is below that minimum. The closers of the two sides correspond one to one, in order. With no
zero-length tokens (the usual case) this reduces to marking common offsets on a byte bitmap.

Indices are flat token indices into the per-side arrays (sample ``b`` owns
``offsets[b]:offsets[b+1]``).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Groups:
    """Groups in batch order. ``*_first`` / ``*_last`` are inclusive flat token indices; a side
    with no token in the group has ``last == first - 1`` (only in trailing groups)."""
    sample: np.ndarray
    t_first: np.ndarray
    t_last: np.ndarray
    s_first: np.ndarray
    s_last: np.ndarray
    trailing: np.ndarray  # bool: the leftover group after the walk ended

    def __len__(self) -> int:
        return int(self.sample.shape[0])


def _closers_general(key_self, key_other):
    left = np.searchsorted(key_self, key_self, "left")
    right = np.searchsorted(key_self, key_self, "right")
    rank = np.arange(key_self.shape[0]) - left
    mult_other = (np.searchsorted(key_other, key_self, "right")
                  - np.searchsorted(key_other, key_self, "left"))
    return rank < np.minimum(right - left, mult_other)


def sync_groups(t_len, t_offsets, s_len, s_offsets, sample_ok, limit=None) -> Groups:
    """Groups of every sample with ``sample_ok``; ``limit[b]`` (optional) ignores common
    offsets beyond it (SimCT stops where the decoded histories diverge).

    Every token gets a key on one global ruler: its cumulative end within its sample plus a
    per-sample base. Samples that are not ok get disjoint teacher and student ranges, so they
    have no common key and need no per-token filtering."""
    t_len = np.asarray(t_len, dtype=np.int64)
    s_len = np.asarray(s_len, dtype=np.int64)
    t_offsets = np.asarray(t_offsets, dtype=np.int64)
    s_offsets = np.asarray(s_offsets, dtype=np.int64)
    sample_ok = np.asarray(sample_ok, dtype=bool)
    t_cum = np.cumsum(t_len)
    s_cum = np.cumsum(s_len)
    t_before = _cum_before(t_cum, t_offsets)
    s_before = _cum_before(s_cum, s_offsets)
    t_tot, s_tot = np.diff(t_before), np.diff(s_before)
    span = np.where(sample_ok, np.maximum(t_tot, s_tot), t_tot + s_tot + 1) + 1
    t_base = np.cumsum(span) - span
    s_base = t_base + np.where(sample_ok, 0, t_tot + 1)
    t_counts, s_counts = np.diff(t_offsets), np.diff(s_offsets)
    positive = bool(t_len.size and s_len.size and t_len.min() > 0 and s_len.min() > 0)
    if positive and sample_ok.all() and np.array_equal(t_tot, s_tot):
        # Common case: the samples already lie end to end on one ruler on both sides, and with
        # no zero-length token a key never repeats within a side.
        t_key, s_key = t_cum, s_cum
        t_base = np.concatenate([[0], np.cumsum(t_tot)])[:-1]
        span = t_tot
    else:
        t_key = t_cum + np.repeat(t_base - t_before[:-1], t_counts)
        s_key = s_cum + np.repeat(s_base - s_before[:-1], s_counts)
    if positive:
        # Strictly increasing keys: a token closes a group iff the other side has its end.
        ruler = np.zeros(int(t_base[-1] + span[-1]) + 1, dtype=bool)
        ruler[s_key] = True
        t_close = ruler[t_key]
        ruler[s_key] = False
        ruler[t_key] = True
        s_close = ruler[s_key]
    else:
        t_close = _closers_general(t_key, s_key)
        s_close = _closers_general(s_key, t_key)
    if limit is not None:  # keys beyond a sample's limit never match a key within it
        limit = np.asarray(limit, dtype=np.int64)
        t_close &= t_key - np.repeat(t_base, t_counts) <= np.repeat(limit, t_counts)
        s_close &= s_key - np.repeat(s_base, s_counts) <= np.repeat(limit, s_counts)
    t_idx = np.flatnonzero(t_close)
    s_idx = np.flatnonzero(s_close)
    assert t_idx.shape == s_idx.shape, "closers must correspond one to one"
    # Closers per sample from B searches (not one search per closer).
    ends = np.searchsorted(t_idx, t_offsets[1:], "left")
    starts = np.concatenate([[0], ends[:-1]])
    sample = np.repeat(np.arange(sample_ok.shape[0]), ends - starts)
    has = ends > starts
    t_first = np.empty_like(t_idx)
    s_first = np.empty_like(s_idx)
    t_first[1:] = t_idx[:-1] + 1
    s_first[1:] = s_idx[:-1] + 1
    t_first[starts[has]] = t_offsets[:-1][has]
    s_first[starts[has]] = s_offsets[:-1][has]
    # Leftovers after the walk: the tokens after each sample's last closer.
    t_rest = _after_last(t_idx, t_offsets)
    s_rest = _after_last(s_idx, s_offsets)
    has_rest = sample_ok & ((t_rest < t_offsets[1:]) | (s_rest < s_offsets[1:]))
    if limit is not None:
        has_rest[:] = False  # SimCT drops the unanchored tail; callers never need it
    rest = np.flatnonzero(has_rest)
    if not rest.size:
        return Groups(sample=sample, t_first=t_first, t_last=t_idx, s_first=s_first,
                      s_last=s_idx, trailing=np.zeros(t_idx.shape, bool))
    groups = Groups(
        sample=np.concatenate([sample, rest]),
        t_first=np.concatenate([t_first, t_rest[rest]]),
        t_last=np.concatenate([t_idx, t_offsets[1:][rest] - 1]),
        s_first=np.concatenate([s_first, s_rest[rest]]),
        s_last=np.concatenate([s_idx, s_offsets[1:][rest] - 1]),
        trailing=np.concatenate([np.zeros(t_idx.shape, bool), np.ones(rest.shape, bool)]))
    order = np.argsort(groups.sample * 2 + groups.trailing, kind="stable")
    return Groups(*(getattr(groups, f.name)[order] for f in dataclasses.fields(Groups)))


def _cum_before(cum: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Cumulative length before each offset (B + 1 lookups, no copy of ``cum``)."""
    if not cum.size:
        return np.zeros(offsets.shape, np.int64)
    return np.where(offsets > 0, cum[np.maximum(offsets - 1, 0)], 0)


def _after_last(closer_idx: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per sample: the flat index after its last closer, or its start if it has none."""
    pos = np.searchsorted(closer_idx, offsets[1:], "left") - 1
    last = closer_idx[np.clip(pos, 0, None)] if closer_idx.size else np.full(pos.shape, -1)
    has = (pos >= 0) & (last >= offsets[:-1])
    return np.where(has, last + 1, offsets[:-1])
