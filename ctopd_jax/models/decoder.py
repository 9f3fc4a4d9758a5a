"""One Flax NNX decoder for Llama-3.x and Qwen2/2.5.

GQA attention, RMSNorm, SwiGLU MLP, rotate-half RoPE (optionally with "llama3" frequency
scaling), optional q/k/v bias (Qwen2), tied or untied embeddings.

Decisions:
- Parameters are stored in ``cfg.param_dtype`` and cast to ``cfg.dtype`` where they are used;
  RMSNorm statistics, RoPE angles and the attention softmax are computed in float32. Logits are
  returned in float32 (the lm_head matmul accumulates in float32).
- Every parameter carries its logical axis names in the flax ``out_sharding`` metadata
  (``eager_sharding=False`` so creation never needs a mesh); ``ctopd_jax.mesh.device_mesh.shard_module`` or
  ``nnx.get_partition_spec`` under ``nnx.logical_axis_rules`` turn them into shardings.
- Kernels keep the head structure ([H, heads, head_dim]) so heads can be sharded on "tensor"
  without reshapes; weights.py owns the mapping to HF's flat [out, in] matrices.
- Activation sharding: under ``jax.set_mesh(mesh)`` (a mesh with the ctopd_jax axis names) the
  residual stream, q/k/v, the MLP hidden and the logits are constrained to their logical shardings
  (batch over data+fsdp, heads / mlp / vocab over tensor). Without a mesh context nothing is
  constrained and the compiler propagates from the parameter shardings, which for FSDP may choose
  to gather the batch instead of the weights.
- Attention never sees a [T, S] mask: an ``AttentionMask`` (query slots + valid key slots) goes to
  the implementation chosen by ``cfg.attention`` (attention.py). Rows with nothing to attend to
  (left pads) give finite values, never NaN; those rows are never used.
- Remat: ``cfg.layer_remat_policy`` wraps each layer in ``jax.checkpoint``. XLA CPU ignores that on
  unrolled layers (measured: same temporaries with and without) but honours it inside ``lax.scan``,
  so the memory path is ``scan_layers=True``. The stored parameter tree stays one module per layer
  (weights.py, checkpoints, optimizer state and sharding rules all key on ``layers.{i}``); the scan
  stacks the layer parameters at call time instead, which costs one extra copy of the layer weights
  (and of their gradient) per step. The KV-cache path always runs unrolled: decoding is not memory
  bound on activations.
- ``mlp_chunk``: with blockwise attention and remat, the largest term of one layer's backward is
  the MLP's [B, T, intermediate] set; running the MLP over sequence chunks, each rematerialised,
  bounds it (measured numbers: benchmarks/RESULTS.md, "Attention").
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.kernels.paged_attention import api as paged_attention
from ctopd_jax.mesh.device_mesh import LOGICAL_RULES, logical_spec
from ctopd_jax.models.attention import AttentionMask, attend, resolve_implementation
from ctopd_jax.models.config import ModelConfig
from ctopd_jax.models.kv_cache import PagedKVCache
from ctopd_jax.models.lora import TARGETS, add_lora_path, lora_weight
from ctopd_jax.models.projection import project

INIT_STD = 0.02


def _param(rngs: nnx.Rngs, shape, axes, dtype, init="normal") -> nnx.Param:
    """A parameter drawn from `init` ("normal": N(0, INIT_STD) in float32, "ones", "zeros"); the
    name is kept as metadata so models/init.py can draw the same distribution tensor by tensor."""
    if init == "normal":
        value = jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=tuple(axes), eager_sharding=False,
                     init=init)


def constrain(x: jax.Array, logical_axes) -> jax.Array:
    """Sharding constraint from logical axis names when a matching mesh context is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not all(a in mesh.axis_names for r in LOGICAL_RULES.values() for a in r):
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(mesh, logical_axes, x.shape))


