"""models/init.py: the tensor-by-tensor random initialiser.

The distribution is pinned against an independent numpy draw (N(0, 0.02) in float32, ones for
norm scales, zeros for biases), not against the code's own output.
"""
import jax
import numpy as np
import pytest
from flax import nnx

from ctopd_jax.mesh.device_mesh import make_mesh, module_shardings
from ctopd_jax.models import tiny_llama, tiny_qwen2
from ctopd_jax.models.init import draw_plan, init_decoder

STD = 0.02  # the decoder's declared init scale, restated here from the HF configs' initializer_range


def _flat(model):
    return {".".join(map(str, p)): np.asarray(jax.device_get(v.get_value()), np.float32)
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _expected_kind(name: str) -> str:
    if name.endswith("scale"):
        return "ones"
    if name.endswith("_bias"):
        return "zeros"
    return "normal"


@pytest.mark.parametrize("make, param_dtype", [(tiny_llama, "float32"), (tiny_qwen2, "bfloat16")])
def test_each_tensor_matches_an_independent_numpy_draw(make, param_dtype):
    cfg = make(vocab_size=4096, num_layers=3, param_dtype=param_dtype)
    params = _flat(init_decoder(cfg, seed=7))
    rng = np.random.default_rng(0)
    assert len(params) == (3 * 12 + 2 if cfg.qkv_bias else 3 * 9 + 3)  # every tensor drawn
    for name, value in params.items():
        kind = _expected_kind(name)
        if kind != "normal":
            assert np.all(value == (1.0 if kind == "ones" else 0.0)), name
            continue
        ref = rng.normal(0.0, STD, value.shape).astype(np.float32)
        if param_dtype == "bfloat16":
            ref = np.asarray(ref.astype(jax.numpy.bfloat16), np.float32)
        n = value.size
        # 6 standard errors: a wrong scale (e.g. 0.01 or 1.0) or a non-zero mean fails by far
        assert abs(value.mean() - ref.mean()) < 6 * STD / np.sqrt(n), name
        assert abs(value.std() / ref.std() - 1) < 6 / np.sqrt(2 * n) + 4e-3, name
        # the shape of the distribution, not only its moments: fraction inside one sigma
        inside, ref_inside = np.mean(np.abs(value) < STD), np.mean(np.abs(ref) < STD)
        assert abs(inside - ref_inside) < 6 * np.sqrt(0.25 / n) + 0.01, name


def test_same_seed_same_values_other_seed_other_values():
    cfg = tiny_llama(num_layers=2)
    a, b, c = (_flat(init_decoder(cfg, seed=s)) for s in (3, 3, 4))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
        if _expected_kind(name) == "normal":
            assert not np.array_equal(a[name], c[name]), name
    # every tensor has its own stream: two layers' projections differ
    assert not np.array_equal(a["layers.0.attn.q_proj"], a["layers.1.attn.q_proj"])


def test_values_land_on_their_shardings_and_do_not_depend_on_the_mesh():
    cfg = tiny_qwen2(num_layers=2)
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    sharded = init_decoder(cfg, seed=1, mesh=mesh)
    want = module_shardings(sharded, mesh)
    got = jax.tree.map(lambda v: v.get_value().sharding, nnx.state(sharded),
                       is_leaf=lambda x: isinstance(x, nnx.Variable))
    for (path, w), (_, g) in zip(nnx.to_flat_state(want), nnx.to_flat_state(got)):
        assert g.is_equivalent_to(w, len(g.spec) or 1), path
    plain = _flat(init_decoder(cfg, seed=1))
    for name, value in _flat(sharded).items():
        np.testing.assert_array_equal(value, plain[name])


def test_the_compiled_programs_do_not_grow_with_depth():
    def programs(layers):
        _, entries = draw_plan(tiny_llama(num_layers=layers))
        return len({id(draw) for _, _, draw, _ in entries}), len(entries)

    shallow, deep = programs(2), programs(12)
    assert shallow[0] == deep[0] <= 8
    assert deep[1] - shallow[1] == 10 * 9  # nine tensors per layer, each drawn
