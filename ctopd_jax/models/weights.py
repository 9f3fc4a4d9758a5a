"""HF safetensors checkpoints <-> `Decoder` state, driven by one name table.

`NAME_TABLE` is the only place that knows how HF tensors correspond to NNX parameters; it drives
`load_hf_checkpoint`, `export_hf_checkpoint` and `hf_named_tensors` (vLLM weight sync).

Decisions:
- Loading reads the header of every file first and checks names and shapes against the
  config before any tensor data is read, so a bad checkpoint fails fast with the tensor named.
- Tensors are read one at a time (`safe_open`) and placed straight onto their sharding with
  `jax.make_array_from_callback`; the host holds at most one tensor, never the whole model.
- Tied checkpoints: HF omits `lm_head.weight`; if a tied checkpoint has it anyway it is
  ignored (it is a copy of the embedding).  `hf_named_tensors` always yields `lm_head.weight`
  because vLLM's reload needs it even for tied models.
- `rotary_emb.inv_freq` buffers of old checkpoints are ignored (RoPE comes from the config).
- A model with LoRA adapters (lora.py) is exported and synced merged: W + (alpha/r) A @ B.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Iterator

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open as _safe_open
from safetensors.numpy import save_file

from ctopd_jax.mesh.device_mesh import logical_sharding, variable_logical_axes
from ctopd_jax.models.config import DTYPES, ModelConfig, ModelConfigError
from ctopd_jax.models.decoder import Decoder
from ctopd_jax.models.lora import merged


class CheckpointError(ValueError):
    """A checkpoint whose files, tensor names, shapes or config disagree (message names it)."""


@contextlib.contextmanager
def safe_open(path, framework: str):
    """`safetensors.safe_open` whose errors name the file (the library's own say only e.g.
    "incomplete metadata")."""
    try:
        with _safe_open(path, framework) as handle:
            yield handle
    except SafetensorError as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); it is damaged or "
                              "truncated: copy or download it again") from None


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor family. ``{i}`` is the layer index in both templates.

    ``in_dims`` = 0: same layout (embedding, norm scales); with ``flat`` the HF tensor is the
    NNX one flattened (biases [heads, head_dim] -> [heads * head_dim]).
    ``in_dims`` = n > 0: an HF Linear weight [out, in]; the NNX kernel is laid out
    [in dims (the first n), out dims], i.e. ``nnx = hf.T.reshape(nnx_shape)``.
    """

    hf: str
    nnx: str
    in_dims: int = 0
    flat: bool = False

    def _regex(self, template: str) -> re.Pattern:
        return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")

    def match_hf(self, name: str):
        m = self._regex(self.hf).match(name)
        return None if m is None else self.nnx.format(**m.groupdict())

    def match_nnx(self, path: str):
        m = self._regex(self.nnx).match(path)
        return None if m is None else self.hf.format(**m.groupdict())


NAME_TABLE: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", "embed"),
    Rule("model.norm.weight", "final_norm.scale"),
    Rule("lm_head.weight", "lm_head", in_dims=1),
    Rule("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_norm.scale"),
    Rule("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attn_norm.scale"),
    Rule("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attn.q_proj", in_dims=1),
    Rule("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attn.k_proj", in_dims=1),
    Rule("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attn.v_proj", in_dims=1),
    Rule("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attn.o_proj", in_dims=2),
    Rule("model.layers.{i}.self_attn.q_proj.bias", "layers.{i}.attn.q_bias", flat=True),
    Rule("model.layers.{i}.self_attn.k_proj.bias", "layers.{i}.attn.k_bias", flat=True),
    Rule("model.layers.{i}.self_attn.v_proj.bias", "layers.{i}.attn.v_bias", flat=True),
    Rule("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_proj", in_dims=1),
    Rule("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up_proj", in_dims=1),
    Rule("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj", in_dims=1),
)
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


def rule_for_nnx(path: str) -> tuple[Rule, str]:
    for rule in NAME_TABLE:
        hf = rule.match_nnx(path)
        if hf is not None:
            return rule, hf
    raise KeyError(f"no HF name for NNX parameter {path!r}: add a Rule to NAME_TABLE")


