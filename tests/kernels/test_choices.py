"""`implementation: auto` reads each kernel's table of measured choices (kernels/choices.py):
the table's rows, the dispatch, and the routed path's numbers against the reference oracles."""
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ctopd_jax.config import from_dict
from ctopd_jax.kernels import choices
from ctopd_jax.kernels.strict import api
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


def test_auto_routes_by_the_table(monkeypatch):
    """Dispatch only: `auto` is what the table says for this device, per kernel; a table that
    says otherwise is followed (the values of the routed path: the next test)."""
    assert api.resolve_implementation("auto", "rkl", None) == choices.choose("strict_full")
    assert api.resolve_implementation("auto", "rkl", 4) == choices.choose("strict_topk")
    asked = []
    monkeypatch.setattr(api, "choose", lambda kernel: asked.append(kernel) or "reference")
    assert api.resolve_implementation("auto", "rkl", None) == "reference"
    assert api.resolve_implementation("auto", "rkl", 4) == "reference"
    assert asked == ["strict_full", "strict_topk"]


def test_auto_computes_what_the_reference_oracle_computes():
    """Whatever `auto` routes to on this device (xla on CPU), its values and gradients equal
    the plain-jnp oracles' (kernels/*/reference.py: whole-batch autodiff, no chunks): the strict
    sums from hidden rows in chunks of 4 rows over a shared vocabulary of 24 of 40 columns, full
    and top-4, and token_rows' log-probs and logsumexps."""
    from ctopd_jax.kernels.strict_full import reference as full_reference
    from ctopd_jax.kernels.strict_topk import reference as topk_reference
    from ctopd_jax.kernels.token_rows import reference as rows_reference

    rng = np.random.default_rng(0)
    hidden, lm_head = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((6, 8), (8, 40)))
    s_ids = jnp.asarray(rng.permutation(40)[:24])
    zt = jnp.asarray(rng.normal(size=(6, 24)), jnp.float32)
    w = jnp.asarray([1.0, 1.0, 0.0, 1.0, 0.5, 1.0])
    for topk, oracle in ((None, full_reference.strict_full_rows),
                         (4, lambda *a, **k: topk_reference.strict_topk_rows(*a, topk=4, **k))):
        routed = jax.jit(jax.value_and_grad(lambda h, m: api.strict_kd_sum(
            (h, m), zt, s_ids, w, divergence="rkl", topk=topk, implementation="auto",
            chunk_rows=4), argnums=(0, 1)))
        want = jax.jit(jax.value_and_grad(lambda h, m: jnp.sum(oracle((h, m), zt, s_ids, w, divergence="rkl")),
                                          argnums=(0, 1)))
        (got_v, got_g), (want_v, want_g) = routed(hidden, lm_head), want(hidden, lm_head)
        assert float(got_v) == pytest.approx(float(want_v), rel=1e-5), topk
        for g, r in zip(got_g, want_g):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
    targets = jnp.asarray(rng.integers(0, 40, 6), jnp.int32)
    # a cotangent per row on both outputs (a span loss's is not uniform)
    c_lp, c_lse = (jnp.asarray(rng.normal(size=6), jnp.float32) for _ in range(2))
    mix = lambda out: jnp.sum(c_lp * out[0] + c_lse * out[1])
    got = jax.jit(jax.value_and_grad(lambda h, m: mix(token_rows(h, m, targets, implementation="auto",
                                                         chunk_rows=4)), argnums=(0, 1)))
    want = jax.jit(jax.value_and_grad(lambda h, m: mix(rows_reference.token_rows(h, m, targets, 1.0)),
                                      argnums=(0, 1)))
    (got_v, got_g), (want_v, want_g) = got(hidden, lm_head), want(hidden, lm_head)
    assert float(got_v) == pytest.approx(float(want_v), rel=1e-5)
    for g, r in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)


def test_auto_is_a_config_value():
    assert from_dict({"algorithm": {"name": "strict", "implementation": "auto"}}).algorithm.implementation == "auto"


def _row(pallas_s, grad_error=1e-6):
    return choices.measured_row(backend="gpu", device_kind="NVIDIA H100 80GB HBM3",
                                pallas_s=pallas_s, xla_s=0.0078, value_error=0.0,
                                grad_error=grad_error, measured="test", shape=[2048, 109567], k=16)


def test_a_measured_row_picks_pallas_only_where_it_agrees_and_wins():
    assert _row(0.0050)["choice"] == "pallas" and _row(0.0050)["xla_ms"] == 7.8
    assert _row(0.0090)["choice"] == "xla"                     # slower
    assert _row(0.0050, grad_error=1e-2)["choice"] == "xla"   # disagrees with xla


def test_recording_a_row_puts_it_before_its_backends_wildcard(tmp_path):
    shutil.copytree(Path(choices.__file__).parent / "strict_topk", tmp_path / "strict_topk")
    for pallas_s in (0.0050, 0.0090):            # a second measurement replaces the first
        choices.record("strict_topk", _row(pallas_s), root=tmp_path)
    rows = json.loads((tmp_path / "strict_topk" / "measured.json").read_text())["choices"]
    kinds = [(r["backend"], r["device_kind"]) for r in rows]
    at = kinds.index(("gpu", "NVIDIA H100 80GB HBM3"))
    assert kinds.count(("gpu", "NVIDIA H100 80GB HBM3")) == 1 and kinds[at + 1] == ("gpu", "*")
    assert rows[at]["choice"] == "xla" and rows[at]["pallas_ms"] == 9.0
    assert [r for r in rows if r is not rows[at]] == list(choices.table("strict_topk"))


def test_the_command_refuses_a_dry_run(tmp_path, capsys):
    result = tmp_path / "strict_kernels.json"
    result.write_text(json.dumps({"dry_run": True, "platform": "cpu",
                                  "results": {"table": {"strict_topk": _row(0.005)}}}))
    assert choices.main([str(result)]) == 2
    assert "dry run" in capsys.readouterr().err
    assert choices.main([str(tmp_path / "missing.json")]) == 2


def test_every_kernel_has_its_folder_and_table():
    # the per-kernel layout: kernels/<name>/ with its api, reference, xla and measured.json
    # (pallas.py where it has a Pallas kernel); only the package files and the divergences the
    # kernels and their references share (losses.py) sit flat in kernels/
    root = Path(choices.__file__).parent
    flat = sorted(p.name for p in root.glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "choices.py", "losses.py"], flat
    for kernel in choices.KERNELS:
        assert (root / kernel / "measured.json").is_file(), kernel
        assert set(choices.sizes(kernel)) >= {"why"}, kernel
    assert choices.sizes("strict_full")["block_cols"] == 128
