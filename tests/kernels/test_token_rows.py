"""token_rows (realised-token log-prob and logsumexp over the full vocabulary, with its
recomputing custom VJP) against the independent PyTorch reference under torch autograd: values
and gradients w.r.t. hidden and lm_head under per-row cotangents on BOTH outputs, for the chunked
XLA path (chunk sizes that do and do not divide the rows, one chunk, one row per chunk) and the
plain-autodiff reference path, in float32 and with bfloat16 hidden states."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ctopd_jax.kernels.token_rows import token_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
import torch_span  # noqa: E402  (independent PyTorch reference)

R, H, V = 12, 16, 97


def _case(seed=0, rows=R):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(rows, H)).astype(np.float32)
    lm_head = (rng.normal(size=(H, V)) * 0.7).astype(np.float32)
    targets = rng.integers(0, V, size=rows).astype(np.int32)
    c = rng.normal(size=rows).astype(np.float32)      # cotangent on logprob
    d = rng.normal(size=rows).astype(np.float32)      # cotangent on logsumexp
    groups = rng.integers(0, 4, size=rows)            # span-like groups of rows
    anchor = rng.normal(size=4).astype(np.float32) - 3.0
    return hidden, lm_head, targets, c, d, groups, anchor


def _linear_loss(lp, lse, c, d):
    return (c * lp).sum() + (d * lse).sum()


def _span_like_loss(lp, lse, groups, anchor, xp):
    """Σ_g (Σ_{r∈g} lp_r − a_g)² + 0.1·Σ lse²: a different cotangent on every row of both outputs."""
    total = 0.0
    for g in range(len(anchor)):
        sel = groups == g
        total = total + (lp[xp(np.flatnonzero(sel))].sum() - float(anchor[g])) ** 2
    return total + 0.1 * (lse ** 2).sum()


def _torch(hidden, lm_head, targets, loss_kind, c, d, groups, anchor, temperature, bf16):
    h = torch.tensor(hidden, requires_grad=True)
    w = torch.tensor(lm_head, requires_grad=True)
    # bf16 path: the kernel multiplies bf16 hidden rows by the bf16-rounded lm_head with float32
    # accumulation; products of two bf16 numbers are exact in float32, so the reference rounds
    # the inputs and then computes in float32 (the casts pass the gradient straight through).
    h_in = h.bfloat16().float() if bf16 else h
    w_in = w.bfloat16().float() if bf16 else w
    lp, lse = torch_span.token_rows(h_in, w_in, targets, temperature)
    if loss_kind == "linear":
        loss = _linear_loss(lp, lse, torch.tensor(c), torch.tensor(d))
    else:
        loss = _span_like_loss(lp, lse, groups, anchor, lambda i: torch.as_tensor(i, dtype=torch.long))
    loss.backward()
    return lp.detach().numpy(), lse.detach().numpy(), float(loss.detach()), h.grad.numpy(), w.grad.numpy()


def _jax(hidden, lm_head, targets, loss_kind, c, d, groups, anchor, temperature, bf16, impl, chunk):
    h = jnp.asarray(hidden, jnp.bfloat16 if bf16 else jnp.float32)
    w = jnp.asarray(lm_head)

    def f(h, w):
        lp, lse = token_rows(h, w, jnp.asarray(targets), temperature=temperature, chunk_rows=chunk,
                             implementation=impl)
        if loss_kind == "linear":
            loss = _linear_loss(lp, lse, jnp.asarray(c), jnp.asarray(d))
        else:
            loss = _span_like_loss(lp, lse, groups, anchor, jnp.asarray)
        return loss, (lp, lse)

    (loss, (lp, lse)), (gh, gw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)
    assert lp.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert gh.dtype == h.dtype and gw.dtype == w.dtype
    return (np.asarray(lp), np.asarray(lse), float(loss), np.asarray(gh, np.float32),
            np.asarray(gw, np.float32))


def _check_float32(impl, chunk, loss_kind, temperature):
    case = _case(seed=chunk)
    ref = _torch(*case[:3], loss_kind, *case[3:], temperature, False)
    out = _jax(*case[:3], loss_kind, *case[3:], temperature, False, impl, chunk)
    for name, got, want in zip(("logprob", "logsumexp", "loss", "d hidden", "d lm_head"), out, ref):
        # float32 rounding, relative to the largest entry (the squared loss has gradients ~1e2)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * (1 + np.abs(want).max()),
                                   err_msg=name)
    # the case is not degenerate: every row has its own non-zero gradient
    assert np.all(np.abs(ref[3]).sum(axis=1) > 1e-3)


@pytest.mark.parametrize("impl,chunk,loss_kind,temperature", [
    ("xla", 5, "span_like", 1.0),      # 12 rows = 2 chunks of 5 + a tail of 2
    ("xla", 4, "linear", 0.7),         # 3 full chunks, no tail
    ("reference", 2048, "span_like", 0.7),
])
def test_float32_values_and_gradients_match_torch(impl, chunk, loss_kind, temperature):
    _check_float32(impl, chunk, loss_kind, temperature)


@pytest.mark.slow
@pytest.mark.parametrize("impl,chunk", [("xla", 4), ("xla", 5), ("xla", 12), ("xla", 1),
                                        ("xla", 2048), ("reference", 2048)])
@pytest.mark.parametrize("loss_kind", ["linear", "span_like"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float32_grid_matches_torch(impl, chunk, loss_kind, temperature):
    _check_float32(impl, chunk, loss_kind, temperature)


@pytest.mark.parametrize("impl,chunk,loss_kind", [
    ("xla", 5, "span_like"),
    pytest.param("xla", 4, "linear", marks=pytest.mark.slow),
    pytest.param("reference", 2048, "span_like", marks=pytest.mark.slow),
    pytest.param("reference", 2048, "linear", marks=pytest.mark.slow),
])
def test_bf16_hidden_matches_torch_on_rounded_inputs(impl, chunk, loss_kind):
    case = _case(seed=10 + chunk)
    ref = _torch(*case[:3], loss_kind, *case[3:], 1.0, True)
    out = _jax(*case[:3], loss_kind, *case[3:], 1.0, True, impl, chunk)
    # forward: float32 accumulation of exact bf16 products -> float32 rounding only
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-4, atol=1e-4, err_msg="logprob")
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-4, atol=1e-4, err_msg="logsumexp")
    # backward: dz is rounded to bf16 before the matmuls (8 mantissa bits)
    for name, got, want in (("d hidden", out[3], ref[3]), ("d lm_head", out[4], ref[4])):
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * scale, err_msg=name)
        cos = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
        assert cos > 0.9999, (name, cos)


def test_chunking_changes_no_row_value():
    """Row chunking changes no row's value (each row's softmax is independent of the chunk)."""
    h, w, y = (jnp.asarray(a) for a in _case(seed=3)[:3])
    rows = jax.jit(token_rows, static_argnames=("chunk_rows",))
    whole = rows(h, w, y, chunk_rows=R)
    for chunk in (1, 5, 7):
        parts = rows(h, w, y, chunk_rows=chunk)
        np.testing.assert_allclose(np.asarray(parts[0]), np.asarray(whole[0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(parts[1]), np.asarray(whole[1]), rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_rejected_with_a_named_field():
    h, w, y = (jnp.asarray(a) for a in _case(seed=4)[:3])
    with pytest.raises(ValueError, match="implementation"):
        token_rows(h, w, y, implementation="cuda")
    with pytest.raises(ValueError, match="targets"):
        token_rows(h, w, y[:-1])
    with pytest.raises(ValueError, match="chunk_rows"):
        token_rows(h, w, y, chunk_rows=0)
    with pytest.raises(ValueError, match="disagree"):
        token_rows(h[:, :-1], w, y)
