"""`evaluate --out` stopped in the middle of moving its report into place (issue 43): the
folder never passes for a whole report (a mark stays beside the files), the rerun into the same
folder replaces it and gives what an uninterrupted evaluation gives; a whole earlier report is
still refused."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctopd_jax import evaluate
from ctopd_jax.common.cli import UserError
from ctopd_jax.loop import mean_at_k as evaluation
from ctopd_jax.loop.mean_at_k import REPORT_FILES, REPORT_INCOMPLETE

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"id": "p1", "problem": "1/2?", "answer": "\\frac{1}{2}", "response": "so \\boxed{0.5}"},
        {"id": "p1", "problem": "1/2?", "answer": "\\frac{1}{2}", "response": "\\boxed{2}"},
        {"id": "p2", "problem": "x", "answer": "(1,2)", "response": "\\boxed{(1, 2)}"}]


@pytest.fixture
def samples(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def report_of(folder: Path) -> dict:
    """The report's files, the summary without its clock."""
    files = {name: (folder / name).read_text() for name in REPORT_FILES}
    summary = json.loads(files.pop("summary.json"))
    summary.pop("timing_s")
    return {**files, "summary": summary}


class Killed(BaseException):
    """Stands for the SIGKILL in this process (BaseException: nothing on the way catches it)."""


def test_a_report_stopped_between_two_files_is_never_taken_for_whole(tmp_path, samples,
                                                                     monkeypatch, capsys):
    evaluate.main(["--grade-only", str(samples), "--out", str(tmp_path / "whole")])
    out = tmp_path / "out"

    def kill_after_first(name, before=None):
        if name == "report_write" and (out / "samples.jsonl").exists():
            raise Killed
    monkeypatch.setattr(evaluation, "kill_point", kill_after_first)
    with pytest.raises(Killed):
        evaluate.main(["--grade-only", str(samples), "--out", str(out)])
    monkeypatch.undo()
    assert (out / REPORT_INCOMPLETE).is_file() and not (out / "summary.json").exists()
    capsys.readouterr()
    evaluate.main(["--grade-only", str(samples), "--out", str(out)])
    assert "replacing the report an interrupted evaluation left half-written" in capsys.readouterr().err
    assert report_of(out) == report_of(tmp_path / "whole")
    assert not (out / REPORT_INCOMPLETE).exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging
    with pytest.raises(UserError, match="already holds samples.jsonl of an earlier evaluation"):
        evaluate.main(["--grade-only", str(samples), "--out", str(out)])


@pytest.mark.slow   # three evaluate processes (~15 s)
@pytest.mark.parametrize("passage", [1, 3])   # after the first file; after the last, before the mark goes
def test_evaluate_sigkilled_while_writing_its_report_reruns_to_the_same_result(tmp_path, samples,
                                                                              passage):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def run(out, **extra):
        return subprocess.run([sys.executable, "-m", "ctopd_jax.evaluate", "--grade-only",
                               str(samples), "--out", str(out)], env={**env, **extra}, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert run(tmp_path / "whole").returncode == 0
    killed = run(tmp_path / "out", CTOPD_JAX_KILL_AT=f"report_write:{passage}")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (tmp_path / "out" / REPORT_INCOMPLETE).is_file()
    again = run(tmp_path / "out")
    assert again.returncode == 0, again.stderr[-2000:]
    assert report_of(tmp_path / "out") == report_of(tmp_path / "whole")
