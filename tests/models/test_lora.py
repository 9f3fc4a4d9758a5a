"""LoRA (ctopd_jax/models/lora.py) against PEFT on tiny HF Llama / Qwen2: adapters written by
PEFT load into ours with equal logits, ours load into PEFT unchanged, our merged export equals
PEFT's merge_and_unload(), and training moves only the adapter."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from hf_fixtures import VARIANTS, hf_logits, jax_logits, paged_cache, save_hf, with_options
from ctopd_jax.config import ConfigError, TrainConfig, load_config
from ctopd_jax.models import lora, weights
from ctopd_jax.plan.model import lora_param_count

peft = pytest.importorskip("peft", reason="pip install -e '.[test]' (peft)")

IDS = np.random.RandomState(0).randint(0, 256, (2, 11))
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {"llama_untied_llama3rope": (4, 8.0, ALL),
         "qwen2_tied_bias": (2, 16.0, ["q_proj", "v_proj", "o_proj", "down_proj"])}


def _base(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _peft_adapter(base_dir, out_dir, rank, alpha, targets):
    """An adapter written by PEFT itself, A and B both random (init_lora_weights=False)."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             init_lora_weights=False, task_type="CAUSAL_LM")
    model = peft.get_peft_model(_base(base_dir), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)


def _close(ours, theirs):
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.parametrize("variant", ["llama_untied_llama3rope",
                                     pytest.param("qwen2_tied_bias", marks=pytest.mark.slow)])
def test_peft_adapter_parity_both_ways_and_merged_export(variant, tmp_path):
    rank, alpha, targets = CASES[variant]
    save_hf(VARIANTS[variant](), tmp_path / "base")
    _peft_adapter(tmp_path / "base", tmp_path / "peft", rank, alpha, targets)
    reference = peft.PeftModel.from_pretrained(_base(tmp_path / "base"), tmp_path / "peft").eval()
    want = hf_logits(reference, IDS)
    assert np.abs(want - hf_logits(_base(tmp_path / "base"), IDS)).max() > 1e-2  # B non-zero

    # PEFT's adapter loaded into ours gives PEFT's logits (also with the layers under scan).
    model, _ = weights.load_hf_checkpoint(tmp_path / "base")
    lora.attach(model, rank, alpha, targets)
    lora.load_adapter(model, tmp_path / "peft")
    _close(jax_logits(model, IDS), want)
    _close(jax_logits(with_options(model, scan_layers=True), IDS), want)
    assert lora.parameter_count(model) == sum(
        p.numel() for n, p in reference.named_parameters() if "lora_" in n) == (
        lora_param_count(model.cfg, rank, targets))  # the planner's count

    # Our adapter files load into PEFT unchanged and give the same logits.
    lora.save_adapter(model, tmp_path / "ours", base_model=str(tmp_path / "base"))
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], sorted(saved["target_modules"])) == (
        rank, alpha, sorted(targets))
    again = peft.PeftModel.from_pretrained(_base(tmp_path / "base"), tmp_path / "ours").eval()
    _close(hf_logits(again, IDS), want)

    # Our merged export equals PEFT's merge_and_unload(), tensor by tensor and in logits.
    merged_ref = reference.merge_and_unload()
    weights.export_hf_checkpoint(model, model.cfg, tmp_path / "merged")
    exported = _base(tmp_path / "merged")
    theirs = merged_ref.state_dict()
    for name, tensor in exported.state_dict().items():
        np.testing.assert_allclose(tensor.numpy(), theirs[name].numpy(), rtol=0, atol=1e-6,
                                   err_msg=name)
    _close(hf_logits(exported, IDS), hf_logits(merged_ref, IDS))
    # vLLM weight sync sends the merged weights too.
    synced = dict(weights.hf_named_tensors(model))
    np.testing.assert_allclose(synced["model.layers.1.mlp.down_proj.weight"],
                               theirs["model.layers.1.mlp.down_proj.weight"].numpy(),
                               rtol=0, atol=1e-6)