# ---------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2], with the "llama3" piecewise rescaling when configured.

    llama3 scaling: wavelengths longer than original_len/low_freq_factor are divided by
    `factor`, shorter than original_len/high_freq_factor are kept, and the band in between is
    interpolated linearly in original_len/wavelength.
    """
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = cfg.rope_scaling_dict
    if scaling is not None:
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        orig = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - low) / (high - low)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = np.where(wavelen > orig / low, inv_freq / factor,
                            np.where(wavelen < orig / high, inv_freq, interpolated))
    return inv_freq.astype(np.float32)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array):
    """cos, sin [B, T, head_dim] in float32 for integer positions [B, T]; sin's first half is
    negated, the sign of the rotate-half convention (apply_rope)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    angles = jnp.concatenate([angles, angles], axis=-1)
    half = angles.shape[-1] // 2
    sign = jnp.asarray(np.repeat(np.array([-1.0, 1.0], np.float32), half))
    return jnp.cos(angles), jnp.sin(angles) * sign


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, D]; rotate-half convention (the HF Llama/Qwen2 layout): x·cos + [-x₂, x₁]·sin,
    written as the halves swapped by a flip with the sign carried by `sin` (rope_cos_sin). The
    same values, bit for bit, as concatenating [-x₂, x₁]; but XLA CPU compiled that concatenation
    slowly at head_dim 128 (Qwen2.5-1.5B's whole teacher forward: 5.0 s, now 0.9 s;
    benchmarks/RESULTS.md)."""
    halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    swapped = jnp.flip(halves, axis=-2).reshape(x.shape)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + swapped * sin


# ---------------------------------------------------------------------- blocks
class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, param_dtype, *, rngs: nnx.Rngs):
        self.scale = _param(rngs, (size,), (None,), param_dtype, init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed.astype(x.dtype) * self.scale[...].astype(x.dtype))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, nq, nkv, d, pd = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.params_dtype)
        self.q_proj = _param(rngs, (h, nq, d), ("embed", "q_heads", "head_dim"), pd)
        self.k_proj = _param(rngs, (h, nkv, d), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = _param(rngs, (h, nkv, d), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = _param(rngs, (nq, d, h), ("q_heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, (nq, d), ("q_heads", "head_dim"), pd, init="zeros")
            self.k_bias = _param(rngs, (nkv, d), ("kv_heads", "head_dim"), pd, init="zeros")
            self.v_bias = _param(rngs, (nkv, d), ("kv_heads", "head_dim"), pd, init="zeros")
        self.qkv_bias = cfg.qkv_bias
        self.dtype = cfg.compute_dtype
        self.implementation = cfg.attention
        self.block, self.packed_block = cfg.attention_block, cfg.packed_attention_block
        # keys over which `auto` attends by einsum: its [B, heads, T, keys] probabilities no
        # larger than this layer's MLP activation [B, T, intermediate]
        self.einsum_keys = cfg.intermediate_size // nq

    def __call__(self, x, cos, sin, mask: AttentionMask, cache: PagedKVCache | None = None,
                 layer: int = 0, dropout=None):
        """`dropout`: the layer's LoRA dropout (lora.Dropout) in a training forward, else None."""
        dt, dr = self.dtype, dropout
        q = add_lora_path(self, "q_proj", x, project(x, lora_weight(self, "q_proj", dt, dr)), dr)
        k = add_lora_path(self, "k_proj", x, project(x, lora_weight(self, "k_proj", dt, dr)), dr)
        v = add_lora_path(self, "v_proj", x, project(x, lora_weight(self, "v_proj", dt, dr)), dr)
        if self.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        q = constrain(apply_rope(q, cos, sin), ("batch", None, "q_heads", None))
        k = constrain(apply_rope(k, cos, sin), ("batch", None, "kv_heads", None))
        v = constrain(v, ("batch", None, "kv_heads", None))
        if isinstance(cache, PagedKVCache):
            out, cache = self._paged(q, k, v, mask, cache, layer)
            o = project(out, lora_weight(self, "o_proj", dt, dr), 2)
            return add_lora_path(self, "o_proj", out, o, dr), cache
        implementation = resolve_implementation(self.implementation, dt, False, k.shape[1], self.einsum_keys)
        out = attend(q, k, v, mask, implementation, self.block, self.block, self.packed_block)
        o = project(out, lora_weight(self, "o_proj", dt, dr), 2)
        return add_lora_path(self, "o_proj", out, o, dr), cache

    def _paged(self, q, k, v, mask: AttentionMask, cache: PagedKVCache, layer: int):
        """Write the new tokens into their pages (kv_cache.py, PagedKVCache), then attend: a
        prefill (T > 1) over its own tokens, a decode step over the row's valid pages."""
        b, t = q.shape[:2]
        page, pages = cache.page_size, cache.k[layer].shape[1]
        at = cache.write_at                                      # [B, T], -1 = not written
        col = jnp.clip(at // page, 0, cache.page_table.shape[1] - 1)
        dest = jnp.where(at >= 0, jnp.take_along_axis(cache.page_table, col, axis=1), pages)
        # pool[:, dest, offset] is [Hkv, B, T, D]
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        k_pool = k_pool.at[:, dest, at % page].set(
            jnp.moveaxis(k, 2, 0).astype(k_pool.dtype), mode="drop")
        v_pool = v_pool.at[:, dest, at % page].set(
            jnp.moveaxis(v, 2, 0).astype(v_pool.dtype), mode="drop")
        swap = lambda pools, new: pools[:layer] + (new,) + pools[layer + 1:]  # noqa: E731
        cache = cache._replace(k=swap(cache.k, k_pool), v=swap(cache.v, v_pool))
        if t > 1:
            implementation = resolve_implementation(self.implementation, self.dtype, False, k.shape[1],
                                                    self.einsum_keys)
            return attend(q, k, v, mask, implementation, self.block, self.block), cache
        out = paged_attention.decode_attention(q[:, 0], k_pool.astype(self.dtype),
                                               v_pool.astype(self.dtype),
                                               cache.page_table, cache.lengths)
        return out[:, None], cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, i, pd = cfg.hidden_size, cfg.intermediate_size, cfg.params_dtype
        self.gate_proj = _param(rngs, (h, i), ("embed", "mlp"), pd)
        self.up_proj = _param(rngs, (h, i), ("embed", "mlp"), pd)
        self.down_proj = _param(rngs, (i, h), ("mlp", "embed"), pd)
        self.dtype = cfg.compute_dtype
        self.chunk = cfg.mlp_chunk

    def __call__(self, x, dropout=None):
        """`dropout`: the layer's LoRA dropout (lora.Dropout) in a training forward, else None."""
        dt = self.dtype
        gate_w = lora_weight(self, "gate_proj", dt, dropout)
        up_w = lora_weight(self, "up_proj", dt, dropout)
        down_w = lora_weight(self, "down_proj", dt, dropout)

        def mlp(x, dr=dropout):
            gate = add_lora_path(self, "gate_proj", x, project(x, gate_w), dr)
            up = add_lora_path(self, "up_proj", x, project(x, up_w), dr)
            hidden = constrain(jax.nn.silu(gate) * up, ("batch", None, "mlp"))
            return add_lora_path(self, "down_proj", hidden, project(hidden, down_w), dr)

        b, t, h = x.shape
        if not self.chunk or t <= self.chunk:
            return mlp(x)
        # The MLP is per token, so chunks of the sequence are independent; checkpointing each
        # one bounds the backward's [B, chunk, intermediate] working set, the largest term of
        # a layer's backward once attention is blockwise.  The length axis is never sharded.
        n = -(-t // self.chunk)
        xs = jnp.pad(x, ((0, 0), (0, n * self.chunk - t), (0, 0)))
        xs = xs.reshape(b, n, self.chunk, h).swapaxes(0, 1)
        if dropout is None:
            ys = jax.lax.map(jax.checkpoint(mlp, prevent_cse=False), xs)
        else:  # chunk c's masks: the layer's dropout folded with len(TARGETS) + c
            chunk = lambda xc: mlp(xc[0], dropout.fold(len(TARGETS) + xc[1]))  # noqa: E731
            ys = jax.lax.map(jax.checkpoint(chunk, prevent_cse=False),
                             (xs, jnp.arange(n, dtype=jnp.int32)))
        return ys.swapaxes(0, 1).reshape(b, n * self.chunk, h)[:, :t]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.params_dtype, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.params_dtype,
                                      rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        self.remat_blocks = cfg.layer_remat_policy == "blocks"

    def __call__(self, x, cos, sin, mask, cache=None, layer=0, dropout=None):
        if self.remat_blocks and cache is None:
            return self._remat_blocks(x, cos, sin, mask, dropout), None
        attn_out, cache = self.attn(self.input_norm(x), cos, sin, mask, cache, layer, dropout)
        x = constrain(x + attn_out, ("batch", None, None))
        x = constrain(x + self.mlp(self.post_attn_norm(x), dropout), ("batch", None, None))
        return x, cache

    def _remat_blocks(self, x, cos, sin, mask, dropout=None):
        """The same layer with the attention and MLP halves each rematerialised, so the layer's
        backward holds one half's intermediates at a time, not both halves'."""
        def attn_half(norm, attn, x, dropout):
            return attn(norm(x), cos, sin, mask, dropout=dropout)[0]

        def mlp_half(norm, mlp, x, dropout):
            return mlp(norm(x), dropout)

        x = constrain(x + nnx.remat(attn_half)(self.input_norm, self.attn, x, dropout),
                      ("batch", None, None))
        return constrain(x + nnx.remat(mlp_half)(self.post_attn_norm, self.mlp, x, dropout),
                         ("batch", None, None))


def _layer_no_cache(layer: DecoderLayer, x, cos, sin, mask, dropout=None):
    return layer(x, cos, sin, mask, dropout=dropout)[0]


def checkpoint_policy(name: str):
    """jax.checkpoint policy for a REMAT_POLICIES name other than "none"."""
    if name in ("full", "blocks"):
        return None  # save nothing but the function's inputs
    return getattr(jax.checkpoint_policies, name)


class Decoder(nnx.Module):
    """Causal LM: ``model(input_ids, positions, attention_mask=None, cache=None)``.

    - ``input_ids``, ``positions``: int32 [B, T]. ``attention_mask``: bool [B, T], True on real
      tokens (pads may be on the left or the right); None means all real. Or int32 [B, T]
      segment ids of packed rows (0 on pads; ``positions`` restart at each segment, see
      attention.prefill_positions), so no token attends across samples.
    - Returns float32 logits [B, T, V]; with a ``PagedKVCache`` (the sampler's) returns
      ``(logits, new_cache)`` (see ``kv_cache.py`` for the cache contract).
    - ``hidden_states(...)`` returns the final-normed hidden [B, T, H] (compute dtype) and
      ``lm_head_weight()`` the [H, V] projection (the embedding transposed when tied), so a loss
      can apply the lm_head chunk by chunk.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.params_dtype
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd)

    def lm_head_weight(self) -> jax.Array:
        """[H, V] in the parameter dtype."""
        if self.cfg.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def hidden_states(self, input_ids, positions, attention_mask=None, cache=None,
                      lora_dropout=None):
        """`lora_dropout` (lora.Dropout): LoRA dropout, given by the student's training forward
        only (step.grad); layer i uses it folded with i.  Not with a cache."""
        cfg = self.cfg
        if lora_dropout is not None and cache is not None:
            raise ValueError("hidden_states: lora_dropout is for the training forward (no cache)")
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.bool_)
        # an integer mask holds packed rows' segment ids (0 on pads): attention stays inside one
        segments = None if attention_mask.dtype == jnp.bool_ else attention_mask.astype(jnp.int32)
        if segments is not None and cache is not None:
            raise ValueError("hidden_states: packed rows (segment ids) are for the no-cache forward")
        attention_mask = attention_mask.astype(jnp.bool_)
        # Gather the table over fsdp first (as for every FSDP weight), keeping vocab sharded:
        # a lookup into a table sharded on both axes makes the partitioner replicate it.
        table = constrain(self.embed[...], ("vocab", None))
        x = jnp.take(table, input_ids, axis=0).astype(cfg.compute_dtype)
        x = constrain(x, ("batch", None, None))
        cos, sin = rope_cos_sin(cfg, positions)

        if cache is None:
            mask = AttentionMask(jnp.arange(t, dtype=jnp.int32), attention_mask, segments)
            policy = cfg.layer_remat_policy
            if cfg.scan_layers:
                x = self._scan_layers(x, cos, sin, mask, policy, lora_dropout)
            else:
                step = (_layer_no_cache if policy == "none" else
                        nnx.remat(_layer_no_cache, policy=checkpoint_policy(policy)))
                for i, layer in enumerate(self.layers):
                    x = step(layer, x, cos, sin, mask,
                             None if lora_dropout is None else lora_dropout.fold(i))
            return self.final_norm(x)

        written = attention_mask.sum(axis=1, dtype=jnp.int32)
        cache = cache._replace(lengths=cache.lengths + written,
                               write_at=jnp.where(attention_mask, positions, -1))
        mask = AttentionMask(jnp.arange(t, dtype=jnp.int32), attention_mask)
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, cos, sin, mask, cache, i)
        return self.final_norm(x), cache._replace(write_at=None)

    def _scan_layers(self, x, cos, sin, mask, policy: str, dropout=None):
        """All layers under one lax.scan over parameters stacked here (see module docstring)."""
        graphdef = nnx.graphdef(self.layers[0])
        states = [nnx.state(layer) for layer in self.layers]
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

        def body(h, layer_state):
            drop = None
            if dropout is not None:  # layer i's dropout, as in the unrolled loop
                layer_state, i = layer_state
                drop = dropout.fold(i)
            layer = nnx.merge(graphdef, layer_state)
            return _layer_no_cache(layer, h, cos, sin, mask, drop), None

        if policy != "none":
            # Inside scan the recomputation cannot be CSE'd away, so no barrier is needed.
            body = jax.checkpoint(body, policy=checkpoint_policy(policy), prevent_cse=False)
        if dropout is not None:
            stacked = (stacked, jnp.arange(len(self.layers), dtype=jnp.int32))
        x, _ = jax.lax.scan(body, x, stacked)
        return x

    def logits(self, hidden):
        """float32 logits [B, T, V] of final hidden states [B, T, H]. A prefill asks for its last
        position only: the full [slots, prompt, V] rows of 64 x 2,048 prompts are 62.6 GiB."""
        w = self.lm_head_weight().astype(self.cfg.compute_dtype)
        logits = jnp.einsum("bth,hv->btv", hidden, w, preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", None, "vocab"))

    def __call__(self, input_ids, positions, attention_mask=None, cache=None):
        out = self.hidden_states(input_ids, positions, attention_mask, cache)
        hidden, new_cache = (out, None) if cache is None else out
        logits = self.logits(hidden)
        return logits if cache is None else (logits, new_cache)
