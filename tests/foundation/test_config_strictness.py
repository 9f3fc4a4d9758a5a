"""Issue 26, families 1, 2 and 4 (config side): YAML strictness, a range for every numeric field
and every command-line flag, messages that name fields which exist, and output paths.

The numeric-field and message tests enumerate the fields (every section and every registered
objective's own section) and the source's messages, so a field added later is covered without
editing this file."""
import dataclasses
import io
import re
import tokenize
import typing
from pathlib import Path

import pytest

from ctopd_jax import evaluate, inspect_pair
from ctopd_jax.algorithms import get_objective, registry
from ctopd_jax.common import cli
from ctopd_jax.config import (AlgorithmSection, ConfigError, TrainConfig, load_config,
                              load_yaml)
from ctopd_jax.demo import __main__ as demo
from ctopd_jax.plan import planner as plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- family 1: YAML

@pytest.mark.parametrize("text,key,line,first", [
    ("optimizer:\n  lr: 1.0e-3\nsteps: 3\noptimizer:\n  train_batch_size: 4\n", "'optimizer'", 4, 1),
    ("rollout:\n  top_p: 0.5\n  temperature: 1.0\n  top_p: 0.9\n", "'rollout.top_p'", 4, 2),
    ("steps: 3\nsteps: 4\n", "'steps'", 2, 1),
])
def test_a_duplicated_key_is_refused_with_its_name_and_lines(tmp_path, text, key, line, first):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    message = str(err.value)
    assert f"line {line}: key {key} appears twice (first on line {first})" in message
    assert "\n" not in message and "c.yaml" in message


def test_the_same_key_in_different_sections_is_fine():
    tree = load_yaml("data:\n  seed: 1\nseed: 2\n")
    assert tree == {"data": {"seed": 1}, "seed": 2}


@pytest.mark.parametrize("text,where,key", [
    ("1: 3\n", "config", "1"), ("optimizer:\n  2: 3\n", "optimizer", "2"),
    ("rollout:\n  null: 3\n", "rollout", "None"), ("algorithm:\n  true: 1\n", "algorithm", "True"),
])
def test_a_key_that_is_not_a_name_is_one_config_error(tmp_path, text, where, key):
    with pytest.raises(ConfigError, match=rf"^{where}: key {key} is not a name; use one of"):
        load_config(write(tmp_path, text))


def test_a_file_without_an_algorithm_section_gets_the_default_objective(tmp_path):
    cfg = load_config(write(tmp_path, "steps: 2\n"))
    assert type(cfg.algorithm) is registry()[AlgorithmSection.name].settings_class
    assert type(TrainConfig().algorithm) is type(cfg.algorithm)
    assert get_objective(cfg.algorithm).settings is cfg.algorithm   # what crashed in preflight


# ----------------------------------------------------------------------------- family 2: numbers

def numeric_fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            if hint is not AlgorithmSection:   # objectives are enumerated below, each own class
                yield from numeric_fields(hint, prefix + f.name + ".")
        elif hint in (int, float) or (typing.get_origin(hint) is tuple
                                      and set(typing.get_args(hint)) <= {int, float}):
            yield prefix + f.name, hint


NUMERIC_CASES = [(name, "topk_strict") for name, _ in numeric_fields(TrainConfig)] + [
    (name, objective) for objective, cls in sorted(registry().items())
    for name, _ in numeric_fields(cls.settings_class, "algorithm.")
    if name not in {n for n, _ in numeric_fields(AlgorithmSection, "algorithm.")}]


@pytest.mark.parametrize("field_name,objective", NUMERIC_CASES,
                         ids=[f"{o}:{n}" for n, o in NUMERIC_CASES])
def test_every_numeric_field_refuses_a_negative_value_naming_itself(field_name, objective):
    """-7 is out of range for every numeric field (-1 alone means "off" / "fill" where it does);
    the one-line error names the field the user wrote."""
    is_pair = typing.get_origin(dict(numeric_fields(TrainConfig)).get(field_name)) is tuple
    value = "[-7, -7]" if is_pair else "-7"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"algorithm.name={objective}", f"{field_name}={value}"])
    assert str(err.value).startswith(field_name), str(err.value)


@pytest.mark.parametrize("override,field_name", [
    ("seed=4294967296", "seed"), ("data.seed=-1", "data.seed"),
    ("evaluation.every=-1", "evaluation.every"), ("evaluation.max_problems=-2",
                                                  "evaluation.max_problems"),
    ("optimizer.train_batch_size=0", "optimizer.train_batch_size"),
    ("optimizer.eps=0", "optimizer.eps"),
    ("rollout.vllm_gpu_memory_utilization=0", "rollout.vllm_gpu_memory_utilization"),
    ("rollout.vllm_gpu_memory_utilization=1.5", "rollout.vllm_gpu_memory_utilization"),
])
def test_zero_and_out_of_range_values(override, field_name):
    with pytest.raises(ConfigError, match=rf"^{re.escape(field_name)}: "):
        load_config(None, [override])


