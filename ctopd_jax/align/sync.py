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


def _ruler_keys(lengths: np.ndarray, offsets: np.ndarray, base: np.ndarray):
    """Global end offset of each token: ``base[sample] + local cumulative end``."""
    counts = np.diff(offsets)
    sample = np.repeat(np.arange(counts.shape[0]), counts)
    cum = np.cumsum(lengths, dtype=np.int64)
    before = np.concatenate([[0], cum])[offsets[:-1]]
    local = cum - before[sample]
    return base[sample] + local, local, sample


def _closers_general(key_self, key_other):
    left = np.searchsorted(key_self, key_self, "left")
    right = np.searchsorted(key_self, key_self, "right")
    rank = np.arange(key_self.shape[0]) - left
    mult_other = (np.searchsorted(key_other, key_self, "right")
                  - np.searchsorted(key_other, key_self, "left"))
    return rank < np.minimum(right - left, mult_other)


def sync_groups(t_len, t_offsets, s_len, s_offsets, sample_ok, limit=None) -> Groups:
    """Groups of every sample with ``sample_ok``; ``limit[b]`` (optional) ignores common
    offsets beyond it (SimCT stops where the decoded histories diverge)."""
    t_len = np.asarray(t_len, dtype=np.int64)
    s_len = np.asarray(s_len, dtype=np.int64)
    t_offsets = np.asarray(t_offsets, dtype=np.int64)
    s_offsets = np.asarray(s_offsets, dtype=np.int64)
    sample_ok = np.asarray(sample_ok, dtype=bool)
    num = sample_ok.shape[0]
    t_cum = np.concatenate([[0], np.cumsum(t_len)])
    s_cum = np.concatenate([[0], np.cumsum(s_len)])
    t_tot = t_cum[t_offsets[1:]] - t_cum[t_offsets[:-1]]
    s_tot = s_cum[s_offsets[1:]] - s_cum[s_offsets[:-1]]
    span = np.maximum(t_tot, s_tot) + 1
    base = np.concatenate([[0], np.cumsum(span)])[:num]
    t_key, t_local, t_sample = _ruler_keys(t_len, t_offsets, base)
    s_key, s_local, s_sample = _ruler_keys(s_len, s_offsets, base)
    if t_len.size and s_len.size and t_len.min() > 0 and s_len.min() > 0:
        # Strictly increasing keys: a token closes a group iff the other side has its end.
        ruler = np.zeros(int(base[-1] + span[-1]) + 1, dtype=bool)
        ruler[s_key] = True
        t_close = ruler[t_key]
        ruler[:] = False
        ruler[t_key] = True
        s_close = ruler[s_key]
    else:
        t_close = _closers_general(t_key, s_key)
        s_close = _closers_general(s_key, t_key)
    t_close &= sample_ok[t_sample]
    s_close &= sample_ok[s_sample]
    if limit is not None:
        limit = np.asarray(limit, dtype=np.int64)
        t_close &= t_local <= limit[t_sample]
        s_close &= s_local <= limit[s_sample]
    t_idx = np.flatnonzero(t_close)
    s_idx = np.flatnonzero(s_close)
    assert t_idx.shape == s_idx.shape, "closers must correspond one to one"
    sample = t_sample[t_idx]
    first_in_sample = np.ones(sample.shape, dtype=bool)
    first_in_sample[1:] = sample[1:] != sample[:-1]
    t_first = np.where(first_in_sample, t_offsets[:-1][sample], np.r_[-1, t_idx[:-1]] + 1)
    s_first = np.where(first_in_sample, s_offsets[:-1][sample], np.r_[-1, s_idx[:-1]] + 1)
    # Leftovers after the walk: the tokens after each sample's last closer.
    t_rest = _after_last(t_idx, t_offsets)
    s_rest = _after_last(s_idx, s_offsets)
    has_rest = sample_ok & ((t_rest < t_offsets[1:]) | (s_rest < s_offsets[1:]))
    if limit is not None:
        has_rest[:] = False  # SimCT drops the unanchored tail; callers never need it
    rest = np.flatnonzero(has_rest)
    groups = Groups(
        sample=np.concatenate([sample, rest]),
        t_first=np.concatenate([t_first, t_rest[rest]]),
        t_last=np.concatenate([t_idx, t_offsets[1:][rest] - 1]),
        s_first=np.concatenate([s_first, s_rest[rest]]),
        s_last=np.concatenate([s_idx, s_offsets[1:][rest] - 1]),
        trailing=np.concatenate([np.zeros(t_idx.shape, bool), np.ones(rest.shape, bool)]))
    if rest.size:
        order = np.argsort(groups.sample * 2 + groups.trailing, kind="stable")
        groups = Groups(*(getattr(groups, f.name)[order] for f in dataclasses.fields(Groups)))
    return groups


def _after_last(closer_idx: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per sample: the flat index after its last closer, or its start if it has none."""
    pos = np.searchsorted(closer_idx, offsets[1:], "left") - 1
    last = closer_idx[np.clip(pos, 0, None)] if closer_idx.size else np.full(pos.shape, -1)
    has = (pos >= 0) & (last >= offsets[:-1])
    return np.where(has, last + 1, offsets[:-1])
