"""Shared test data for the strict-kernel tests: small random vocabularies and an overlap map."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
import torch_strict  # noqa: E402  (independent PyTorch reference)


@dataclass
class Case:
    zs: np.ndarray       # [R, V_S] student rows (already gathered)
    zt: np.ndarray       # [R, V_T] teacher rows (already gathered)
    s_ids: np.ndarray    # [V∩]
    t_ids: np.ndarray    # [V∩]
    w: np.ndarray        # [R] row weights (0 = padding row)


def make_case(rows=9, vs=57, vt=64, shared=40, seed=0, scale=2.0, ties=False, neg_inf=False,
              pad_rows=True):
    rng = np.random.default_rng(seed)
    s_ids = rng.permutation(vs)[:shared].astype(np.int32)
    t_ids = rng.permutation(vt)[:shared].astype(np.int32)
    zs = (rng.normal(size=(rows, vs)) * scale).astype(np.float32)
    zt = (rng.normal(size=(rows, vt)) * scale).astype(np.float32)
    if ties:  # few distinct values: many equal logits, also at the top-k boundary
        zs = np.round(zs / 2).astype(np.float32)
    if neg_inf:
        # Outside the shared vocabulary everything is -inf on both sides, and inside it the two
        # sides share a support that excludes a few shared columns per row.
        out_s = np.setdiff1d(np.arange(vs), s_ids)
        out_t = np.setdiff1d(np.arange(vt), t_ids)
        zs[:, out_s] = -np.inf
        zt[:, out_t] = -np.inf
        for r in range(rows):
            drop = rng.choice(shared, size=shared // 4, replace=False)
            zs[r, s_ids[drop]] = -np.inf
            zt[r, t_ids[drop]] = -np.inf
    w = np.ones(rows, np.float32)
    if pad_rows and rows > 2:
        w[rng.choice(rows, size=rows // 3, replace=False)] = 0.0
    return Case(zs, zt, s_ids, t_ids, w)


def torch_value_and_grad(case: Case, divergence: str, topk=None, **kw):
    """Σ_r w_r D_r and its gradient w.r.t. the student rows, from the PyTorch reference."""
    import torch
    zs = torch.tensor(case.zs, requires_grad=True)
    per_row = torch_strict.strict_rows(divergence, zs, torch.tensor(case.zt), case.s_ids,
                                       case.t_ids, topk=topk, **kw)
    w = torch.tensor(case.w)
    loss = torch.where(w != 0, per_row * w, torch.zeros(())).sum()
    loss.backward()
    return float(loss.detach()), zs.grad.numpy()


def assert_close(value, grad, ref_value, ref_grad, rtol=1e-5, atol=1e-6):
    """Value relative to itself; gradient entries relative to the largest reference entry."""
    value, grad = float(value), np.asarray(grad, np.float32)
    assert np.isfinite(ref_value), ref_value
    assert abs(value - ref_value) <= rtol * abs(ref_value) + atol, (value, ref_value)
    scale = max(float(np.abs(ref_grad).max()), 1e-30)
    err = float(np.abs(grad - ref_grad).max())
    assert err <= rtol * scale + atol, (err, scale)