@pytest.mark.slow
def test_fresh_adapter_is_identity_and_only_the_adapter_trains(tmp_path):
    save_hf(VARIANTS["qwen2_tied_bias"](), tmp_path / "base")
    model, _ = weights.load_hf_checkpoint(tmp_path / "base")
    before = jax_logits(model, IDS)
    config = load_config(None, ["lora.rank=4", "lora.target_modules=[q_proj, up_proj]"])
    assert lora.trainable_filter(TrainConfig()) is nnx.Param  # rank 0: full fine-tuning
    lora.prepare(model, config)
    np.testing.assert_array_equal(jax_logits(model, IDS), before)  # B = 0: unchanged
    a = model.layers[0].attn.q_proj_lora_a[...]
    assert a.shape == (128, 4) and np.abs(a).max() <= 1 / np.sqrt(128)  # PEFT's kaiming bound
    assert not hasattr(model.layers[0].attn, "k_proj_lora_a")

    graphdef, params, rest = nnx.split(model, lora.trainable_filter(config), ...)
    base_before = jax.tree.map(np.asarray, rest)
    adapter_size = sum(x.size for x in jax.tree.leaves(params))
    # 2 layers x (q_proj: A [128, 4] + B [4, 4 heads, 32]; up_proj: A [128, 4] + B [4, 256])
    assert adapter_size == lora.parameter_count(model) == 2 * (
        (128 * 4 + 4 * 4 * 32) + (128 * 4 + 4 * 256))
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    assert sum(x.size for x in jax.tree.leaves(opt_state)) == 2 * adapter_size + 1
    ids = jnp.asarray(IDS, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)

    @jax.jit
    def step(params, opt_state):
        def loss(p):
            logits = nnx.merge(graphdef, p, rest)(ids[:, :-1], pos[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                                 ids[:, 1:, None], -1))
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for _ in range(3):
        params, opt_state, value = step(params, opt_state)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    nnx.update(model, params)
    after = nnx.state(model, nnx.Not(lora.LoraParam))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, after), base_before)
    assert np.abs(np.asarray(model.layers[0].attn.q_proj_lora_b[...])).max() > 0


def test_lora_config_errors_name_the_field(tmp_path):
    assert TrainConfig().lora.rank == 0 and TrainConfig().lora.alpha == 16
    for override, field in (("lora.rank=-1", "lora.rank"), ("lora.alpha=0", "lora.alpha"),
                            ("lora.dropout=1.0", "lora.dropout"),
                            ("lora.dropout=0.1", "lora.dropout"),  # without lora.rank
                            ("lora.target_modules=[qkv]", "lora.target_modules"),
                            ("lora.target_modules=q_proj", "lora.target_modules")):
        with pytest.raises(ConfigError, match=f"^{field}"):
            load_config(None, [override])
    assert load_config(None, ["lora.rank=4", "lora.dropout=0.1"]).lora.dropout == 0.1
    # an adapter folder that does not match the settings names the mismatching field
    save_hf(VARIANTS["llama_tied"](), tmp_path / "base")
    _peft_adapter(tmp_path / "base", tmp_path / "peft", 2, 4.0, ["q_proj"])
    model, _ = weights.load_hf_checkpoint(tmp_path / "base")
    config = load_config(None, ["lora.rank=4", "lora.alpha=4", "lora.target_modules=[q_proj]",
                                f"lora.init_adapter={tmp_path / 'peft'}"])
    with pytest.raises(lora.LoraError, match="^lora.rank: 4 but the adapter"):
        lora.prepare(model, config)
    # the matching settings load it: PEFT's logits
    model, _ = weights.load_hf_checkpoint(tmp_path / "base")
    config = load_config(None, ["lora.rank=2", "lora.alpha=4", "lora.target_modules=[q_proj]",
                                f"lora.init_adapter={tmp_path / 'peft'}"])
    lora.prepare(model, config)
    reference = peft.PeftModel.from_pretrained(_base(tmp_path / "base"), tmp_path / "peft").eval()
    _close(jax_logits(model, IDS), hf_logits(reference, IDS))


@pytest.mark.slow
def test_adapters_on_a_sharded_model_follow_the_base_sharding_and_match_peft(tmp_path):
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ctopd_jax.mesh.device_mesh import make_mesh

    rank, alpha, targets = CASES["llama_untied_llama3rope"]
    save_hf(VARIANTS["llama_untied_llama3rope"](), tmp_path / "base")
    _peft_adapter(tmp_path / "base", tmp_path / "peft", rank, alpha, targets)
    want = hf_logits(peft.PeftModel.from_pretrained(_base(tmp_path / "base"),
                                                    tmp_path / "peft").eval(), IDS)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model, _ = weights.load_hf_checkpoint(tmp_path / "base", mesh=mesh)
    lora.attach(model, rank, alpha, targets)
    lora.load_adapter(model, tmp_path / "peft")
    mlp = model.layers[0].mlp
    assert mlp.gate_proj_lora_a[...].sharding == NamedSharding(mesh, P("fsdp"))
    assert mlp.gate_proj_lora_b[...].sharding == NamedSharding(mesh, P(None, "tensor"))
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(IDS, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda s: nnx.merge(graphdef, s)(ids, pos))(state)
    _close(np.asarray(got), want)


def _dropout_model():
    """A tiny Llama with adapters on every projection and random non-zero A and B."""
    from ctopd_jax.models.decoder import Decoder

    model = Decoder(VARIANTS["llama_untied_llama3rope"](), rngs=nnx.Rngs(0))
    lora.attach(model, 4, 8.0, ALL)
    rs = np.random.RandomState(1)
    state = nnx.state(model, lora.LoraParam)
    nnx.update(model, jax.tree.map(
        lambda x: jnp.asarray(rs.randn(*x.shape).astype(np.float32) * 0.1), state))
    return model


