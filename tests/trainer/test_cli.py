"""Numbers as people write them, in YAML files, --set and the launch scripts' configs; --help
of every command says more than the usage line and names its real program."""
import math

import pytest

from ctopd_jax.config import ConfigError, load_config, load_yaml, parse_override

FORMS = [("1e-5", 1e-5), ("1E5", 1e5), (".5", 0.5), ("1.0e38", 1e38), ("-2e-6", -2e-6),
         ("1.0e-6", 1e-6), ("+3e2", 300.0), ("2.", 2.0), ("-.25e-1", -0.025), ("1_000.5", 1000.5)]


@pytest.mark.parametrize("text,value", FORMS)
def test_yaml_and_set_read_numbers_as_written(tmp_path, text, value):
    assert load_yaml(text) == value and isinstance(load_yaml(text), float)
    assert parse_override(f"optimizer.lr={text}") == ("optimizer.lr", value)
    if value > 0:
        path = tmp_path / "c.yaml"
        path.write_text(f"optimizer:\n  lr: {text}\n  min_lr: 0\n")
        assert load_config(path).optimizer.lr == value
        assert load_config(None, [f"optimizer.lr={text}", "optimizer.min_lr=0"]).optimizer.lr == value


@pytest.mark.parametrize("text", ["1e", "e5", "1.2.3", "0x1p3", "."])
def test_non_numbers_stay_strings(text):
    assert isinstance(load_yaml(text), str)


def test_integers_stay_integers_and_integral_floats_fill_integer_fields():
    assert load_yaml("10") == 10 and isinstance(load_yaml("10"), int)
    assert load_config(None, ["steps=1e3"]).steps == 1000
    with pytest.raises(ConfigError, match=r"^steps: expected an integer, got 2\.5"):
        load_config(None, ["steps=2.5"])


@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan", "nan", "inf", "-Infinity"])
@pytest.mark.parametrize("field", ["optimizer.lr", "rollout.temperature", "guard.loss_jump_factor"])
def test_non_finite_numbers_are_rejected_for_every_float_field(field, text):
    with pytest.raises(ConfigError, match=rf"^{field}: .* is not a finite number"):
        load_config(None, [f"{field}={text}"])


def test_the_paper_configs_still_read():
    for name in ("paper_8gpu_strict_full", "paper_8gpu_strict_top16", "single_gpu_full_workload",
                 "tiny_cpu"):
        config = load_config(f"configs/{name}.yaml")
        assert math.isfinite(config.optimizer.lr) and config.optimizer.lr > 0


@pytest.mark.parametrize("module,words", [
    ("ctopd_jax.train", ["Exit status", "--allow-config-change", "XLA_FLAGS"]),
    ("ctopd_jax.inspect_pair", ["strict coverage", "--show"]),
    ("ctopd_jax.plot", ["metrics.jsonl", "RUN_DIR"]),
    ("ctopd_jax.evaluate", ["mean@K", "--grade-only"]),
    ("ctopd_jax.config_doc", ["docs/config.md"]),
])
def test_help_describes_the_command_under_its_program_name(module, words, capsys):
    import importlib
    main = importlib.import_module(module)
    entry = getattr(main, "cli_main", main.main)
    assert entry(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {module}")
    assert all(w in out for w in words + ["--debug"]), out
