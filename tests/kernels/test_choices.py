"""`implementation: auto` reads each kernel's table of measured choices (kernels/choices.py)."""
import json
import shutil
from pathlib import Path

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
