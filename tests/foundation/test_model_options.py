"""The model section's execution options (model.attention, model.remat_policy, model.scan_layers,
model.mlp_chunk): validated by the run config, passed by `build.load_side` into the ModelConfig
of each side, and numerically neutral (same logits as the default model)."""
import jax
import numpy as np
import pytest
from flax import nnx

from ctopd_jax.config import ConfigError, from_dict, load_config
from ctopd_jax.loop import build
from ctopd_jax.mesh.device_mesh import make_mesh

OPTIONS = {"attention": "einsum", "remat_policy": "blocks", "scan_layers": True, "mlp_chunk": 8}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 1}, devices=jax.devices()[:1])


def _side(config, role, mesh, spec=None):
    m = config.model
    spec = spec or getattr(m, role)
    tokenizer = getattr(m, f"{role}_tokenizer", "")
    return build.load_side(spec, tokenizer, m, mesh, config.seed, role)


def test_defaults_keep_the_previous_model_config():
    m = from_dict({}).model
    assert (m.attention, m.remat_policy, m.scan_layers, m.mlp_chunk) == ("auto", "", False, 0)
    assert m.execution_options("student") == dict(attention="auto", mlp_chunk=0, remat=False,
                                                  remat_policy="", scan_layers=False)
    assert m.execution_options("teacher") == dict(attention="auto", mlp_chunk=0)


def test_options_reach_every_side(mesh):
    config = from_dict({"model": {"student": "demo:student", "teacher": "demo:teacher",
                                  "teacher_base": "demo:char_teacher_base", **OPTIONS}})
    student, _ = _side(config, "student", mesh)
    cfg = student.cfg
    assert (cfg.attention, cfg.remat_policy, cfg.scan_layers, cfg.mlp_chunk) == (
        "einsum", "blocks", True, 8)
    assert cfg.layer_remat_policy == "blocks"
    # The frozen teacher (and the teacher's base) take the attention and MLP chunking; the
    # backward-pass options stay off there, as model.remat always did.
    teacher, _ = _side(config, "teacher", mesh)
    graphdef, state, _ = build.load_teacher_base(config, mesh)
    for side in (teacher.cfg, nnx.merge(graphdef, state).cfg):
        assert (side.attention, side.mlp_chunk) == ("einsum", 8)
        assert (side.scan_layers, side.layer_remat_policy) == (False, "none")


def test_preset_side_takes_the_options(mesh):
    config = from_dict({"model": {"student": "preset:tiny_llama", "student_tokenizer": "tiny_bpe",
                                  "attention": "blockwise", "remat_policy": "full",
                                  "scan_layers": True, "mlp_chunk": 16}})
    student, _ = _side(config, "student", mesh)
    cfg = student.cfg
    assert (cfg.attention, cfg.layer_remat_policy, cfg.scan_layers, cfg.mlp_chunk) == (
        "blockwise", "full", True, 16)


def test_remat_policy_empty_follows_remat(mesh):
    config = from_dict({"model": {"remat": True}})
    student, _ = _side(config, "student", mesh)
    assert student.cfg.layer_remat_policy == "full"


@pytest.mark.parametrize("override, field", [
    ("model.remat_policy=sometimes", "model.remat_policy"),
    ("model.attention=flash", "model.attention"),
    ("model.mlp_chunk=-1", "model.mlp_chunk"),
    ("model.mlp_chunk=1.5", "model.mlp_chunk"),
    ("model.scan_layers=maybe", "model.scan_layers"),
    ("model.attention=cudnn", "model.attention"),          # float32 compute
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', r'[.]')}") as err:
        load_config(None, [override])
    assert "\n" not in str(err.value)


def test_bad_choice_lists_the_allowed_values():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.remat_policy=sometimes"])
    assert all(p in str(err.value) for p in ("'full'", "'blocks'", "'dots_saveable'", "'none'"))
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.attention=flash"])
    assert all(a in str(err.value) for a in ("'auto'", "'einsum'", "'blockwise'", "'cudnn'"))


def test_cudnn_needs_bf16_and_no_jax_sampler():
    with pytest.raises(ConfigError, match="model.attention: 'cudnn' cannot decode"):
        load_config(None, ["model.attention=cudnn", "model.dtype=bfloat16"])
    m = load_config(None, ["model.attention=cudnn", "model.dtype=bfloat16",
                           "rollout.engine=vllm"]).model
    assert m.attention == "cudnn"


def test_memory_options_give_the_default_logits(mesh):
    """scan + remat + MLP chunking (and the blockwise / einsum paths) are execution choices:
    the same checkpoint gives the same logits, on a batch with left padding and a length that
    is not a multiple of the MLP chunk."""
    base = from_dict({"model": {"student": "demo:student"}})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 800, size=(2, 21)).astype(np.int32)
    mask = np.ones_like(ids, dtype=bool)
    mask[1, :5] = False
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)

    @nnx.jit
    def logits(model):
        return model(ids, positions, mask)

    reference = np.asarray(logits(_side(base, "student", mesh)[0]))
    for options in ({"scan_layers": True, "remat_policy": "full", "mlp_chunk": 8,
                     "attention": "blockwise"},
                    {"remat_policy": "blocks", "mlp_chunk": 4, "attention": "einsum"}):
        config = from_dict({"model": {"student": "demo:student", **options}})
        model, _ = _side(config, "student", mesh)
        got = np.asarray(logits(model))
        rows = mask  # left-pad rows are never used
        np.testing.assert_allclose(got[rows], reference[rows], atol=2e-5, rtol=1e-5,
                                   err_msg=str(options))


def test_memory_options_give_the_default_gradient(mesh):
    """The rematerialised, scanned, chunked student has the default model's gradient."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 800, size=(2, 17)).astype(np.int32)
    mask = np.ones_like(ids, dtype=bool)
    positions = np.broadcast_to(np.arange(17, dtype=np.int32), ids.shape)

    @nnx.jit
    def grads(model):
        return nnx.grad(lambda m: (m(ids, positions, mask) ** 2).mean())(model)

    def flat(config):
        model, _ = _side(config, "student", mesh)
        return jax.tree.leaves(jax.tree.map(np.asarray, nnx.to_pure_dict(grads(model))))

    reference = flat(from_dict({"model": {"student": "demo:student"}}))
    got = flat(from_dict({"model": {"student": "demo:student", "scan_layers": True,
                                    "remat_policy": "full", "mlp_chunk": 8}}))
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
