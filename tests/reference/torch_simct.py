"""Independent PyTorch reference for SimCT (SPEC §7), written from docs/spec.md only; it shares no
code with ctopd_jax.

Per sample the inputs are each side's response label ids (EOS last), their per-token decoded
strings (EOS excluded) and the hidden states of the rows that predict them ([n + 1, H], EOS row
last). Everything is computed over the FULL vocabulary in float32 with plain autograd:

* `walk`: the SPEC §7 two-pointer walk over decoded-string histories (python strings, lengths
  in characters); segments (t_start, t_end, s_start, s_end), end exclusive, anchor included.
* `simct_loss`: one row per segment, columns = V∩ columns at the segment's first position +
  one extra column (the span score: mean raw logit of the realised ids in `raw_logit`, mean
  full-vocabulary log-prob in `mean_logprob`, where the V∩ columns are full log-softmax values
  too; −1e9 on both sides for a 1:1 segment); the row divided by τ; the divergence per row;
  optional G(h) mask (keep iff min(1, teacher V∩ mass + exp(mean teacher span log-prob)) ≥ 0.5).
"""
from __future__ import annotations

import torch


def walk(t_dec: list[str], s_dec: list[str]):
    tp, sp = t_dec + [None], s_dec + [None]       # None = the side's EOS
    i = j = 0
    ht = hs = ""
    st = ss = 0
    out = []
    while i < len(tp) and j < len(sp):
        both_eos = tp[i] is None and sp[j] is None
        same = tp[i] is not None and sp[j] is not None and tp[i] == sp[j]
        if ht == hs and (both_eos or same):
            out.append((st, i + 1, ss, j + 1))
            ht += tp[i] or "<eos-t>"
            hs += sp[j] or "<eos-s>"
            i, j = i + 1, j + 1
            st, ss = i, j
        elif len(ht) < len(hs):
            ht += tp[i] or "<eos-t>"
            i += 1
        elif len(hs) < len(ht):
            hs += sp[j] or "<eos-s>"
            j += 1
        else:
            ht += tp[i] or "<eos-t>"
            hs += sp[j] or "<eos-s>"
            i, j = i + 1, j + 1
    return out


def _log_softmax(x):
    return x - torch.logsumexp(x, dim=-1, keepdim=True)


def divergence(name: str, log_ps, log_pt, beta: float = 0.5):
    ps, pt = log_ps.exp(), log_pt.exp()

    def kl(p, lp, lq):  # 0·log 0 = 0, with NaN-free gradients where p = 0
        live = p > 0
        diff = torch.where(live, lp, torch.zeros_like(lp)) - torch.where(live, lq, torch.zeros_like(lq))
        return torch.where(live, p * diff, torch.zeros_like(p)).sum(-1)

    if name == "rkl":
        return kl(ps, log_ps, log_pt)
    if name == "kl":
        return kl(pt, log_pt, log_ps)
    if name == "jsd":
        m = beta * ps + (1 - beta) * pt
        lm = torch.log(torch.where(m > 0, m, torch.ones_like(m)))  # m = 0 only where p_S = p_T = 0
        return beta * kl(ps, log_ps, lm) + (1 - beta) * kl(pt, log_pt, lm)
    if name == "tvd":
        return 0.5 * (ps - pt).abs().sum(-1)
    raise ValueError(name)


def simct_loss(samples, s_head, t_head, s_ids, t_ids, *, mode="raw_logit", divergence_name="rkl",
               temperature=1.0, gh_mask=False):
    """Σ over samples and segments of the per-row divergence (not normalised).

    samples: list of dicts with t_labels, s_labels (ids incl. EOS), t_dec, s_dec (strings, EOS
    excluded), t_hidden [n_t + 1, H_T], s_hidden [n_s + 1, H_S] (torch tensors)."""
    total = torch.zeros((), dtype=torch.float32)
    rows = span_rows = kept = 0
    for smp in samples:
        zs = smp["s_hidden"].float() @ s_head.float()   # [n_s + 1, V_S]
        zt = smp["t_hidden"].float() @ t_head.float()
        lps, lpt = _log_softmax(zs), _log_softmax(zt)
        s_lab = torch.as_tensor(smp["s_labels"], dtype=torch.long)
        t_lab = torch.as_tensor(smp["t_labels"], dtype=torch.long)
        for ts, te, ss, se in walk(smp["t_dec"], smp["s_dec"]):
            span = (te - ts) > 1 or (se - ss) > 1
            if mode == "raw_logit":
                s_cols, t_cols = zs[ss, s_ids], zt[ts, t_ids]
                s_tok = zs[torch.arange(ss, se), s_lab[ss:se]]
                t_tok = zt[torch.arange(ts, te), t_lab[ts:te]]
            else:
                s_cols, t_cols = lps[ss, s_ids], lpt[ts, t_ids]
                s_tok = lps[torch.arange(ss, se), s_lab[ss:se]]
                t_tok = lpt[torch.arange(ts, te), t_lab[ts:te]]
            if span:
                s_extra, t_extra = s_tok.mean(), t_tok.mean()
            else:
                s_extra = t_extra = torch.tensor(-1e9)
            row_s = torch.cat([s_cols, s_extra.reshape(1)]) / temperature
            row_t = (torch.cat([t_cols, t_extra.reshape(1)]) / temperature).detach()
            keep = True
            if gh_mask:
                mass = lpt[ts, t_ids].exp().sum()
                if span:
                    mass = mass + lpt[torch.arange(ts, te), t_lab[ts:te]].mean().exp()
                keep = bool(torch.clamp(mass, max=1.0) >= 0.5)
            rows += 1
            span_rows += int(span)
            if keep:
                kept += 1
                total = total + divergence(divergence_name, _log_softmax(row_s), _log_softmax(row_t))
    return total, {"rows": rows, "span_rows": span_rows, "kept": kept}
