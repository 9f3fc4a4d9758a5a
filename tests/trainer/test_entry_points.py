"""Every entry point, every argument, as a real process: a bad argument (or a bad environment)
is exit status 2, one stderr line naming it, no traceback, and nothing written, neither in the
working folder nor in the temporary folder. Each command runs in an empty working folder of
its own (`runs/...` defaults would land there)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def non_utf8(tmp: Path) -> str:
    (tmp.parent / "bad.txt").write_bytes(b"\xff\xfe not text\n")
    return str(tmp.parent / "bad.txt")


# (name, module, argv given the input folder, extra environment, words in the line)
CASES = [
    ("train_unknown_key", "ctopd_jax.train", lambda t: ["--config", TINY, "--set", "model.x=1"],
     {}, "model.x"),
    ("train_teachers_empty", "ctopd_jax.train", lambda t: ["--config", TINY, "--set", "teachers=[]"],
     {}, "teachers: is empty"),
    ("train_jax_platforms", "ctopd_jax.train", lambda t: ["--config", TINY],
     {"JAX_PLATFORMS": "no_such_platform"}, "JAX_PLATFORMS='no_such_platform'"),
    ("train_device_count_word", "ctopd_jax.train", lambda t: ["--config", TINY],
     {"XLA_FLAGS": "--xla_force_host_platform_device_count=eight"}, "XLA_FLAGS"),
    ("train_device_count_zero", "ctopd_jax.train", lambda t: ["--config", TINY],
     {"XLA_FLAGS": "--xla_force_host_platform_device_count=0"}, "XLA_FLAGS"),
    ("evaluate_no_checkpoint", "ctopd_jax.evaluate", lambda t: ["--dataset", "demo"], {},
     "--checkpoint"),
    ("evaluate_samples_zero", "ctopd_jax.evaluate", lambda t: ["--grade-only", "x.jsonl",
                                                               "--samples", "0"], {}, "--samples"),
    ("inspect_pair_non_utf8", "ctopd_jax.inspect_pair",
     lambda t: ["--teacher", "tiny_bpe", "--student", "tiny_unigram", "--text", non_utf8(t)], {},
     "is not UTF-8 text"),
    ("inspect_pair_show_negative", "ctopd_jax.inspect_pair",
     lambda t: ["--teacher", "tiny_bpe", "--student", "tiny_unigram", "--show", "-1"], {}, "--show"),
    ("plot_missing", "ctopd_jax.plot", lambda t: [str(t / "none")], {}, "none"),
    ("plan_demo_sources_bad_device", "ctopd_jax.plan",
     lambda t: ["--config", TINY, "--device", "h1000"], {}, "--device"),
    ("demo_unknown_algorithm", "ctopd_jax.demo", lambda t: ["--algorithm", "nope"], {},
     "argument --algorithm: 'nope' is not a registered objective"),
    ("demo_unknown_only", "ctopd_jax.demo", lambda t: ["--compare", "--only", "strict", "nope"],
     {}, "argument --only: 'nope' is not a registered objective"),
    ("demo_steps_zero", "ctopd_jax.demo", lambda t: ["--algorithm", "opd", "--steps", "0"], {},
     "--steps"),
    ("demo_algorithm_bad_set", "ctopd_jax.demo",
     lambda t: ["--algorithm", "opd", "--set", "optimizer.lr=fast"], {}, "optimizer.lr"),
    ("pretrain_steps_zero", "ctopd_jax.demo.pretrain", lambda t: ["--steps", "0"], {}, "--steps"),
    ("setup_assets_unknown_flag", "ctopd_jax.setup_assets", lambda t: ["--bogus"],
     {}, "--bogus"),
    ("train_small_seed", "ctopd_jax.train_tokenizers", lambda t: ["--seed", "-1"], {},
     "--seed"),
    ("char_vocab_unknown_flag", "ctopd_jax.tokenization.char_vocab", lambda t: ["--bogus"], {},
     "--bogus"),
]


@pytest.mark.slow   # one process per case (~3 s each on 2 cores)
@pytest.mark.parametrize("name,module,argv,env,words", CASES, ids=[c[0] for c in CASES])
def test_a_bad_argument_is_one_line_exit_2_and_writes_nothing(tmp_path, name, module, argv, env,
                                                              words):
    work, temp = tmp_path / "work", tmp_path / "temp"
    work.mkdir()
    temp.mkdir()
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", module, *argv(inputs / "x")],
                          env={**base, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
                               "TMPDIR": str(temp), **env},
                          cwd=work, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"python -m {module}: error:") and words in lines[0], lines[0]
    assert not proc.stdout.strip()
    assert not list(work.iterdir()) and not list(temp.iterdir())


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("tiny*.yaml")))
def test_plan_resolves_the_demo_sources_of_every_shipped_tiny_config(config, capsys):
    """`demo:` model sources, which train accepts, are read from their config.json by plan too."""
    from ctopd_jax.common import cli
    from ctopd_jax.plan import planner as plan

    code = cli.run(plan.main, ["--config", str(ROOT / "configs" / config), "--device", "h100",
                               "--gpus", "1"], "python -m ctopd_jax.plan")
    out, err = capsys.readouterr()
    assert code == 0 and "FITS" in out and not err, err
    assert "ctopd_jax/assets/demo" in out        # the committed checkpoint's config.json
