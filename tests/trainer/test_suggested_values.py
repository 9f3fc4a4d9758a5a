"""A refusal's suggested value must itself work: every example a message offers (`--set a.b=V`,
`a.b=V`, `e.g. V` for the field refused, `--mesh V`, `--gpus N`, `ENV=V`, `to <= N`, `to N or
more`) is extracted from the message and used, and the command then gets past the check that
refused it (it starts, or a later check refuses something else). The training cases stop where
the run would load its models (preflight passed: `train._train` is replaced)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ctopd_jax import train
from ctopd_jax.common import cli
from ctopd_jax.plan import planner as plan

ROOT = Path(__file__).resolve().parents[2]
TINY, SAME = str(ROOT / "configs" / "tiny_cpu.yaml"), str(ROOT / "configs" / "tiny_cpu_same.yaml")

_SETTING = re.compile(r"(?<![\w.-])([a-z_]+(?:\.[a-z_0-9]+)+)=('[^']*'|[^\s,;()]+)")
_FLAG = re.compile(r"(--mesh|--gpus) ([^\s;()]*[^\s,;().])")
_ENV = re.compile(r"\b([A-Z][A-Z_]+)=([^\s,;()]+)")
_EXAMPLE = re.compile(r"e\.g\. ([^;()]+)")
_BOUND = re.compile(r"to (?:<= )?(\d+)(?: or more)?")


def suggestions(message: str, field: str) -> list[tuple[str, str, str]]:
    """(kind, name, value) of every example value in the fix part of `message` (after its
    first `; `: the part before states the value refused): kind `set` (a config field), `flag`
    or `env`; a bare example or bound applies to `field`, the field refused. A syntax template
    (`write section.key=value`) and an `=N` placeholder are no values."""
    message = message.split("; ", 1)[-1]
    message = re.sub(r"write \S+", "", message)
    out = [("env", k, v.rstrip(".")) for k, v in _ENV.findall(message) if not v.endswith("=N")]
    out += [("flag", k, v.rstrip(".")) for k, v in _FLAG.findall(message)]
    out += [("set", k, v.rstrip(".")) for k, v in _SETTING.findall(message)]
    for example in _EXAMPLE.findall(message):
        for value in re.split(r",\s*|\s+or\s+", example.strip()):
            if value and " " not in value and "=" not in value and not value.startswith("-"):
                out.append(("set", field, value.rstrip(".")))
    out += [("set", field, n) for n in _BOUND.findall(message)]
    seen = []
    return [s for s in out if not (s in seen or seen.append(s))]


def applied(argv: list[str], kind: str, name: str, value: str) -> tuple[list[str], dict]:
    """`argv` with the suggestion in place of what it replaces (the same --set key or flag)."""
    pairs = list(zip(argv[::2], argv[1::2]))
    if kind == "set":
        kept = [(a, b) for a, b in pairs if not (a == "--set" and b.split("=")[0] == name)]
        return [x for pair in kept for x in pair] + ["--set", f"{name}={value}"], {}
    if kind == "flag":
        return [x for pair in pairs if pair[0] != name for x in pair] + [name, value], {}
    return argv, {name: value}


@pytest.fixture
def started(monkeypatch):
    """train._train replaced: a run that reaches it has passed every check."""
    monkeypatch.setattr(train, "_train", lambda config, pre, args, writer: 0)


def saved_checkpoint(run: Path) -> None:
    """A run folder at step 2 (what preflight reads of it: meta and config.json)."""
    from ctopd_jax.config import load_config

    (run / "checkpoints" / "2" / "meta").mkdir(parents=True)
    (run / "checkpoints" / "2" / "meta" / "metadata").write_text(json.dumps({"step": 2}))
    (run / "config.json").write_text(load_config(TINY, [f"output_dir={run}"]).to_json())


# (name, setup(tmp) -> argv after `--config`, the field refused)
TRAIN = [
    ("teacher_base_of_opd2", lambda t: [SAME, "--set", "algorithm.name=opd2",
                                        "--set", "model.teacher_base="], "model.teacher_base"),
    ("mesh_vs_devices", lambda t: [TINY, "--mesh", "data=3"], "mesh"),
    ("mesh_unknown_axis", lambda t: [TINY, "--mesh", "pipeline=2"], "mesh"),
    ("set_without_value", lambda t: [TINY, "--set", "optimizer.lr"], "--set"),
    ("output_dir_empty", lambda t: [TINY, "--set", "output_dir="], "output_dir"),
    ("beyond_positions", lambda t: [TINY, "--set", "rollout.generate_max_len=100000"],
     "rollout.generate_max_len"),
    ("preset_without_tokenizer", lambda t: [TINY, "--set", "model.student=tiny_llama",
                                            "--set", "model.student_tokenizer="],
     "model.student_tokenizer"),
    ("fewer_steps_on_resume", lambda t: (saved_checkpoint(t / "run"), [
        TINY, "--resume", "--allow-config-change", "--set", "steps=1"])[1], "steps"),
    ("environment_without_episodes", lambda t: [
        str(ROOT / "configs" / "tiny_cpu_tools.yaml"), "--set", "algorithm.name=topk_strict"],
     "rollout.environment"),
]


def refused(capsys, argv) -> str | None:
    """The error line of `train` with `argv`, or None when it started."""
    capsys.readouterr()
    code = train.main(argv)
    _, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code in (0, 2) and "Traceback" not in err, err[-3000:]
    return errors[-1] if code else None


@pytest.mark.parametrize("name,setup,field", TRAIN, ids=[c[0] for c in TRAIN])
def test_every_value_a_training_refusal_suggests_works(tmp_path, monkeypatch, capsys, started,
                                                       name, setup, field):
    monkeypatch.chdir(tmp_path)           # a relative example (runs/my_run) lands here
    config, *rest = setup(tmp_path)
    argv = ["--config", config, "--set", f"output_dir={tmp_path / 'run'}", *rest]
    message = refused(capsys, argv)
    assert message and field in message, message
    offered = suggestions(message.split("error:", 1)[1], field)
    assert offered, f"no example value in: {message}"
    with capsys.disabled():
        print(f"\n[{name}] {message}\n  tried: {offered}")
    for kind, key, value in offered:
        fixed, env = applied(argv, kind, key, value)
        if env:   # JAX reads it once per process: test_every_environment_value_...
            continue
        again = refused(capsys, fixed)
        assert again is None or field not in again.split("error:", 1)[1].split(":")[0], \
            (kind, key, value, again)


@pytest.mark.parametrize("env,field", [
    ({"JAX_PLATFORMS": "no_such_platform"}, "JAX_PLATFORMS"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=two"}, "XLA_FLAGS"),
])
def test_every_environment_value_a_refusal_suggests_works(tmp_path, env, field):
    """In processes of their own (JAX reads both once); the run is stopped right after JAX
    starts by a missing data file, a refusal that is not about the environment."""
    argv = [sys.executable, "-m", "ctopd_jax.train", "--config", TINY, "--set",
            f"output_dir={tmp_path / 'run'}", "--set", f"data.path={tmp_path / 'none.jsonl'}"]
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}

    def error(extra):
        proc = subprocess.run(argv, env={**base, "PYTHONPATH": str(ROOT), **extra}, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return proc.stderr.strip().splitlines()[-1]
    message = error(env)
    assert f"error: {field}" in message, message
    offered = [s for s in suggestions(message.split("error:", 1)[1], field) if s[0] == "env"]
    assert offered, message
    for _, key, value in offered:
        again = error({**env, key: value})
        assert field not in again and "data.path" in again, (key, value, again)


def test_every_value_the_plan_refusal_suggests_works(capsys):
    argv = ["--config", TINY, "--device", "h100"]
    run = lambda a: cli.run(plan.main, a, "python -m ctopd_jax.plan")
    assert run(argv) == 2
    message = capsys.readouterr().err.strip()
    offered = suggestions(message.split("error:", 1)[1], "--gpus")
    assert ("flag", "--gpus", "8") in offered, message
    for kind, key, value in offered:
        code = run(applied(argv, kind, key, value)[0])
        assert code in (0, 1), capsys.readouterr().err    # a plan: it fits (0) or not (1)


def test_the_extractor_finds_what_messages_offer():
    """The extraction itself, on messages of the forms above (the oracle is read off by eye)."""
    assert suggestions("model.teacher_base: needs a base; set model.teacher_base (e.g. "
                       "demo:char_teacher_base)", "model.teacher_base") == [
        ("set", "model.teacher_base", "demo:char_teacher_base")]
    assert suggestions("lower rollout.generate_max_len to <= 236 or rollout.max_prompt_len",
                       "rollout.generate_max_len") == [("set", "rollout.generate_max_len", "236")]
    assert suggestions("set algorithm.kd_temperature=1.0 or teacher.engine=local", "x") == [
        ("set", "algorithm.kd_temperature", "1.0"), ("set", "teacher.engine", "local")]
    assert suggestions("(e.g. --mesh data=8)", "mesh") == [("flag", "--mesh", "data=8")]
    assert suggestions("e.g. JAX_PLATFORMS=cpu, or unset it", "JAX_PLATFORMS") == [
        ("env", "JAX_PLATFORMS", "cpu")]
