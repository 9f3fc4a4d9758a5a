"""Independent PyTorch reference for the same-tokenizer OPD family (SPEC §9) and the §5 `jsd`
it relates to. Written from docs/spec.md only; it shares no code with ctopd_jax.

All functions take logits [R, V] (float64 or float32 tensors) and work per row over the full
vocabulary, with log-softmax of logits / τ.
"""
from __future__ import annotations

import math

import torch


def log_probs(logits, temperature: float = 1.0):
    return torch.log_softmax(logits / temperature, dim=-1)


def kl(log_p, log_q):
    """Σ p (log p − log q) per row, 0·log 0 = 0."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def gkd_jsd(s_logits, t_logits, beta: float, temperature: float = 1.0):
    """GKD's generalised JSD per row, β weighting the TEACHER: M = β p_T + (1−β) p_S,
    JSD = β KL(p_T‖M) + (1−β) KL(p_S‖M); β = 0 → KL(p_T‖p_S), β = 1 → KL(p_S‖p_T)."""
    ls, lt = log_probs(s_logits, temperature), log_probs(t_logits, temperature)
    if beta == 0.0:
        return kl(lt, ls)
    if beta == 1.0:
        return kl(ls, lt)
    m = beta * lt.exp() + (1 - beta) * ls.exp()
    log_m = m.log()
    return beta * kl(lt, log_m) + (1 - beta) * kl(ls, log_m)


def kdflow_jsd(s_logits, t_logits, b: float, temperature: float = 1.0):
    """SPEC §5 `jsd`: log M = logaddexp(log p_S + log b, log p_T + log(1−b));
    b KL(p_S‖M) + (1−b) KL(p_T‖M)."""
    ls, lt = log_probs(s_logits, temperature), log_probs(t_logits, temperature)
    log_m = torch.logaddexp(ls + math.log(b), lt + math.log(1 - b))
    return b * kl(ls, log_m) + (1 - b) * kl(lt, log_m)


def reverse_kl(s_logits, t_logits, temperature: float = 1.0):
    return kl(log_probs(s_logits, temperature), log_probs(t_logits, temperature))


def opd_sampled(s_logits, t_logits, targets, old, clip: str = "none", eps: float = 0.2,
                low: float = 0.5, high: float = 2.0, baseline=None):
    """Σ_t of the sampled OPD surrogate: −(π_θ/π_old)·A, A = stop_grad(log π_T(y) − old [+ baseline]);
    ppo: −min(rA, clip(r, 1−ε, 1+ε)A); icepop: tokens with r outside [low, high] masked."""
    y = torch.as_tensor(targets, dtype=torch.long).view(-1, 1)
    lp = log_probs(s_logits).gather(-1, y)[:, 0]
    lt = log_probs(t_logits).gather(-1, y)[:, 0].detach()
    adv = (lt - old).detach()
    if baseline is not None:
        adv = adv + baseline.detach()
    r = torch.exp(lp - old)
    if clip == "ppo":
        return -torch.minimum(r * adv, torch.clamp(r, 1 - eps, 1 + eps) * adv).sum()
    if clip == "icepop":
        keep = ((r.detach() >= low) & (r.detach() <= high)).to(r.dtype)
        return -(keep * r * adv).sum()
    return -(r * adv).sum()


def vopd_advantages(s_logits, t_logits):
    """[R, V] advantages of every token under the full KL baseline: log p_T − log p_S + KL."""
    ls, lt = log_probs(s_logits), log_probs(t_logits)
    return lt - ls + kl(ls, lt)[:, None]


def opd2_advantages(s_logits, t_logits, b_logits, targets, k: int, temperature: float = 1.0,
                    disagree: str = "drop"):
    """Gated A_t of OPD² (before the reward scale): centred over the student's top-k with the
    student's probabilities renormalised there; where the signs differ, 0 ("drop") or A^OPD ("opd")."""
    ls, lt, lb = (log_probs(z, temperature) for z in (s_logits, t_logits, b_logits))
    idx = torch.topk(ls, k, dim=-1).indices
    q = torch.softmax(ls.gather(-1, idx), dim=-1)
    r_opd, r_delta = lt - ls, lt - lb
    c_opd = (q * r_opd.gather(-1, idx)).sum(-1)
    c_delta = (q * r_delta.gather(-1, idx)).sum(-1)
    y = torch.as_tensor(targets, dtype=torch.long).view(-1, 1)
    a_opd = r_opd.gather(-1, y)[:, 0] - c_opd
    a_delta = r_delta.gather(-1, y)[:, 0] - c_delta
    return torch.where(a_opd * a_delta > 0, a_delta, torch.zeros_like(a_delta) if disagree == "drop" else a_opd)


def opd2_loss(s_logits, t_logits, b_logits, targets, k: int, scale: float, temperature: float,
              disagree: str = "drop"):
    """−Σ_t stop_grad(s·A_t) log π_θ(y_t) (softmaxes at `temperature`)."""
    adv = opd2_advantages(s_logits.detach(), t_logits, b_logits, targets, k, temperature, disagree)
    y = torch.as_tensor(targets, dtype=torch.long).view(-1, 1)
    lp = log_probs(s_logits, temperature).gather(-1, y)[:, 0]
    return -(scale * adv.detach() * lp).sum()
