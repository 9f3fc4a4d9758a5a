"""Nothing a user already has is destroyed: checkpoints that do not fit the config (another
model pair, another LoRA rank) are refused in one line and stay byte-identical (none is set
aside as `.corrupt`), and `output_dir` / `checkpoint.dir` may not be a folder that holds a
model, a dataset or another run's checkpoints (refused before any work, the folder untouched)."""
import hashlib
import shutil
from pathlib import Path

import pytest
import yaml

from ctopd_jax import train
from ctopd_jax.config import load_config
from ctopd_jax.loop.trainer import Trainer

from conftest import FIXTURES, tiny_tree

ROOT = Path(__file__).resolve().parents[2]
DEMO_STUDENT = ROOT / "ctopd_jax" / "assets" / "demo" / "student"


def digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (names and bytes)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def error_line(capsys, code: int) -> str:
    """The one error line of a refused command (exit 2, no traceback)."""
    _, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, (code, err[-3000:])
    return errors[0]


def train_run(base: Path, **changes) -> tuple[Path, Path]:
    """A finished 2-step run with checkpoints of steps 1 and 2: (its config, its folder)."""
    cfg = base / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_tree(base / "run", steps=2, **{"checkpoint.every": 1},
                                            **changes)))
    Trainer(load_config(cfg)).train()
    return cfg, base / "run"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="module")
def trained_lora(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("trained_lora"), **{"lora.rank": 4})


@pytest.mark.slow   # two tiny runs trained in the module (~1 min on 2 cores)
@pytest.mark.parametrize("which,change,detail", [
    # the same array names, other shapes: Orbax's restore failed and every step was set aside
    ("trained_lora", ["--set", "lora.rank=2"], "is float32[128, 4] there, float32[128, 2]"),
    ("trained", ["--set", "lora.rank=4"], "arrays with other names"),
    ("trained", ["--set", "model.student=tiny_qwen2", "--set", "model.student_tokenizer=tiny_bpe"],
     "arrays with other names"),
], ids=["other_lora_rank", "lora_on_a_full_run", "other_pair"])
def test_checkpoints_of_another_model_are_refused_and_left_as_they_were(request, tmp_path,
                                                                        capsys, which, change,
                                                                        detail):
    cfg, source = request.getfixturevalue(which)
    run = tmp_path / "run"
    shutil.copytree(source, run)
    before = digest(run)
    code = train.main(["--config", str(cfg), "--set", f"output_dir={run}", "--resume",
                       "--allow-config-change", *change])
    line = error_line(capsys, code)
    assert "checkpoint step 2" in line and "left as it is" in line and detail in line, line
    assert not list(run.rglob("*.corrupt*"))
    assert digest(run) == before   # nothing written, not even the change log


@pytest.mark.slow
def test_an_accepted_change_is_logged_once_the_checkpoint_is_restored(trained, tmp_path):
    """The other side of the refusal above: a change the checkpoint fits (steps 2 -> 3 under a
    cosine schedule) is logged to config_changes.jsonl with the step actually restored."""
    import json
    cfg, source = trained
    run = tmp_path / "run"
    shutil.copytree(source, run)
    assert train.main(["--config", str(cfg), "--set", f"output_dir={run}", "--resume",
                       "--allow-config-change", "--set", "steps=3"]) == 0
    rows = [json.loads(x) for x in (run / "config_changes.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["resumed_from_step"] == 2
    assert [c["field"] for c in rows[0]["changes"]] == ["output_dir", "steps"]   # the copy moved


@pytest.mark.slow
def test_a_damaged_step_set_aside_never_replaces_an_earlier_one(trained, tmp_path):
    """`<step>.corrupt` already there (from an earlier fallback) is kept; the new one gets
    another name."""
    import warnings

    from ctopd_jax.loop.checkpoint import Checkpointer
    cfg, source = trained
    run = tmp_path / "run"
    shutil.copytree(source, run)
    ck_dir = run / "checkpoints"
    (ck_dir / "2.corrupt").mkdir()
    (ck_dir / "2.corrupt" / "keep").write_text("earlier")
    (ck_dir / "2" / "meta" / "metadata").write_text("{not json")
    ck = Checkpointer(ck_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        restored = ck.restore_latest(Trainer(load_config(cfg))._state())
    ck.close()
    assert restored.step == 1
    assert (ck_dir / "2.corrupt" / "keep").read_text() == "earlier"
    assert (ck_dir / "2.corrupt-2" / "meta" / "metadata").read_text() == "{not json"


# ----------------------------------------------------------------------------- output folders
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def model_copy(tmp: Path) -> Path:
    shutil.copytree(DEMO_STUDENT, tmp / "model")
    return tmp / "model"


def data_folder(tmp: Path) -> Path:
    (tmp / "data").mkdir()
    shutil.copy(FIXTURES / "prompts.jsonl", tmp / "data" / "train.jsonl")
    return tmp / "data"


def checkpoints_folder(tmp: Path) -> Path:
    steps = tmp / "other_run" / "checkpoints"
    (steps / "2" / "state").mkdir(parents=True)
    (steps / "2" / "state" / "x").write_text("arrays")
    return steps


FOLDERS = [
    # (setup -> folder, extra argv given the folder, field, words)
    ("student_model_folder", model_copy, lambda f: ["--set", f"model.student={f}"],
     "output_dir", "is the folder of model.student"),
    ("a_model_folder", model_copy, lambda f: [], "output_dir", "holds a model's weights"),
    ("data_folder", data_folder, lambda f: ["--set", f"data.path={f / 'train.jsonl'}"],
     "output_dir", "is the folder of data.path"),
    ("a_dataset_folder", data_folder, lambda f: [], "output_dir", "holds a dataset (train.jsonl)"),
    ("other_runs_checkpoints", checkpoints_folder, lambda f: [], "output_dir",
     "holds checkpoint steps"),
    ("checkpoint_dir_is_a_model", model_copy, lambda f: ["--set", f"checkpoint.dir={f}"],
     "checkpoint.dir", "holds a model's weights"),
]


@pytest.mark.parametrize("name,setup,extra,field,words", FOLDERS, ids=[f[0] for f in FOLDERS])
def test_an_output_folder_holding_what_is_not_a_runs_is_refused(tmp_path, capsys, name, setup,
                                                                 extra, field, words):
    folder = setup(tmp_path)
    before = digest(tmp_path)
    argv = ["--config", TINY, "--set", f"output_dir={tmp_path / 'run' if field != 'output_dir' else folder}",
            *extra(folder)]
    line = error_line(capsys, train.main(argv))
    assert f"{field} {folder}" in line and words in line, line
    assert digest(tmp_path) == before and not (tmp_path / "run").exists()