def hf_shape(rule: Rule, nnx_shape: tuple[int, ...]) -> tuple[int, ...]:
    if rule.in_dims == 0:
        return (math.prod(nnx_shape),) if rule.flat else tuple(nnx_shape)
    n_in = math.prod(nnx_shape[:rule.in_dims])
    return (math.prod(nnx_shape) // n_in, n_in)


def to_hf(rule: Rule, value: np.ndarray) -> np.ndarray:
    if rule.in_dims == 0:
        return value.reshape(hf_shape(rule, value.shape))
    return np.ascontiguousarray(value.reshape(math.prod(value.shape[:rule.in_dims]), -1).T)


def from_hf(rule: Rule, value: np.ndarray, nnx_shape: tuple[int, ...]) -> np.ndarray:
    if rule.in_dims == 0:
        return value.reshape(nnx_shape)
    return np.ascontiguousarray(value.T).reshape(nnx_shape)


def flat_params(state) -> list[tuple[str, nnx.Variable]]:
    return [(".".join(str(k) for k in path), var) for path, var in nnx.to_flat_state(state)]


# ---------------------------------------------------------------------- loading
def _tensor_index(ckpt: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it (sharded index or every *.safetensors file)."""
    index_file = ckpt / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = {}
        for name, fname in weight_map.items():
            f = ckpt / fname
            if not f.exists():
                raise CheckpointError(
                    f"{index_file} maps tensor {name!r} to {fname!r}, which does not exist")
            files[name] = f
        return files
    shards = sorted(ckpt.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in checkpoint directory {ckpt}")
    files = {}
    for f in shards:
        with safe_open(f, "numpy") as handle:
            for name in handle.keys():
                if name in files:
                    raise CheckpointError(f"tensor {name!r} is in both {files[name]} and {f}")
                files[name] = f
    return files


_ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
                "tie_word_embeddings", "qkv_bias", "family")


def read_hf_config(path, **overrides) -> ModelConfig:
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist")
    config_file = ckpt / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"checkpoint {ckpt} has no config.json")
    return ModelConfig.from_hf_dict(json.loads(config_file.read_text()), **overrides)


def load_hf_checkpoint(path, mesh=None, dtype: str | None = None,
                       param_dtype: str | None = None, expect: ModelConfig | None = None,
                       remat: bool = False, **options) -> tuple[Decoder, ModelConfig]:
    """Load an HF Llama/Qwen2 checkpoint directory into a (sharded) `Decoder`.

    ``dtype`` / ``param_dtype`` are the compute / storage dtypes (names as in ModelConfig);
    ``param_dtype`` defaults to ``dtype``, which defaults to float32.  With ``mesh``, each
    parameter lands on its logical sharding (`ctopd_jax.mesh.device_mesh.logical_sharding`).  ``expect``:
    a config the checkpoint must agree with (architecture fields only), e.g. the run config.
    ``options``: further execution fields of ModelConfig (attention, scan_layers,
    remat_policy, mlp_chunk, ...); they do not change the parameter tree.
    """
    dtype = dtype or "float32"
    param_dtype = param_dtype or dtype
    ckpt = Path(path)
    cfg = read_hf_config(ckpt, dtype=dtype, param_dtype=param_dtype, remat=remat, **options)
    if expect is not None:
        for field in _ARCH_FIELDS:
            if getattr(expect, field) != getattr(cfg, field):
                raise ModelConfigError(
                    f"{ckpt / 'config.json'} has {field}={getattr(cfg, field)!r} but the run "
                    f"config expects {getattr(expect, field)!r}; fix model.{field} or the path")
    files = _tensor_index(ckpt)

    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    params = flat_params(abstract_state)
    plan = []  # (nnx path, variable, rule, hf name)
    for path, var in params:
        rule, hf_name = rule_for_nnx(path)
        if hf_name not in files:
            raise CheckpointError(
                f"checkpoint {ckpt} is missing tensor {hf_name!r} (for parameter {path}); "
                f"config.json says {cfg.family} with {cfg.num_layers} layers, "
                f"tie_word_embeddings={cfg.tie_word_embeddings}")
        plan.append((path, var, rule, hf_name))
    expected_names = {p[3] for p in plan}
    for name in sorted(files):
        if name in expected_names or _IGNORED_HF.match(name):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        raise CheckpointError(
            f"checkpoint {ckpt} has unexpected tensor {name!r} (in {files[name].name}); it does "
            f"not belong to a {cfg.family} model with {cfg.num_layers} layers as config.json says")

    # Check every shape from the headers before reading any data.
    for path, var, rule, hf_name in plan:
        with safe_open(files[hf_name], "numpy") as handle:
            got = tuple(handle.get_slice(hf_name).get_shape())
        want = hf_shape(rule, tuple(var.shape))
        if got != want:
            raise CheckpointError(
                f"tensor {hf_name!r} has shape {got} but config.json implies {want}; the "
                f"checkpoint and its config.json disagree")

    store_dtype = DTYPES[param_dtype]
    leaves = {}
    for path, var, rule, hf_name in plan:
        with safe_open(files[hf_name], "numpy") as handle:
            raw = handle.get_tensor(hf_name)
        value = from_hf(rule, raw, tuple(var.shape)).astype(store_dtype)
        del raw
        leaves[path] = _place(value, var, mesh)
        del value

    state = nnx.from_flat_state([
        (path_tuple, var.replace(leaves[".".join(str(k) for k in path_tuple)]))
        for path_tuple, var in nnx.to_flat_state(abstract_state)])
    return nnx.merge(graphdef, state), cfg


def _place(value: np.ndarray, var: nnx.Variable, mesh):
    if mesh is None:
        return jax.device_put(value)
    axes = variable_logical_axes(var) or (None,) * value.ndim
    sharding = logical_sharding(mesh, axes, value.shape)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


# ---------------------------------------------------------------------- export
def _host(value: jax.Array, dtype=None) -> np.ndarray:
    """Gather one (possibly sharded) parameter to host, optionally cast (name or dtype)."""
    out = np.asarray(jax.device_get(value))
    if dtype is not None:
        out = out.astype(DTYPES[dtype] if isinstance(dtype, str) else dtype)
    return out


def hf_named_tensors(model: Decoder, include_tied_lm_head: bool = True,
                     dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host numpy array) for every parameter, one tensor gathered at a time.

    ``lm_head.weight`` is yielded for tied models too (the embedding) unless
    ``include_tied_lm_head`` is False (what an HF checkpoint file wants).
    """
    model = merged(model)
    for path, var in flat_params(nnx.state(model, nnx.Param)):
        rule, hf_name = rule_for_nnx(path)
        value = _host(var[...], dtype)
        yield hf_name, to_hf(rule, value)
        if path == "embed" and model.cfg.tie_word_embeddings and include_tied_lm_head:
            yield "lm_head.weight", value  # [V, H] is also the HF lm_head layout


def write_safetensors_shards(out: Path, count: int, shards) -> None:
    """Write `count` shards (an iterable of {hf name: numpy array}, each made when its turn comes,
    so one shard is in memory at a time) as model.safetensors, or as model-0000k-of-0000n
    files with model.safetensors.index.json, the layout transformers reads."""
    names = (["model.safetensors"] if count == 1 else
             [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)])
    weight_map, total = {}, 0
    for fname, tensors in zip(names, shards):
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
        total += sum(t.nbytes for t in tensors.values())
        del tensors
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def export_hf_checkpoint(model: Decoder, cfg: ModelConfig, out_dir,
                         extra_config: dict | None = None,
                         max_shard_bytes: int = 4 * 1024**3, dtype: str | None = None) -> Path:
    """Write ``config.json`` + safetensors that transformers' from_pretrained loads.

    One ``model.safetensors`` when everything fits in ``max_shard_bytes``, otherwise
    ``model-0000k-of-0000n.safetensors`` files plus ``model.safetensors.index.json``; the host
    holds one shard at a time.  ``extra_config`` adds fields ModelConfig does not carry
    (bos/eos ids, ...).  Tensors are stored in ``dtype`` (a ModelConfig dtype name; default:
    their parameter dtype); tied models omit ``lm_head.weight`` as HF does.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ModelConfigError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = flat_params(nnx.state(merged(model), nnx.Param))
    shards: list[list[tuple[str, Rule, nnx.Variable]]] = [[]]
    size = 0
    for path, var in params:  # plan shards from shapes, before gathering anything
        rule, hf_name = rule_for_nnx(path)
        item = np.dtype(DTYPES[dtype] if dtype else var[...].dtype).itemsize
        nbytes = math.prod(var.shape) * item
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((hf_name, rule, var))
        size += nbytes
    write_safetensors_shards(out, len(shards), (
        {hf_name: to_hf(rule, _host(var[...], dtype)) for hf_name, rule, var in shard}
        for shard in shards))
    hf_config = {**(extra_config or {}), **cfg.to_hf_dict()}
    if dtype is not None:
        hf_config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return out
