"""Every bad input of the command lines: one line naming the field or file, exit status 2, no
traceback, nothing written to disk, and no model weight loaded (the loaders are replaced by
tripwires). The in-process cases call each command's main(argv); two subprocess cases prove the
exit status and the absence of a traceback in a real process. Seconds to the error are printed
(`pytest -s`), never asserted."""
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctopd_jax import evaluate, inspect_pair, plot, train
import ctopd_jax.algorithms  # noqa: F401  (heavy imports at collection, not inside a test)
import ctopd_jax.data.prompts  # noqa: F401
from ctopd_jax.demo import __main__ as demo
import ctopd_jax.models  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
DEMO_STUDENT = ROOT / "ctopd_jax" / "assets" / "demo" / "student"
TIMES: dict[str, float] = {}


@pytest.fixture(autouse=True)
def no_weights_loaded(monkeypatch):
    """Any model load is a test failure (AssertionError is no user error: it propagates)."""
    def tripwire(*args, **kwargs):
        raise AssertionError("a model was loaded before the error was reported")

    import ctopd_jax.loop.build as build
    import ctopd_jax.models.weights as weights
    monkeypatch.setattr(weights, "load_hf_checkpoint", tripwire)
    monkeypatch.setattr(build, "load_side", tripwire)


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def checkpoint_step(run: Path, step: int, meta: dict | None) -> None:
    d = run / "checkpoints" / str(step)
    (d / "state").mkdir(parents=True)
    if meta is not None:
        (d / "meta").mkdir()
        (d / "meta" / "metadata").write_text(json.dumps(meta))


def tiny_config_dict(out: Path) -> dict:
    from ctopd_jax.config import load_config
    return load_config(TINY, [f"output_dir={out}"]).to_dict()


# ----------------------------------------------------------------------------- setups
# each returns the argv after `--config TINY --set output_dir=<run>`

def bad_jsonl_row(tmp, run):
    p = tmp / "bad.jsonl"
    p.write_text('{"prompt": "What is 1 + 1?"}\n{"prompt": "unterminated\n')
    return ["--set", f"data.path={p}"]


def binary_data(tmp, run):
    p = tmp / "bin.jsonl"
    p.write_bytes(b'{"prompt": "What is 1 + 1?"}\n\xff\xfe\n')
    return ["--set", f"data.path={p}"]


def truncated_shard(tmp, run):
    d = tmp / "student"
    shutil.copytree(DEMO_STUDENT, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return ["--set", f"model.student={d}"]


def garbage_shard(tmp, run):  # what safetensors reports as "incomplete metadata"
    d = tmp / "student"
    shutil.copytree(DEMO_STUDENT, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00")
    return ["--set", f"model.student={d}"]


def shape_mismatch(tmp, run):
    d = tmp / "student"
    shutil.copytree(DEMO_STUDENT, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(cfg))
    return ["--set", f"model.student={d}"]


def missing_shard(tmp, run):
    d = tmp / "student"
    shutil.copytree(DEMO_STUDENT, d)
    (d / "model.safetensors").unlink()
    return ["--set", f"model.student={d}"]


def existing_checkpoints(tmp, run):
    checkpoint_step(run, 2, {"step": 2, "config": tiny_config_dict(run)})
    return []


def all_unreadable(tmp, run):
    checkpoint_step(run, 2, None)
    checkpoint_step(run, 4, None)
    return ["--resume"]


def changed_config(tmp, run):
    checkpoint_step(run, 2, {"step": 2})
    saved = tiny_config_dict(run)
    (run / "config.json").write_text(json.dumps(saved))
    return ["--resume", "--set", "optimizer.lr=2e-3", "--set", "data.seed=7"]


def yaml_nan(tmp, run):
    cfg = tmp / "nan.yaml"
    cfg.write_text(Path(TINY).read_text().replace("lr: 1.0e-3", "lr: .nan"))
    return ["--config", str(cfg)]


def yaml_variant(tmp, text_edit):
    cfg = tmp / "variant.yaml"
    cfg.write_text(text_edit(Path(TINY).read_text()))
    return ["--config", str(cfg)]


def duplicated_section(tmp, run):   # a second `optimizer:` would silently replace the first
    return yaml_variant(tmp, lambda t: t + "optimizer:\n  lr: 5.0e-3\n")


def non_string_key(tmp, run):
    return yaml_variant(tmp, lambda t: t.replace("rollout:\n", "rollout:\n  3: 4\n"))


def without_algorithm_section(tmp, run):
    """The default objective's own section: preflight runs its pair check (which crashed on the
    base section) and reaches the prompt-length check after it."""
    text = Path(TINY).read_text()
    start, end = text.index("algorithm:"), text.index("optimizer:")
    return yaml_variant(tmp, lambda t: t[:start] + t[end:]) + ["--set", "rollout.max_prompt_len=3"]


def output_dir_is_file(tmp, run):
    (tmp / "a_file").write_text("keep me")
    return ["--set", f"output_dir={tmp / 'a_file'}"]


def output_parent_is_file(tmp, run):
    (tmp / "a_file").write_text("keep me")
    return ["--set", f"output_dir={tmp / 'a_file' / 'run'}"]


def checkpoint_dir_is_file(tmp, run):
    (tmp / "a_file").write_text("keep me")
    return ["--set", f"checkpoint.dir={tmp / 'a_file'}"]


def live_lock(tmp, run):   # another run (this test process, alive) holds the folder
    import os
    import socket
    run.mkdir()
    (run / ".run.lock").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                               "started": "2026-01-01T00:00:00"}))
    return []