def _mask(key_data, indices, p, shape):
    """The documented mask: the key folded with each index in turn, kept with prob. 1 - p."""
    key = jax.random.wrap_key_data(jnp.asarray(key_data))
    for i in indices:
        key = jax.random.fold_in(key, i)
    return np.asarray(jax.random.bernoulli(key, 1.0 - p, shape))


def test_lora_dropout_path_equals_a_numpy_reference_with_the_same_mask():
    model = _dropout_model()
    p, key = 0.3, np.asarray(jax.random.key_data(jax.random.key(7)))
    drop = lora.Dropout(key, p)
    rs = np.random.RandomState(2)
    layer = model.layers[1]
    for module, name, x_shape in ((layer.attn, "q_proj", (2, 5, 128)),
                                  (layer.attn, "o_proj", (2, 5, 4, 32)),
                                  (layer.mlp, "down_proj", (2, 5, 256))):
        x = rs.randn(*x_shape).astype(np.float32)
        y = rs.randn(*(x_shape[:2] + getattr(module, name).shape[TARGETS_IN[name]:]))
        y = y.astype(np.float32)
        got = np.asarray(lora.add_lora_path(module, name, jnp.asarray(x), jnp.asarray(y), drop))
        mask = _mask(key, [lora.TARGET_INDEX[name]], p, x.shape)
        a = np.asarray(getattr(module, name + "_lora_a")[...], np.float64)
        b = np.asarray(getattr(module, name + "_lora_b")[...], np.float64)
        r = a.shape[-1]
        dropped = (mask * x / (1 - p)).reshape(2, 5, -1).astype(np.float64)
        want = y + (8.0 / 4) * (dropped @ a.reshape(-1, r) @ b.reshape(r, -1)).reshape(y.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)
        # and without dropout the adapter's path is left to the folded weight
        assert lora.add_lora_path(module, name, x, y, None) is y
    # keep rate over many elements
    for rate in (0.1, 0.5):
        kept = np.asarray(lora.Dropout(key, rate).keep_mask((1000, 1000))).mean()
        assert abs(kept - (1 - rate)) < 3e-3, (rate, kept)


def test_lora_dropout_only_in_the_training_forward():
    model = _dropout_model()
    ids = jnp.asarray(IDS, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    key = np.asarray(jax.random.key_data(jax.random.key(7)))
    logits = np.asarray(model(ids, pos))
    plain = np.asarray(model.hidden_states(ids, pos))
    dropped = np.asarray(model.hidden_states(ids, pos, lora_dropout=lora.Dropout(key, 0.3)))
    assert np.abs(dropped - plain).max() > 1e-2  # dropout acts in the training forward
    again = np.asarray(model.hidden_states(ids, pos, lora_dropout=lora.Dropout(key, 0.3)))
    np.testing.assert_array_equal(again, dropped)  # the same key, the same masks
    other = lora.Dropout(np.asarray(jax.random.key_data(jax.random.key(8))), 0.3)
    assert np.abs(np.asarray(model.hidden_states(ids, pos, lora_dropout=other)) - dropped).max() > 0
    # rate 0 through the unfolded path: W x + s (x A) B equals the folded forward
    unfolded = np.asarray(model.hidden_states(ids, pos, lora_dropout=lora.Dropout(key, 0.0)))
    np.testing.assert_allclose(unfolded, plain, rtol=0, atol=1e-5 * np.abs(plain).max())
    # layer i's masks do not depend on how the layers run (scan, remat)
    for options in ({"scan_layers": True}, {"remat_policy": "blocks"}):
        other_run = with_options(model, **options).hidden_states(
            ids, pos, lora_dropout=lora.Dropout(key, 0.3))
        np.testing.assert_allclose(np.asarray(other_run), dropped, rtol=0,
                                   atol=1e-5 * np.abs(dropped).max(), err_msg=str(options))
    # the forward of rollouts, teacher scoring, evaluation and log-prob recomputation takes no
    # dropout and is unchanged by training forwards with dropout
    np.testing.assert_array_equal(np.asarray(model(ids, pos)), logits)
    with pytest.raises(ValueError, match="lora_dropout"):
        model.hidden_states(ids, pos, cache=paged_cache(model.cfg, 2, 16),
                            lora_dropout=lora.Dropout(key, 0.3))
    # the trainer's micro-batch dropouts: none at lora.dropout 0 (today's folded forward),
    # else deterministic in (iteration key, micro-batch index)
    base = jax.random.key(0)
    assert lora.train_dropout(load_config(None, ["lora.rank=4"]), base, 0) is None
    config = load_config(None, ["lora.rank=4", "lora.dropout=0.1"])
    first = lora.train_dropout(config, base, 0)
    assert first.rate == 0.1
    np.testing.assert_array_equal(first.key, lora.train_dropout(config, base, 0).key)
    assert not np.array_equal(first.key, lora.train_dropout(config, base, 4).key)


TARGETS_IN = {name: in_dims for name, (_, in_dims) in lora.TARGETS.items()}
