"""LoRA adapters on the Decoder's projections, in PEFT's convention and file format.

A projection W (NNX layout: [in dims..., out dims...], see weights.NAME_TABLE ``in_dims``) gets
two factors ``A [in dims..., r]`` and ``B [r, out dims...]`` stored next to it as
``<name>_lora_a`` / ``<name>_lora_b`` (`LoraParam`, a subclass of nnx.Param), and the layer
uses ``W + (alpha / r) * A @ B`` (`lora_weight`).

Decisions:
- PEFT computes ``W x + s * B(A(dropout(x)))``.  Without dropout (every forward but the
  training one, and all of them at `lora.dropout` 0) we fold the delta into the weight inside
  the forward (same function, same gradients up to float rounding, one [in, out] temporary per
  projection like the cast of W itself).
- Dropout (`lora.dropout` > 0) exists only in the student's training forward
  (step.grad.micro_grad): a `Dropout` (key + rate) handed to
  ``Decoder.hidden_states(..., lora_dropout=)``; the adapted projections then compute
  ``x W + s * (dropout(x) A) B`` (`lora_weight` leaves the delta out of W and
  `add_lora_path` adds it on the output).  Rollouts, teacher scoring, evaluation, diagnostics
  and log-prob recomputation never pass one.  Masks: inverted dropout as torch's
  (kept entries scaled by 1 / (1 - p)); one independent mask per (micro-batch, layer,
  projection) from the key folded with the layer index and the projection's index in
  TARGETS (with `mlp_chunk`, MLP masks are drawn per sequence chunk).  The trainer derives the
  key of each micro-batch from the iteration's split of its checkpointed RNG key and the
  micro-batch's first sample index (`train_dropout`), so a resumed run stays bit-exact.
- Initialisation as PEFT's default: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming-uniform
  with a = sqrt(5)), B = 0, so a fresh adapter leaves the model unchanged.
- The trainable split is `trainable_filter(config)`: with rank > 0 only LoraParam variables
  are trained; the base weights stay in the frozen remainder and never reach the optimizer.
- Files: ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's key names
  (``base_model.model.<hf module>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]), so
  ``peft.PeftModel.from_pretrained(hf_base, folder)`` loads them unchanged; `load_adapter`
  reads such a folder (written by us or by PEFT) into an attached model.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from ctopd_jax.common.run_dir import replaced_folder
from ctopd_jax.mesh.device_mesh import logical_sharding, variable_logical_axes
from ctopd_jax.models.config import ModelConfigError


# projection name -> (sub-module of DecoderLayer, number of leading input dims of the kernel)
TARGETS = {"q_proj": ("attn", 1), "k_proj": ("attn", 1), "v_proj": ("attn", 1),
           "o_proj": ("attn", 2), "gate_proj": ("mlp", 1), "up_proj": ("mlp", 1),
           "down_proj": ("mlp", 1)}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraParam(nnx.Param):
    """A LoRA factor: the only trainable variables when `lora.rank` > 0."""


class LoraScale(nnx.Variable):
    """alpha / rank of a module's adapters: a (frozen) variable, not a static attribute, so it
    travels with the state into a Decoder built afresh and updated from it."""


class LoraError(ModelConfigError):
    """An adapter folder that does not fit the model or the `lora:` settings (message names it;
    a ModelConfigError, so the command line shows it as one line)."""


@jax.tree_util.register_pytree_node_class
class Dropout:
    """LoRA dropout of one training forward: `key` (raw uint32 key data, a pytree leaf, so it
    may be a numpy array or a tracer) and `rate` (static: the pytree's aux data)."""

    def __init__(self, key, rate: float):
        self.key, self.rate = key, float(rate)

    def tree_flatten(self):
        return (self.key,), self.rate

    @classmethod
    def tree_unflatten(cls, rate, children):
        return cls(children[0], rate)

    def fold(self, index) -> "Dropout":
        """The Dropout of a sub-part (a layer, a projection, a chunk) numbered `index`."""
        key = jax.random.fold_in(jax.random.wrap_key_data(self.key), index)
        return Dropout(jax.random.key_data(key), self.rate)

    def keep_mask(self, shape) -> jax.Array:
        """bool mask of the kept entries (each kept with probability 1 - rate)."""
        return jax.random.bernoulli(jax.random.wrap_key_data(self.key), 1.0 - self.rate, shape)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x with the dropped entries zeroed and the kept ones scaled by 1 / (1 - rate)."""
        scaled = x * jnp.asarray(1.0 / (1.0 - self.rate), x.dtype)
        return jnp.where(self.keep_mask(x.shape), scaled, jnp.zeros_like(x))


def train_dropout(config, key, index: int) -> Dropout | None:
    """The Dropout of micro-batch `index` of a training iteration whose dropout key is `key`
    (a typed key), or None without LoRA or at `lora.dropout` 0 (the folded forward)."""
    lo = config.lora
    if lo.rank == 0 or lo.dropout == 0:
        return None
    return Dropout(np.asarray(jax.random.key_data(jax.random.fold_in(key, index))), lo.dropout)


TARGET_INDEX = {name: i for i, name in enumerate(TARGETS)}


def lora_weight(module, name: str, dtype, dropout: Dropout | None = None) -> jax.Array:
    """The projection `name` of `module` in `dtype`, with its adapter delta when it has one
    (left out when `dropout` is given: `add_lora_path` then adds the adapter's path)."""
    w = getattr(module, name)[...].astype(dtype)
    a = getattr(module, name + "_lora_a", None)
    if a is None or dropout is not None:
        return w
    b = getattr(module, name + "_lora_b")
    delta = jnp.tensordot(a[...].astype(dtype), b[...].astype(dtype), axes=1)
    return w + (module.lora_scale[...] * delta).astype(dtype)


def add_lora_path(module, name: str, x: jax.Array, y: jax.Array,
                  dropout: Dropout | None) -> jax.Array:
    """`y` (= x W of projection `name`) plus the adapter's path s * (dropout(x) A) B when
    `dropout` is given and the projection has an adapter; `y` itself otherwise.  `dropout` is
    the layer's: the projection's own mask comes from folding in its TARGETS index."""
    a = getattr(module, name + "_lora_a", None)
    if a is None or dropout is None:
        return y
    in_dims = TARGETS[name][1]
    dropped = dropout.fold(TARGET_INDEX[name])(x)
    low = jnp.tensordot(dropped, a[...].astype(y.dtype), axes=in_dims)
    delta = jnp.tensordot(low, getattr(module, name + "_lora_b")[...].astype(y.dtype), axes=1)
    return y + (module.lora_scale[...] * delta).astype(y.dtype)


def trainable_filter(config):
    """The nnx filter of the trained variables: all parameters, or only the adapters."""
    return LoraParam if config.lora.rank > 0 else nnx.Param


def _sites(model):
    """(layer index, sub-module, projection name, in_dims) of every adaptable projection."""
    for i, layer in enumerate(model.layers):
        for name, (sub, in_dims) in TARGETS.items():
            yield i, getattr(layer, sub), name, in_dims


def has_adapters(model) -> bool:
    return any(hasattr(m, n + "_lora_a") for _, m, n, _ in _sites(model))


def _place_like(value: np.ndarray, base: jax.Array, axes):
    sharding = getattr(base, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.device_put(value, logical_sharding(sharding.mesh, axes, value.shape))
    return jax.device_put(value)


def attach(model, rank: int, alpha: float, target_modules, seed: int = 0):
    """Add fresh adapters (PEFT's init) to `model` in place and return it."""
    if has_adapters(model):
        raise LoraError("the model already has LoRA adapters")
    key = jax.random.key(seed)
    for index, (i, module, name, in_dims) in enumerate(_sites(model)):
        if name not in target_modules:
            continue
        var = getattr(module, name)
        w = var[...]
        axes = variable_logical_axes(var) or (None,) * w.ndim
        fan_in = math.prod(w.shape[:in_dims])
        bound = 1.0 / math.sqrt(fan_in)
        a = np.asarray(jax.random.uniform(jax.random.fold_in(key, index), (fan_in, rank),
                                          jnp.float32, -bound, bound))
        a = a.reshape(w.shape[:in_dims] + (rank,)).astype(w.dtype)
        b = np.zeros((rank,) + w.shape[in_dims:], w.dtype)
        a_axes, b_axes = tuple(axes[:in_dims]) + (None,), (None,) + tuple(axes[in_dims:])
        setattr(module, name + "_lora_a", LoraParam(_place_like(a, w, a_axes),
                                                    out_sharding=a_axes, eager_sharding=False))
        setattr(module, name + "_lora_b", LoraParam(_place_like(b, w, b_axes),
                                                    out_sharding=b_axes, eager_sharding=False))
        module.lora_scale = LoraScale(jnp.float32(float(alpha) / rank))
    return model


def prepare(model, config):
    """What `lora:` asks of the student: nothing at rank 0, else adapters attached (and loaded
    from `lora.init_adapter` when set).  Returns the model."""
    lo = config.lora
    if lo.rank == 0 or has_adapters(model):
        return model
    attach(model, lo.rank, lo.alpha, lo.target_modules, config.seed)
    if lo.init_adapter:
        load_adapter(model, lo.init_adapter, expect=lo)
    return model


# ---------------------------------------------------------------------- PEFT files
def _hf_module(layer: int, sub: str, name: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if sub == 'attn' else 'mlp'}.{name}"


def adapter_settings(model) -> dict:
    """rank, alpha, target_modules of the attached adapters."""
    rank, scale, targets = None, None, []
    for _, module, name, in_dims in _sites(model):
        a = getattr(module, name + "_lora_a", None)
        if a is None:
            continue
        rank, scale = a.shape[-1], float(module.lora_scale[...])
        if name not in targets:
            targets.append(name)
    if rank is None:
        raise LoraError("the model has no LoRA adapters")
    return {"rank": rank, "alpha": scale * rank, "target_modules": targets}


def save_adapter(model, out_dir, base_model: str = "", dropout: float = 0.0) -> Path:
    """``adapter_config.json`` + ``adapter_model.safetensors`` that PEFT loads, replacing
    `out_dir` as a whole or not at all (run_dir.replaced_folder): it never holds half an
    adapter."""
    with replaced_folder(out_dir) as staging:
        _write_adapter(model, staging, base_model, dropout)
    return Path(out_dir)


def _write_adapter(model, out: Path, base_model: str, dropout: float) -> None:
    s = adapter_settings(model)
    tensors = {}
    for i, module, name, in_dims in _sites(model):
        a = getattr(module, name + "_lora_a", None)
        if a is None:
            continue
        prefix = "base_model.model." + _hf_module(i, TARGETS[name][0], name)
        a_host = np.asarray(jax.device_get(a[...]))
        b_host = np.asarray(jax.device_get(getattr(module, name + "_lora_b")[...]))
        tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(a_host.reshape(-1, s["rank"]).T)
        tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(b_host.reshape(s["rank"], -1).T)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": s["rank"],
              "lora_alpha": s["alpha"], "lora_dropout": dropout,
              "target_modules": sorted(s["target_modules"]), "bias": "none",
              "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
              "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "base_model_name_or_path": str(base_model) or None}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_adapter(model, folder, expect=None):
    """Load a PEFT LoRA adapter folder into `model`, whose adapters must already be attached
    with the same rank, alpha and target modules (`expect`: the `lora:` section to check the
    folder against, errors naming its field)."""
    folder = Path(folder)
    config_file = folder / ADAPTER_CONFIG
    if not config_file.exists():
        raise LoraError(f"lora.init_adapter: {folder} has no {ADAPTER_CONFIG}")
    cfg = json.loads(config_file.read_text())
    s = adapter_settings(model)
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise LoraError(f"lora.init_adapter: {folder} is not a plain LoRA adapter")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    checks = (("rank", cfg.get("r"), s["rank"]), ("alpha", cfg.get("lora_alpha"), s["alpha"]),
              ("target_modules", sorted(targets), sorted(s["target_modules"])))
    for field, got, want in checks:
        if got != want and not (field == "alpha" and got is not None
                                and math.isclose(got, want)):
            raise LoraError(f"lora.{field}: {want!r} but the adapter {folder} has {got!r}; "
                            f"set lora.{field} to match it")
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    tensors = {k.replace(".default.", "."): v for k, v in tensors.items()}
    used = set()
    for i, module, name, in_dims in _sites(model):
        a = getattr(module, name + "_lora_a", None)
        if a is None:
            continue
        prefix = "base_model.model." + _hf_module(i, TARGETS[name][0], name)
        for suffix, var in ((".lora_A.weight", a),
                            (".lora_B.weight", getattr(module, name + "_lora_b"))):
            key = prefix + suffix
            if key not in tensors:
                raise LoraError(f"lora.init_adapter: {folder} has no tensor {key!r}")
            value = np.ascontiguousarray(tensors[key].T.reshape(var.shape)).astype(var[...].dtype)
            var[...] = jax.device_put(value, var[...].sharding)
            used.add(key)
    extra = sorted(set(tensors) - used)
    if extra:
        raise LoraError(f"lora.init_adapter: {folder} has tensor {extra[0]!r}, which this "
                        "model has no adapter for")
    return model


# ---------------------------------------------------------------------- merging
def merged(model):
    """`model` itself without adapters, else a Decoder with W + s * A @ B in place of each
    adapted projection (other parameters shared, not copied)."""
    return _without_adapters(model, fold=True)


def base_model(model):
    """`model` itself without adapters, else a Decoder of its frozen base weights alone (the
    adapters left out, parameters shared, not copied): what a LoRA-serving engine loads."""
    return _without_adapters(model, fold=False)


def _without_adapters(model, fold: bool):
    if not has_adapters(model):
        return model
    values = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if not isinstance(var, LoraParam):
            values[tuple(path)] = var[...]
    for i, module, name, _ in _sites(model):
        if fold and hasattr(module, name + "_lora_a"):
            w = getattr(module, name)[...]
            values[("layers", i, TARGETS[name][0], name)] = lora_weight(
                module, name, jnp.float32).astype(w.dtype)
    decoder = type(model)   # models.Decoder, which imports this module
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: decoder(model.cfg, rngs=nnx.Rngs(0))))
    state = nnx.from_flat_state([(tuple(path), var.replace(values[tuple(path)]))
                                 for path, var in nnx.to_flat_state(abstract)])
    return nnx.merge(graphdef, state)


def parameter_count(model, adapters_only: bool = True) -> int:
    filt = LoraParam if adapters_only else nnx.Param
    return sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(model, filt)))