def unencodable_prompt(tmp, run):
    """The student tokenizer without byte fallback: '€' can only become <unk>."""
    tok = tmp / "tok"
    tok.mkdir()
    shutil.copy(DEMO_STUDENT / "tokenizer_config.json", tok)
    spec = json.loads((DEMO_STUDENT / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = False
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    data = tmp / "euro.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?"}\n{"prompt": "What is 3 € + 2?"}\n')
    return ["--set", f"model.student_tokenizer={tok}", "--set", f"data.path={data}"]


def lone_surrogate(tmp, run):   # valid JSON, no UTF-8: the tokenizer raised a TypeError
    p = tmp / "surrogate.jsonl"
    p.write_text('{"prompt": "What is 1 + 1?"}\n{"prompt": "What is \\ud800 + 2?"}\n')
    return ["--set", f"data.path={p}"]


def long_eval_problem(tmp, run):   # would crash the first evaluation, at the end of training
    data = tmp / "eval.jsonl"
    data.write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n'
                    '{"problem": "What is ' + "1 + " * 60 + '1?", "answer": "61"}\n')
    return ["--set", f"evaluation.dataset={data}"]


def adapter_folder(tmp, r, weights=b"\x10\x00"):
    folder = tmp / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 16.0,
         "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return ["--set", "lora.rank=4", "--set", f"lora.init_adapter={folder}"]


