"""Independent PyTorch reference for SPEC §1 (normalization), §3 (projection), §4 (strict full and
strict top-k) and §5 (divergences). Written from docs/spec.md only; it shares no code with
ctopd_jax.

Conventions (the same decisions ctopd_jax documents, taken independently here):
* float32 log-softmax of logits / τ, no τ² factor; 0·log 0 = 0 (terms weighted by a zero
  probability are dropped with masked_fill, so -inf logits are fine).
* top-k tie-break: among equal student logits the lower shared-vocabulary column wins. torch.topk
  does not promise an order among ties, so the selection is a stable descending sort truncated to
  k; `topk_indices_agree_with_torch_topk` shows it picks the same set as torch.topk without ties.
* akl: stable ascending sort of p_T, tail = prefix with cumulative mass <= α; 0 when both gaps
  are 0. top1_ce: argmax of p_T takes the lowest column among ties.
"""
from __future__ import annotations

import math

import torch


def project(student_logits, teacher_logits, s_ids, t_ids):
    """SPEC §3: zS_bar = zS[:, S_ids], zT_bar = zT[:, T_ids]."""
    s_idx = torch.as_tensor(s_ids, dtype=torch.long)
    t_idx = torch.as_tensor(t_ids, dtype=torch.long)
    return student_logits.index_select(-1, s_idx), teacher_logits.index_select(-1, t_idx)


def _kl(log_p, log_q):
    p = log_p.exp()
    zero = p == 0
    diff = log_p.masked_fill(zero, 0.0) - log_q.masked_fill(zero, 0.0)
    return (p * diff).masked_fill(zero, 0.0).sum(-1)


def _mix(log_a, log_b, w):
    if w == 0.0:
        return log_b
    if w == 1.0:
        return log_a
    empty = torch.isneginf(log_a) & torch.isneginf(log_b)  # no mass on either side
    mixed = torch.logaddexp(log_a.masked_fill(empty, 0.0) + math.log(w),
                            log_b.masked_fill(empty, 0.0) + math.log(1.0 - w))
    return mixed.masked_fill(empty, -math.inf)


def divergence(name, zs, zt, temperature=1.0, jsd_beta=0.5, skl_lambda=0.1, akl_alpha=0.5):
    """Per-row D(p_S, p_T) on logits over the same columns; teacher detached."""
    log_ps = torch.log_softmax(zs.float() / temperature, dim=-1)
    log_pt = torch.log_softmax(zt.detach().float() / temperature, dim=-1)
    if name == "kl":
        return _kl(log_pt, log_ps)
    if name == "rkl":
        return _kl(log_ps, log_pt)
    if name == "jsd":
        log_m = _mix(log_ps, log_pt, jsd_beta)
        return jsd_beta * _kl(log_ps, log_m) + (1 - jsd_beta) * _kl(log_pt, log_m)
    if name == "skl":
        return _kl(log_pt, _mix(log_pt, log_ps, skl_lambda))
    if name == "srkl":
        return _kl(log_ps, _mix(log_ps, log_pt, skl_lambda))
    if name == "tvd":
        return 0.5 * (log_ps.exp() - log_pt.exp()).abs().sum(-1)
    if name == "top1_ce":
        pt = log_pt.exp()
        best = pt.max(dim=-1, keepdim=True).values
        cols = torch.arange(pt.shape[-1]).expand_as(pt)
        first = torch.where(pt == best, cols, pt.shape[-1]).min(dim=-1, keepdim=True).values
        return -best[..., 0] * log_ps.gather(-1, first)[..., 0]
    if name == "akl":
        pt = log_pt.exp()
        ps = log_ps.exp()
        pt_sorted, order = torch.sort(pt, dim=-1, stable=True)
        ps_sorted = ps.detach().gather(-1, order)
        tail = torch.cumsum(pt_sorted, dim=-1) <= akl_alpha
        gap = (pt_sorted - ps_sorted).abs()
        g_tail = (gap * tail).sum(-1)
        g_head = (gap * ~tail).sum(-1)
        total = g_head + g_tail
        mixed = (g_head * _kl(log_pt, log_ps) + g_tail * _kl(log_ps, log_pt))
        return torch.where(total > 0, mixed / torch.where(total > 0, total, 1.0), 0.0)
    raise ValueError(name)


def topk_select(zs_bar, k):
    """Student-chosen top-k columns, lower column first among ties (see module docstring)."""
    return torch.sort(zs_bar.detach(), dim=-1, descending=True, stable=True).indices[..., :k]


def topk_indices_agree_with_torch_topk(zs_bar, k):
    ours = topk_select(zs_bar, k).sort(-1).values
    theirs = torch.topk(zs_bar.detach(), k, dim=-1).indices.sort(-1).values
    return bool((ours == theirs).all())


def strict_rows(name, student_rows, teacher_rows, s_ids, t_ids, topk=None, **kw):
    """SPEC §4 per strict pair: rows are already gathered (row r pairs student r, teacher r)."""
    zs_bar, zt_bar = project(student_rows, teacher_rows, s_ids, t_ids)
    if topk is not None:
        idx = topk_select(zs_bar, topk)
        zs_bar = zs_bar.gather(-1, idx)
        zt_bar = zt_bar.gather(-1, idx)
    return divergence(name, zs_bar, zt_bar, **kw)


def strict_sum(name, student_logits, teacher_logits, student_rows, teacher_rows, s_ids, t_ids,
               topk=None, **kw):
    """Σ over strict pairs; student_logits [N_S, V_S], teacher_logits [N_T, V_T] are flat rows,
    student_rows / teacher_rows the int index arrays of the aligned pairs."""
    s_rows = torch.as_tensor(student_rows, dtype=torch.long)
    t_rows = torch.as_tensor(teacher_rows, dtype=torch.long)
    per_row = strict_rows(name, student_logits[s_rows], teacher_logits[t_rows], s_ids, t_ids,
                          topk=topk, **kw)
    return per_row.sum()


def normalize(sum_loss, total_response_tokens, num_micro_batches=1, accumulation_steps=1):
    """SPEC §1: micro-batch sum ÷ (total tokens / micro-batches) ÷ accumulation steps."""
    return sum_loss / (total_response_tokens / num_micro_batches) / accumulation_steps


def ce_sum(logits, targets, mask):
    log_p = torch.log_softmax(logits.float(), dim=-1)
    nll = -log_p.gather(-1, torch.as_tensor(targets, dtype=torch.long)[..., None])[..., 0]
    return (nll * torch.as_tensor(mask, dtype=torch.float32)).sum()
