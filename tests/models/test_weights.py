"""HF -> JAX -> HF round trip, sharded-index checkpoints, and bad checkpoints named clearly."""

import json
import re

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_fixtures import VARIANTS, hf_logits, jax_logits, save_hf
from ctopd_jax.models import ModelConfigError, weights
from ctopd_jax.models.weights import CheckpointError

IDS = np.random.RandomState(0).randint(0, 256, (2, 11))


@pytest.mark.parametrize("variant", ["llama_untied_llama3rope", "qwen2_tied_bias"])
def test_export_round_trip_reloads_in_transformers(variant, tmp_path):
    cfg = VARIANTS[variant]()
    hf = save_hf(cfg, tmp_path / "src")
    model, loaded_cfg = weights.load_hf_checkpoint(tmp_path / "src")
    weights.export_hf_checkpoint(model, loaded_cfg, tmp_path / "out",
                                 extra_config={"eos_token_id": 2})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(reloaded) is type(hf)
    assert reloaded.config.eos_token_id == 2
    np.testing.assert_array_equal(hf_logits(reloaded, IDS), hf_logits(hf, IDS))
    # Every tensor is bit-identical, and tied checkpoints omit lm_head.weight like HF does.
    ours = load_file(tmp_path / "out" / "model.safetensors")
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in ours
        theirs.pop("lm_head.weight")
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_sharded_export_reloads_in_transformers_and_in_ours(tmp_path):
    cfg = VARIANTS["llama_tied"]()
    hf = save_hf(cfg, tmp_path / "src")
    model, loaded_cfg = weights.load_hf_checkpoint(tmp_path / "src")
    weights.export_hf_checkpoint(model, loaded_cfg, tmp_path / "out", max_shard_bytes=50_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(reloaded, IDS), hf_logits(hf, IDS))
    again, _ = weights.load_hf_checkpoint(tmp_path / "out")
    np.testing.assert_array_equal(jax_logits(again, IDS), jax_logits(model, IDS))

    weights.export_hf_checkpoint(model, loaded_cfg, tmp_path / "bf16", dtype="bfloat16")
    stored = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {str(v.dtype) for v in stored.values()} == {"bfloat16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_hf_named_tensors_always_include_lm_head(tmp_path):
    hf = save_hf(VARIANTS["qwen2_tied_bias"](), tmp_path)
    model, _ = weights.load_hf_checkpoint(tmp_path)
    named = dict(weights.hf_named_tensors(model))
    # HF's own state_dict lists lm_head.weight for tied models too: same names, same values.
    reference = hf.state_dict()
    assert sorted(named) == sorted(reference)
    for name, value in named.items():
        np.testing.assert_array_equal(value, reference[name].numpy(), err_msg=name)


def test_sharded_index_checkpoint_in_bfloat16(tmp_path):
    cfg = VARIANTS["llama_untied_llama3rope"]()
    hf = save_hf(cfg, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = weights.load_hf_checkpoint(tmp_path)
    np.testing.assert_allclose(jax_logits(model, IDS), hf_logits(hf, IDS), atol=1e-4)

    # Stored as bf16 on disk -> loaded as bf16 params.
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model16, cfg16 = weights.load_hf_checkpoint(tmp_path / "bf16", dtype="bfloat16")
    assert cfg16.param_dtype == "bfloat16"
    assert str(model16.embed[...].dtype) == "bfloat16"


# ---------------------------------------------------------------------- bad checkpoints
@pytest.fixture()
def good_ckpt(tmp_path):
    save_hf(VARIANTS["qwen2_untied_bias"](), tmp_path / "ck")
    return tmp_path / "ck"


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(good_ckpt):
    _rewrite(good_ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=re.escape("model.layers.1.self_attn.k_proj.bias")):
        weights.load_hf_checkpoint(good_ckpt)


def test_wrong_shape_is_named(good_ckpt):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]
    _rewrite(good_ckpt, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        weights.load_hf_checkpoint(good_ckpt)


def test_unexpected_tensor_is_named(good_ckpt):
    def edit(t):
        t["model.layers.7.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"]
    _rewrite(good_ckpt, edit)
    with pytest.raises(CheckpointError, match=re.escape("model.layers.7.mlp.up_proj.weight")):
        weights.load_hf_checkpoint(good_ckpt)


def test_config_json_disagreeing_with_tensors_names_tensor(good_ckpt):
    config = json.loads((good_ckpt / "config.json").read_text())
    config["intermediate_size"] = 96
    (good_ckpt / "config.json").write_text(json.dumps(config))
    named = r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight. has shape"
    with pytest.raises(CheckpointError, match=named):
        weights.load_hf_checkpoint(good_ckpt)


def test_config_json_disagreeing_with_run_config_names_field(good_ckpt):
    expect = VARIANTS["qwen2_untied_bias"]().replace(num_layers=3)
    with pytest.raises(ModelConfigError, match="num_layers"):
        weights.load_hf_checkpoint(good_ckpt, expect=expect)


def test_unsupported_config_field_is_named(good_ckpt):
    config = json.loads((good_ckpt / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    (good_ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="rope_type"):
        weights.load_hf_checkpoint(good_ckpt)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        weights.load_hf_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        weights.load_hf_checkpoint(tmp_path / "empty")


def test_index_pointing_at_missing_file_is_named(good_ckpt):
    (good_ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*model-00002-of-00002"):
        weights.load_hf_checkpoint(good_ckpt)


def test_tied_checkpoint_with_redundant_lm_head_loads(tmp_path):
    """Some tied checkpoints store lm_head.weight anyway; it is a copy and is ignored."""
    hf = save_hf(VARIANTS["llama_tied"](), tmp_path)

    def edit(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    _rewrite(tmp_path, edit)
    model, cfg = weights.load_hf_checkpoint(tmp_path)
    assert cfg.tie_word_embeddings and not hasattr(model, "lm_head")
    np.testing.assert_allclose(jax_logits(model, IDS), hf_logits(hf, IDS), atol=1e-4)