TRAIN_CASES = [
    # second round (issue 26): YAML, ranges, late checks, output folders, one run per folder
    ("duplicated_section", duplicated_section, "key 'optimizer' appears twice"),
    ("non_string_key", non_string_key, "rollout: key 3 is not a name"),
    ("no_algorithm_section", without_algorithm_section, "rollout.max_prompt_len"),
    ("data_seed_negative", lambda t, r: ["--set", "data.seed=-1"], "data.seed"),
    ("eval_every_negative", lambda t, r: ["--set", "evaluation.every=-1"], "evaluation.every"),
    ("output_dir_empty", lambda t, r: ["--set", "output_dir="], "output_dir: is empty"),
    ("output_dir_is_file", output_dir_is_file, "is a file, not a folder"),
    ("output_parent_is_file", output_parent_is_file, "output_dir"),
    ("checkpoint_dir_is_file", checkpoint_dir_is_file, "checkpoint.dir"),
    ("output_dir_in_use", live_lock, "is in use by another run"),
    ("beyond_positions", lambda t, r: ["--set", "rollout.generate_max_len=100000"],
     "rollout.generate_max_len"),
    ("unencodable_prompt", unencodable_prompt, "euro.jsonl:2: the student tokenizer"),
    ("eval_prompt_too_long", long_eval_problem, "the training engine accepts"),
    ("adapter_missing", lambda t, r: ["--set", "lora.rank=4", "--set",
                                      f"lora.init_adapter={t / 'none'}"], "lora.init_adapter"),
    ("adapter_other_rank", lambda t, r: adapter_folder(t, 2), "lora.rank: 4 but the adapter"),
    ("adapter_truncated", lambda t, r: adapter_folder(t, 4), "not a complete safetensors file"),
    ("adapter_without_rank", lambda t, r: ["--set", f"lora.init_adapter={t}"], "lora.init_adapter"),
    ("teacher_base_missing", lambda t, r: ["--set", f"model.teacher_base={t / 'no_base'}"],
     "model.teacher_base"),
    # point 1: numbers
    ("lr_inf", lambda t, r: ["--set", "optimizer.lr=.inf"], "optimizer.lr"),
    ("lr_nan_in_yaml", yaml_nan, "optimizer.lr"),
    ("lr_word", lambda t, r: ["--set", "optimizer.lr=fast"], "optimizer.lr"),
    ("steps_zero", lambda t, r: ["--set", "steps=0"], "steps"),
    ("unknown_key", lambda t, r: ["--set", "algorithm.nam=strict"], "algorithm.nam"),
    ("missing_config", lambda t, r: ["--config", str(t / "none.yaml")], "none.yaml"),
    # point 2 / 3: data, tokenizers, pair, shards, objective, engine, mesh, checkpoints
    ("missing_data", lambda t, r: ["--set", f"data.path={t / 'none.jsonl'}"], "data.path"),
    ("malformed_row", bad_jsonl_row, "bad.jsonl:2"),
    ("binary_data", binary_data, "bin.jsonl:2: not UTF-8"),
    # fourth round (issue 43)
    ("lone_surrogate", lone_surrogate, "surrogate.jsonl:2: prompt holds a lone surrogate"),
    # the demo student: hidden 128, k_proj / v_proj 64 x 128 (its config.json)
    ("lora_rank_above_hidden", lambda t, r: ["--set", "lora.rank=129"],
     "lora.rank: 129 is above what the student's k_proj (64 x 128, hidden_size 128)"),
    ("lora_rank_above_kv", lambda t, r: ["--set", "lora.rank=65", "--set",
                                         "lora.target_modules=[k_proj]"], "at most 64"),
    ("missing_teacher_tok", lambda t, r: ["--set", f"model.teacher_tokenizer={t / 'no_tok'}"],
     "model.teacher_tokenizer"),
    ("missing_student_tok", lambda t, r: ["--set", "model.student_tokenizer=nosuchtok"],
     "model.student_tokenizer"),
    ("missing_model", lambda t, r: ["--set", f"model.teacher={t / 'no_model'}"], "model.teacher"),
    ("truncated_shard", truncated_shard, "model.safetensors"),
    ("garbage_shard", garbage_shard, "model.safetensors"),
    ("missing_shard", missing_shard, "model.student"),
    ("shape_mismatch", shape_mismatch, "config.json"),
    ("no_prompt_fits", lambda t, r: ["--set", "rollout.max_prompt_len=3"], "rollout.max_prompt_len"),
    ("topk_above_shared", lambda t, r: ["--set", "algorithm.ctkd_topk=100000"], "algorithm.ctkd_topk"),
    ("unknown_algorithm", lambda t, r: ["--set", "algorithm.name=nope"], "algorithm.name"),
    ("mesh_unknown_axis", lambda t, r: ["--mesh", "data=1,pipeline=2"], "pipeline"),
    ("mesh_not_int", lambda t, r: ["--mesh", "data=two"], "mesh.data"),
    ("mesh_vs_devices", lambda t, r: ["--mesh", "data=3"], "XLA_FLAGS"),
    ("checkpoints_without_resume", existing_checkpoints, "--resume"),
    ("resume_nothing", lambda t, r: ["--resume"], "--resume"),
    ("all_checkpoints_unreadable", all_unreadable, "none of the checkpoints"),
    ("resume_changed_config", changed_config, "optimizer.lr"),
    ("allow_change_without_resume", lambda t, r: ["--allow-config-change"], "--resume"),
]


def run_case(capsys, name, main, argv, tmp_path):
    capsys.readouterr()   # drop what earlier calls printed
    before = files_under(tmp_path)
    start = time.perf_counter()
    code = main(argv)
    TIMES[name] = time.perf_counter() - start
    out, err = capsys.readouterr()
    print(f"\n[{name}] {TIMES[name]:.2f} s to the error: {err.strip()}")
    assert code == 2, (code, err)
    assert err.strip() and "\n" not in err.strip(), err   # exactly one line
    assert "Traceback" not in err and not out.strip()
    assert files_under(tmp_path) == before                 # nothing written
    return err