def known_field_names() -> set[str]:
    names = set()

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            names.add(prefix + f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")
    walk(TrainConfig, "")
    for cls in registry().values():
        walk(cls.settings_class, "algorithm.")
    return names


SECTIONS = "|".join(name for name, hint in typing.get_type_hints(TrainConfig).items()
                    if dataclasses.is_dataclass(hint))
FIELD_IN_TEXT = re.compile(rf"(?<![\w.{{])({SECTIONS})\.([a-z_][a-z0-9_]*)\b(?!\.py|\.weight|\.)")


def test_every_field_a_message_names_exists():
    """A message that tells the user to change `rollout.max_new_tokens` sends them to a field
    that does not exist: every `section.key` inside a string literal of the package (docstrings
    and the model-file code under models/ aside) must be a config field."""
    known, wrong = known_field_names(), []
    for path in sorted((ROOT / "ctopd_jax").rglob("*.py")):
        if "models" in path.relative_to(ROOT).parts:   # HF config.json fields, not ours
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            text = tok.string.lstrip("rbfuRBFU")
            if tok.type != tokenize.STRING or text.startswith(('"""', "'''")):
                continue
            text = re.sub(r"\{[^{}]*\}", "{}", text)     # f-string fields are code
            wrong += [f"{path.name}:{tok.start[0]}: {m.group(0)}"
                      for m in FIELD_IN_TEXT.finditer(text) if m.group(0) not in known]
    assert not wrong, wrong
    assert FIELD_IN_TEXT.search('"lower rollout.max_new_tokens"')   # the scan finds one


# ----------------------------------------------------------------------------- flags

def run_cli(capsys, main, argv, prog):
    capsys.readouterr()
    code = cli.run(main, argv, prog)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and not out.strip()
    return err


@pytest.mark.parametrize("flag,value,expect", [
    ("--mfu", "0", "(0, 1]"), ("--mfu", "-0.3", "(0, 1]"), ("--prefill-mfu", "1.5", "(0, 1]"),
    ("--prefill-mfu", "nan", "finite"), ("--fill", "0", "(0, 1]"), ("--gpus", "0", ">= 1"),
    ("--xla-mem-fraction", "2", "(0, 1]"), ("--vocab-shared", "-5", ">= 1"),
])
def test_plan_flags_are_range_checked(capsys, flag, value, expect):
    err = run_cli(capsys, plan.main, ["--config", str(TINY), "--device", "h100", flag, value],
                  "python -m ctopd_jax.plan")
    assert f"argument {flag}: " in err and expect in err


def test_plan_with_a_valid_mfu_still_plans(capsys):
    assert cli.run(plan.main, ["--config", str(TINY), "--device", "h100", "--gpus", "1",
                               "--student-preset", "tiny_llama", "--teacher-preset",
                               "tiny_qwen2", "--mfu", "0.5"], "plan") == 0
    out = capsys.readouterr().out
    seconds = [float(s) for s in re.findall(r"student step (\d+(?:\.\d+)?) s", out)]
    assert seconds and all(s >= 0 for s in seconds)


@pytest.mark.parametrize("flag,value,expect", [
    ("--timeout", "0", "> 0"), ("--timeout", "-1", "> 0"), ("--seed", "-1", "[0, 2**32)"),
    ("--workers", "0", ">= 1"), ("--samples", "-2", ">= 1"), ("--limit", "x", "integer"),
])
def test_evaluate_flags_are_range_checked(capsys, flag, value, expect):
    err = run_cli(capsys, lambda a: (evaluate.main(a), 0)[1],
                  ["--grade-only", "none.jsonl", flag, value], evaluate.PROG)
    assert f"argument {flag}: " in err and expect in err


def test_demo_and_inspect_pair_counts_are_range_checked(capsys):
    err = run_cli(capsys, lambda a: demo.run(a) and 0, ["--steps", "0"], demo.PROG)
    assert "argument --steps: 0 must be >= 1" in err
    err = run_cli(capsys, inspect_pair._main, ["--teacher", "x", "--student", "y",
                                               "--show", "-1"], inspect_pair.PROG)
    assert "argument --show: -1 must be >= 0" in err


# ----------------------------------------------------------------------------- family 4 (config)

def test_an_empty_output_dir_is_refused():
    with pytest.raises(ConfigError, match=r"^output_dir: is empty"):
        load_config(None, ["output_dir="])
    with pytest.raises(ConfigError, match=r"^output_dir: is empty"):
        load_config(None, ["output_dir=' '"])


def test_a_leading_tilde_is_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["output_dir=~/runs/a", "checkpoint.dir=~/ck", "data.path=~/p.jsonl"])
    assert cfg.output_dir == str(tmp_path / "runs" / "a")
    assert cfg.checkpoint.dir == str(tmp_path / "ck") and cfg.data.path == str(tmp_path / "p.jsonl")
    assert load_config(None, ["output_dir=runs/~x"]).output_dir == "runs/~x"   # not leading
