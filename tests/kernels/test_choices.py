"""`implementation: auto` reads each kernel's table of measured choices (kernels/choices.py)."""
import jax.numpy as jnp
import numpy as np
import pytest

from ctopd_jax.config import from_dict
from ctopd_jax.kernels import api, choices
from ctopd_jax.kernels.token_rows import token_rows


@pytest.mark.parametrize("kernel,backend,kind,want", [
    ("strict_topk", "gpu", "NVIDIA H200", "xla"),      # Pallas 75.4 ms against XLA's 7.8 ms
    ("strict_full", "gpu", "NVIDIA H200", "pallas"),   # Pallas 9.8 ms against XLA's 23.7 ms
    ("strict_full", "gpu", "NVIDIA A100-SXM4-80GB", "xla"),   # not measured: the portable path
    ("strict_topk", "cpu", "cpu", "xla"), ("strict_full", "cpu", "cpu", "xla"),
    ("strict_full", "tpu", "TPU v5", "xla")])
def test_the_table_picks_per_kernel_and_device(kernel, backend, kind, want):
    assert choices.choose(kernel, backend, kind) == want


def test_every_row_names_a_path_and_why():
    for kernel in choices.KERNELS:
        for row in choices.table(kernel):
            assert row["choice"] in ("pallas", "xla")
            assert ("measured" in row and row["pallas_ms"] > 0 and row["xla_ms"] > 0) or row["why"]


def test_auto_resolves_on_this_device_and_computes_like_xla():
    assert api.resolve_implementation("auto", "rkl", None) == choices.choose("strict_full")
    rng = np.random.default_rng(0)
    zs, zt = (jnp.asarray(rng.normal(size=(6, 40)), jnp.float32) for _ in range(2))
    ids, w = jnp.arange(40), jnp.ones(6)
    for topk in (None, 4):
        got = api.strict_kd_sum(zs, zt, ids, w, divergence="rkl", topk=topk, implementation="auto")
        want = api.strict_kd_sum(zs, zt, ids, w, divergence="rkl", topk=topk, implementation="xla")
        assert float(got) == float(want)
    lp, _ = token_rows(zs[:, :8], jnp.eye(8, 12), jnp.zeros(6, jnp.int32), implementation="auto")
    assert lp.shape == (6,) and bool(jnp.isfinite(lp).all())


def test_auto_is_a_config_value():
    assert from_dict({"algorithm": {"name": "strict", "implementation": "auto"}}).algorithm.implementation == "auto"