@pytest.mark.parametrize("name,setup,field", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_bad_input(tmp_path, capsys, name, setup, field):
    run = tmp_path / "run"
    extra = setup(tmp_path, run)
    config = [] if "--config" in extra else ["--config", TINY]
    err = run_case(capsys, name, train.main, config + ["--set", f"output_dir={run}"] + extra,
                   tmp_path)
    assert err.startswith("python -m ctopd_jax.train: error:") and field in err
    if (tmp_path / "a_file").exists():   # the file in the way is left as it was
        assert (tmp_path / "a_file").read_text() == "keep me"


@pytest.mark.parametrize("code,where,field,words", [
    ("ENOSPC", "metrics.jsonl", "output_dir", "no space left on device (ENOSPC); free space"),
    ("EROFS", "checkpoints/4", "checkpoint.dir", "read-only file system (EROFS); choose a"),
])
def test_train_refused_write_during_the_run_is_one_line(tmp_path, capsys, monkeypatch, code,
                                                        where, field, words):
    """A write the disk refuses after preflight (the trainer stands in: it raises what a full or
    read-only disk raises) is one line naming the field and the path; the lock is released and
    the folder it made is removed."""
    import errno
    import os

    import ctopd_jax.loop.trainer as trainer
    run = tmp_path / "run"

    class RefusedWrite:
        def __init__(self, config, **kwargs):
            assert (run / ".run.lock").is_file()     # held while the run works

        def train(self, resume=False, stop=None, on_resumed=None):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(run / where))
    monkeypatch.setattr(trainer, "Trainer", RefusedWrite)
    err = run_case(capsys, f"refused_write_{code}", train.main,
                   ["--config", TINY, "--set", f"output_dir={run}"], tmp_path)
    assert f"error: {field}: {run / where}: {words}" in err


@pytest.mark.parametrize("field", ["output_dir", "checkpoint.dir"])
def test_train_read_only_output_folder(tmp_path, capsys, read_only_dir, field):
    argv = ["--config", TINY, "--set", f"output_dir={tmp_path / 'run'}",
            "--set", f"{field}={read_only_dir / 'x'}"]
    err = run_case(capsys, f"read_only_{field}", train.main, argv, tmp_path)
    assert f"{field} {read_only_dir / 'x'}" in err and "read-only file system" in err


def test_train_pair_without_shared_token(tmp_path, capsys, monkeypatch):
    import ctopd_jax.tokenization.overlap as overlap

    def none_shared(teacher, student, rule=None):
        raise overlap.NoOverlapError("overlap: 'a' and 'b' share no token under the 'bytes' rule")
    monkeypatch.setattr(overlap, "overlap_map", none_shared)
    err = run_case(capsys, "no_shared_token", train.main,
                   ["--config", TINY, "--set", f"output_dir={tmp_path / 'run'}"], tmp_path)
    assert "model.teacher_tokenizer / model.student_tokenizer" in err and "share no token" in err


def test_train_vllm_engine_without_vllm(tmp_path, capsys):
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    err = run_case(capsys, "vllm_missing", train.main,
                   ["--config", TINY, "--set", f"output_dir={tmp_path / 'run'}",
                    "--set", "rollout.engine=vllm"], tmp_path)
    assert "rollout.engine" in err and "rollout.engine=jax" in err


def test_debug_flag_shows_the_traceback(tmp_path):
    from ctopd_jax.config import ConfigError
    with pytest.raises(ConfigError, match="optimizer.lr"):
        train.main(["--config", TINY, "--set", f"output_dir={tmp_path}", "--set",
                    "optimizer.lr=.inf", "--debug"])


# ----------------------------------------------------------------------------- other commands

def test_plot_missing_dir_and_empty_log(tmp_path, capsys):
    err = run_case(capsys, "plot_missing", plot.main, [str(tmp_path / "nope")], tmp_path)
    assert "nope" in err and "run directory" in err
    (tmp_path / "metrics.jsonl").write_text("")
    err = run_case(capsys, "plot_empty", plot.main, [str(tmp_path)], tmp_path)
    assert "metrics.jsonl" in err and "no rows" in err


@pytest.mark.parametrize("flag", ["--samples", "--limit", "--max-new-tokens"])
def test_evaluate_zero_counts_are_rejected(tmp_path, capsys, flag):
    err = run_case(capsys, f"evaluate{flag}", evaluate.cli_main,
                   ["--checkpoint", str(DEMO_STUDENT), "--dataset", "demo", flag, "0"], tmp_path)
    assert flag in err and ">= 1" in err


