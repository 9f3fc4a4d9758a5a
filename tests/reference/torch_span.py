"""Independent PyTorch reference for SPEC §6 (span loss) and the per-row full-vocabulary
statistics it is built on, plus the byte grouping of SPEC §2 step 3. Written from docs/spec.md
only; it shares no code with ctopd_jax.

* `token_rows`: logits = hidden @ lm_head / τ in float32 over the FULL vocabulary; returns the
  realised-token log-prob and the logsumexp per row.
* `byte_groups`: the two-pointer walk over cumulative byte end offsets of the teacher and the
  student tokens of one response (EOS removed); a group closes whenever both sides reach a
  common boundary. A group is a strict pair iff it is 1 teacher token and 1 student token with
  equal non-empty bytes; every other group is a mismatch group.
* `span_loss`: Σ over mismatch groups of (log q_S(r) − log q_T(r))², log q_M(r) the sum of the
  full-vocabulary log-probs of that side's tokens of the group; the teacher side is detached.
"""
from __future__ import annotations

import torch


def token_rows(hidden, lm_head, targets, temperature: float = 1.0):
    """(log p(target) [R], logsumexp [R]) of hidden @ lm_head / τ, float32."""
    z = hidden.float() @ lm_head.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, torch.as_tensor(targets, dtype=torch.long).view(-1, 1))[:, 0]
    return picked - lse, lse


def byte_groups(t_bytes: list[bytes], s_bytes: list[bytes]):
    """Groups of one sample: a list of (teacher token indices, student token indices, strict).

    Both sides must carry the same concatenated bytes (SPEC §2 step 2; otherwise no groups)."""
    if b"".join(t_bytes) != b"".join(s_bytes):
        return []
    groups = []
    i = j = 0                      # next token on each side
    t_end = s_end = 0              # byte offset reached on each side
    t_first = s_first = 0          # first token of the open group
    while i < len(t_bytes) or j < len(s_bytes):
        if j >= len(s_bytes) or (i < len(t_bytes) and t_end <= s_end):
            t_end += len(t_bytes[i])
            i += 1
        else:
            s_end += len(s_bytes[j])
            j += 1
        if t_end == s_end and i > t_first and j > s_first:   # a common boundary closes a group
            t_idx, s_idx = list(range(t_first, i)), list(range(s_first, j))
            strict = (len(t_idx) == 1 and len(s_idx) == 1 and len(t_bytes[t_idx[0]]) > 0
                      and t_bytes[t_idx[0]] == s_bytes[s_idx[0]])
            groups.append((t_idx, s_idx, strict))
            t_first, s_first = i, j
    return groups


def span_loss(student_logp, teacher_logp, groups):
    """Σ over mismatch groups of (Σ student logp − Σ teacher logp)².

    student_logp / teacher_logp: 1-D tensors of per-token realised log-probs of ONE sample's
    response (index = response token index); groups: `byte_groups` output."""
    total = torch.zeros((), dtype=torch.float32)
    for t_idx, s_idx, strict in groups:
        if strict:
            continue
        q_s = student_logp[list(s_idx)].sum()
        q_t = teacher_logp.detach()[list(t_idx)].sum()
        total = total + (q_s - q_t) ** 2
    return total


def mismatch_counts(groups):
    """(mismatch groups, student tokens in mismatch groups) of one sample."""
    mis = [g for g in groups if not g[2]]
    return len(mis), sum(len(g[1]) for g in mis)


def flat_cosine_and_ratio(g: list, h: list):
    """cos(g, h) and ‖h‖/‖g‖ of two gradient lists flattened into one vector each (float64)."""
    a = torch.cat([x.reshape(-1).double() for x in g])
    b = torch.cat([x.reshape(-1).double() for x in h])
    return float(a @ b / (a.norm() * b.norm())), float(b.norm() / a.norm())
