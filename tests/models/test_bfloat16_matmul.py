"""bfloat16 compute on the CPU: the projections' matmuls sum in float32, forward and backward.

`models/projection.py: project` takes `matmul_float32_sums` for bfloat16 inputs on the CPU (XLA
CPU runs a bfloat16 GEMM at its fast rate only when it accumulates into float32). References:
float64 numpy for the matmul and its gradient, HF torch autograd in float32 for a whole model's.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_fixtures import VARIANTS, save_hf
from ctopd_jax.models import weights
from ctopd_jax.models.projection import matmul_float32_sums, project


def bf16(a):
    return jnp.asarray(a, jnp.float32).astype(jnp.bfloat16)


def test_values_and_gradients_equal_float64_on_the_same_bfloat16_inputs():
    rng = np.random.RandomState(0)
    x, w, c = bf16(rng.randn(24, 40)), bf16(rng.randn(40, 56) / 6), rng.randn(24, 56)
    y = project(x, w)
    assert y.dtype == jnp.bfloat16
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    # float32 sums, one rounding to bfloat16 at the end: within a bfloat16 ulp (2^-8 relative)
    np.testing.assert_allclose(np.asarray(y, np.float64), x64 @ w64, rtol=2 ** -8, atol=1e-6)

    dx, dw = jax.grad(lambda x, w: jnp.sum(project(x, w).astype(jnp.float32) * c), argnums=(0, 1))(x, w)
    g = np.asarray(bf16(c), np.float64)   # the cotangent arrives rounded to the output's dtype
    assert dx.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx, np.float64), g @ w64.T, rtol=2 ** -8, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw, np.float64), x64.T @ g, rtol=2 ** -8, atol=1e-6)


def test_the_cpu_program_multiplies_bfloat16_into_float32_forward_and_backward():
    """The point of the path: every matmul of the projection and of its gradient takes bfloat16
    operands and gives float32 sums (jax's own gradient would upcast to float32 GEMMs)."""
    x, w = bf16(np.ones((8, 16))), bf16(np.ones((16, 32)))
    loss = lambda x, w: jnp.sum(project(x, w).astype(jnp.float32))   # noqa: E731
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    tensor = r"(tensor<[^>]*>)"
    dots = re.findall(rf"stablehlo\.dot_general.*?: \({tensor}, {tensor}\) -> {tensor}", text)
    assert len(dots) == 3, text
    for lhs, rhs, out in dots:
        assert lhs.endswith("xbf16>") and rhs.endswith("xbf16>") and out.endswith("xf32>"), (lhs, rhs, out)


def test_float32_inputs_keep_the_plain_matmul():
    x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8, 4), jnp.float32)
    assert "custom_vjp" not in str(jax.make_jaxpr(project)(x, w))
    assert "custom_vjp" in str(jax.make_jaxpr(matmul_float32_sums)(bf16(x), bf16(w)))


@pytest.mark.parametrize("name", ["llama_untied_llama3rope", "qwen2_tied_bias"])
def test_a_bfloat16_compute_model_has_torch_float32_gradients(name, tmp_path):
    """float32 master weights, bfloat16 compute: d(sum(c * logits)) at a few weights against
    torch's float32 autograd of the same model, within bfloat16's precision."""
    cfg = VARIANTS[name]()
    hf = save_hf(cfg, tmp_path)
    model, _ = weights.load_hf_checkpoint(tmp_path, dtype="bfloat16", param_dtype="float32")
    rng = np.random.RandomState(5)
    ids = rng.randint(0, cfg.vocab_size, (2, 8))
    c = rng.randn(2, 8, cfg.vocab_size).astype(np.float32)

    hf.zero_grad()
    (hf(torch.tensor(ids)).logits * torch.tensor(c)).sum().backward()
    hf_grads = {n: p.grad.numpy() for n, p in hf.named_parameters()}

    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    loss = lambda m: jnp.sum(m(jnp.asarray(ids, jnp.int32), pos) * c)   # noqa: E731
    grads = nnx.merge(nnx.graphdef(model), nnx.grad(loss)(model))
    ours = dict(weights.hf_named_tensors(grads, include_tied_lm_head=False))
    for hf_name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                    "model.layers.0.mlp.gate_proj.weight", "model.embed_tokens.weight"):
        got, want = np.asarray(ours[hf_name], np.float32), hf_grads[hf_name]
        assert got.dtype == np.float32
        # relative to the gradient's scale: bfloat16 keeps 8 bits, rounded at every layer
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max(), hf_name
        assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999, hf_name
