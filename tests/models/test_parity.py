"""Decoder vs HF transformers (PyTorch CPU) on tiny random configs, loaded by our loader."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_fixtures import VARIANTS, hf_logits, hf_model, jax_logits, save_hf, with_options
from ctopd_jax.models import weights
from ctopd_jax.models.decoder import apply_rope, rope_cos_sin, rope_inv_freq


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def loaded(request, tmp_path_factory):
    cfg = VARIANTS[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf(cfg, path)
    model, loaded_cfg = weights.load_hf_checkpoint(path)
    return request.param, cfg, hf, model, loaded_cfg, path


def test_loaded_config_matches_preset(loaded):
    _, cfg, _, _, loaded_cfg, _ = loaded
    assert loaded_cfg == cfg


@pytest.mark.parametrize("attention", ["einsum", "blockwise"])
def test_logits_match_hf_with_left_and_right_padding(loaded, attention):
    name, cfg, hf, model, _, _ = loaded
    # Blocks of 8 over 24 tokens: several query and key blocks, causal skipping included.
    model = with_options(model, attention=attention, attention_block=8)
    rng = np.random.RandomState(1)
    b, t = 3, 24
    ids = rng.randint(0, cfg.vocab_size, (b, t))
    mask = np.ones((b, t), bool)
    mask[1, :5] = False    # left padded
    mask[2, -7:] = False   # right padded
    # Offset positions past original_max_position_embeddings so every RoPE band matters.
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0) + 300
    ref = hf_logits(hf, ids, positions, mask)
    ours = jax_logits(model, ids, positions, mask)
    assert ours.dtype == np.float32
    assert np.abs(ref).max() > 0.5, "reference logits too small for a meaningful comparison"
    err = np.abs(ours - ref)[mask].max()
    assert err <= 1e-4, f"{name} ({attention}): max abs logits error {err}"


def test_hidden_states_times_lm_head_equals_logits(loaded):
    _, cfg, hf, model, _, _ = loaded
    ids = jnp.asarray(np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    hidden = model.hidden_states(ids, pos)
    assert hidden.shape == (2, 9, cfg.hidden_size)
    assert model.lm_head_weight().shape == (cfg.hidden_size, cfg.vocab_size)
    ref = hf_logits(hf, np.asarray(ids))
    np.testing.assert_allclose(np.asarray(hidden @ model.lm_head_weight()), ref, atol=1e-4)


def test_llama3_inv_freq_matches_transformers():
    cfg = VARIANTS["llama_untied_llama3rope"]()
    hf_cfg = hf_model(cfg).config
    ref, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    assert scaling == 1.0
    ours = rope_inv_freq(cfg)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    # The three regimes are all present, so the check covers the interpolation band.
    plain = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
    ratio = ours / plain
    assert np.isclose(ratio, 1.0).any() and np.isclose(ratio, 1 / 8).any()
    assert ((ratio < 0.99) & (ratio > 0.13)).any()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_matches_transformers_rotate_half(head_dim):
    """apply_rope (halves swapped by a flip, the sign in sin) against transformers' own
    apply_rotary_pos_emb (rotate_half by concatenation) at SmolLM2's and Qwen2.5-1.5B's head_dim."""
    cfg = dataclasses.replace(VARIANTS["qwen2_tied_bias"](), head_dim=head_dim)
    rng = np.random.default_rng(head_dim)
    x = rng.standard_normal((2, 7, 3, head_dim)).astype(np.float32)
    positions = rng.integers(0, 5000, (2, 7)).astype(np.int32)
    ours = apply_rope(jnp.asarray(x), *rope_cos_sin(cfg, jnp.asarray(positions)))
    angles = positions[..., None].astype(np.float32) * rope_inv_freq(cfg).astype(np.float32)   # as ours
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    q = torch.from_numpy(x).transpose(1, 2)   # [B, heads, T, D], transformers' layout
    ref, _ = apply_rotary_pos_emb(q, q, torch.from_numpy(np.cos(angles)).float(),
                                  torch.from_numpy(np.sin(angles)).float())
    np.testing.assert_allclose(np.asarray(ours), ref.transpose(1, 2).numpy(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name,scan", [("llama_untied_llama3rope", False),
                                       ("qwen2_tied_bias", False), ("qwen2_tied_bias", True)])
def test_gradients_match_torch_with_remat(name, scan, tmp_path):
    """Training needs gradients too: d(sum(w * logits)) w.r.t. a few weights vs torch autograd,
    with per-layer remat switched on (remat must not change values), unrolled or with the
    layers under lax.scan."""
    cfg = VARIANTS[name]()
    hf = save_hf(cfg, tmp_path)
    model, _ = weights.load_hf_checkpoint(tmp_path, remat=True)
    if scan:
        model = with_options(model, scan_layers=True, attention="blockwise", attention_block=4)
    rng = np.random.RandomState(3)
    ids = rng.randint(0, cfg.vocab_size, (2, 8))
    w = rng.randn(2, 8, cfg.vocab_size).astype(np.float32)

    hf.zero_grad()
    logits = hf(torch.tensor(ids)).logits
    (logits * torch.tensor(w)).sum().backward()
    hf_grads = {n: p.grad.numpy() for n, p in hf.named_parameters()}

    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    loss = lambda m: jnp.sum(m(jnp.asarray(ids, jnp.int32), pos) * w)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.grad(loss)(nnx.merge(nnx.graphdef(model), s)))(
        nnx.state(model)))
    remats = jaxpr.count("checkpoint") + jaxpr.count("remat")
    assert (remats >= 1 and "scan" in jaxpr) if scan else (remats >= cfg.num_layers)
    grads = nnx.grad(loss)(model)
    grad_model = nnx.merge(nnx.graphdef(model), grads)
    ours = dict(weights.hf_named_tensors(grad_model, include_tied_lm_head=False))
    for hf_name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                    "model.embed_tokens.weight", "model.norm.weight"):
        np.testing.assert_allclose(ours[hf_name], hf_grads[hf_name], atol=2e-4, rtol=1e-3,
                                   err_msg=f"{name}: {hf_name}")


def test_bfloat16_compute_close_to_fp32_reference(loaded):
    _, cfg, hf, _, _, path = loaded
    model, bcfg = weights.load_hf_checkpoint(path, dtype="bfloat16", param_dtype="float32")
    assert bcfg.compute_dtype == jnp.bfloat16
    ids = np.random.RandomState(4).randint(0, cfg.vocab_size, (2, 12))
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    ours = jax_logits(model, ids)
    ref = hf_logits(hf, ids)
    err = np.abs(ours - ref).max()
    assert err < 0.1 * np.abs(ref).max(), err
    leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    assert leaf.dtype == jnp.float32
