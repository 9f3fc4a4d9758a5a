"""One writer per output, everywhere: a run holds its checkpoint.dir as well as its output_dir
(two runs sharing one checkpoints folder, either way round, are refused in one line), a second
`evaluate --out` into a folder held by another is refused before any work, and a dangling
symbolic link as output_dir is one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctopd_jax import evaluate, train
from ctopd_jax.common.run_dir import LOCK_NAME

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
HOLD = ("import sys, time; from ctopd_jax.common.run_dir import RunLock\n"
        "RunLock(sys.argv[1], sys.argv[2]).acquire(); print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder():
    """hold(folder, field): another live process holds `folder` as a run or evaluation does."""
    procs = []

    def hold(folder: Path, field: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), field],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc
    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def one_line(capsys, code: int) -> str:
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    assert "Traceback" not in err and not out.strip()
    return err.strip()


@pytest.mark.parametrize("held,argv", [
    # another run's default checkpoints folder, used as this run's checkpoint.dir
    ("other/checkpoints", lambda t: ["--set", f"checkpoint.dir={t / 'other' / 'checkpoints'}"]),
    # another run's checkpoint.dir, which is this run's default one
    ("run/checkpoints", lambda t: []),
], ids=["checkpoint_dir_of_another_run", "another_runs_checkpoint_dir_is_ours"])
def test_a_checkpoint_folder_held_by_another_run_is_refused(tmp_path, capsys, holder, held, argv):
    proc = holder(tmp_path / held, "checkpoint.dir")
    before = files_under(tmp_path)
    line = one_line(capsys, train.main(["--config", TINY, "--set", f"output_dir={tmp_path / 'run'}",
                                        *argv(tmp_path)]))
    assert f"checkpoint.dir {tmp_path / held} is in use by another run (pid {proc.pid}" in line
    assert files_under(tmp_path) == before


def test_the_run_holds_both_folders_while_it_works(tmp_path, capsys, monkeypatch):
    import ctopd_jax.loop.trainer as trainer
    run, ck = tmp_path / "run", tmp_path / "ck"
    seen = {}

    class Holds:
        def __init__(self, config, **kwargs):
            pass

        def train(self, resume=False, stop=None, on_resumed=None):
            for name, folder in (("out", run), ("ck", ck)):
                seen[name] = json.loads((folder / LOCK_NAME).read_text())["pid"]
            raise OSError(28, "No space left on device", str(ck / "1"))   # ends the run
    monkeypatch.setattr(trainer, "Trainer", Holds)
    one_line(capsys, train.main(["--config", TINY, "--set", f"output_dir={run}",
                                 "--set", f"checkpoint.dir={ck}"]))
    assert seen == {"out": os.getpid(), "ck": os.getpid()}
    assert not run.exists() and not ck.exists()      # released; the folders it made removed


@pytest.fixture
def samples(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2", "response": "\\\\boxed{2}"}\n')
    return path


def test_evaluate_out_held_by_another_evaluation_is_refused(tmp_path, capsys, holder, samples):
    proc = holder(tmp_path / "report", "--out")
    before = files_under(tmp_path)
    line = one_line(capsys, evaluate.cli_main(["--grade-only", str(samples),
                                               "--out", str(tmp_path / "report")]))
    assert f"--out {tmp_path / 'report'} is in use by another run (pid {proc.pid}" in line
    assert files_under(tmp_path) == before


def test_evaluate_holds_out_while_it_works_and_releases_it(tmp_path, capsys, monkeypatch, samples):
    import ctopd_jax.evaluate as module
    out = tmp_path / "report"
    grade = module.grade_file

    def grading(*args, **kwargs):
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
        return grade(*args, **kwargs)
    monkeypatch.setattr(module, "grade_file", grading)
    assert evaluate.cli_main(["--grade-only", str(samples), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["per_problem.jsonl", "samples.jsonl",
                                                     "summary.json"]


@pytest.mark.parametrize("field", ["output_dir", "checkpoint.dir"])
def test_a_dangling_symlink_as_an_output_folder_is_one_line(tmp_path, capsys, field):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    argv = ["--config", TINY, "--set", f"output_dir={tmp_path / 'run'}", "--set", f"{field}={link}"]
    line = one_line(capsys, train.main(argv))
    assert f"{field} {link}: {link} is a symbolic link to {tmp_path / 'gone'}, which does not " \
           "exist" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_evaluate_out_as_a_dangling_symlink_is_one_line(tmp_path, capsys, samples):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    line = one_line(capsys, evaluate.cli_main(["--grade-only", str(samples), "--out", str(link)]))
    assert "--out" in line and "which does not exist" in line