def test_evaluate_bad_set_and_truncated_checkpoint(tmp_path, capsys):
    err = run_case(capsys, "evaluate_set", evaluate.cli_main,
                   ["--config", TINY, "--set", "optimizer.lr=.inf", "--checkpoint",
                    str(DEMO_STUDENT), "--dataset", "demo"], tmp_path)
    assert "optimizer.lr" in err
    truncated_shard(tmp_path, None)
    err = run_case(capsys, "evaluate_truncated", evaluate.cli_main,
                   ["--checkpoint", str(tmp_path / "student"), "--dataset", "demo",
                    "--tokenizer", "tiny_unigram"], tmp_path)
    assert "model.safetensors" in err and "truncated" in err


def test_inspect_pair_and_demo_bad_input(tmp_path, capsys):
    err = run_case(capsys, "inspect_missing_tok", inspect_pair.main,
                   ["--teacher", str(tmp_path / "none"), "--student", "tiny_unigram"], tmp_path)
    assert err.startswith("python -m ctopd_jax.inspect_pair: error: --teacher")
    err = run_case(capsys, "demo_missing_config", demo.main,
                   ["--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "o")], tmp_path)
    assert "--config" in err


def test_evaluate_beyond_the_model_positions_is_refused_before_the_load(tmp_path, capsys):
    err = run_case(capsys, "evaluate_positions", evaluate.cli_main,
                   ["--checkpoint", str(DEMO_STUDENT), "--dataset", "demo",
                    "--max-new-tokens", "100000"], tmp_path)
    assert "--max-new-tokens 100000" in err and "max_position_embeddings 256" in err


def test_evaluate_out_onto_a_file_or_an_earlier_report_is_refused_before_work(tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    samples.write_text('{"problem": "1+1", "answer": "2", "response": "\\\\boxed{2}"}\n')
    target = tmp_path / "report"
    target.write_text("an earlier file")
    err = run_case(capsys, "evaluate_out_file", evaluate.cli_main,
                   ["--grade-only", str(samples), "--out", str(target)], tmp_path)
    assert f"--out {target}: is a file" in err and target.read_text() == "an earlier file"
    target.unlink()
    target.mkdir()
    (target / "summary.json").write_text("{}")
    err = run_case(capsys, "evaluate_out_earlier", evaluate.cli_main,
                   ["--grade-only", str(samples), "--out", str(target)], tmp_path)
    assert "already holds summary.json" in err and (target / "summary.json").read_text() == "{}"


@pytest.mark.parametrize("text", ["", "\n  \n"], ids=["empty", "blank_lines"])
def test_evaluate_grade_only_of_a_file_without_samples_is_one_line(tmp_path, capsys, text):
    samples = tmp_path / "samples.jsonl"
    samples.write_text(text)
    err = run_case(capsys, "evaluate_grade_empty", evaluate.cli_main,
                   ["--grade-only", str(samples), "--out", str(tmp_path / "report")], tmp_path)
    assert f"{samples}: holds no samples" in err


def test_usage_errors_are_one_line(tmp_path, capsys):
    err = run_case(capsys, "train_no_config", train.main, [], tmp_path)
    assert "--config" in err and "--help" in err


# ----------------------------------------------------------------------------- real processes

@pytest.mark.slow
@pytest.mark.parametrize("argv,field", [
    (["-m", "ctopd_jax.train", "--config", TINY, "--set", "optimizer.lr=.inf"], "optimizer.lr"),
    (["-m", "ctopd_jax.train", "--config", TINY, "--mesh", "data=two"], "mesh.data"),
    (["-m", "ctopd_jax.train", "--config", TINY, "--set", "data.seed=-1"], "data.seed"),
    (["-m", "ctopd_jax.plan", "--config", TINY, "--device", "h100", "--mfu", "0"], "--mfu"),
    (["-m", "ctopd_jax.evaluate", "--grade-only", "none.jsonl", "--timeout", "0"], "--timeout"),
])
def test_subprocess_exit_status_and_no_traceback(tmp_path, argv, field):
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(Path.home())}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv, "--set", f"output_dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    print(f"\n[subprocess {field}] {time.perf_counter() - start:.2f} s: {proc.stderr.strip()}")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and field in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
