"""`python -m ctopd_jax.demo`: helpers, and (slow) a short end-to-end run whose reported
accuracies must equal a re-grading of the samples it wrote."""
import json

import pytest

from ctopd_jax.demo import __main__ as demo
from ctopd_jax.demo import task


def test_gap_closed_by_hand():
    assert demo.gap_closed(0.2, 0.6, 1.0) == pytest.approx(0.5)
    assert demo.gap_closed(0.2, 0.1, 1.0) == pytest.approx(-0.125)
    assert demo.gap_closed(0.9, 0.95, 0.9) is None      # student did not start behind


def test_fresh_output_dir_never_reuses_a_run(tmp_path):
    base = tmp_path / "demo"
    assert demo.fresh_output_dir(base) == base
    base.mkdir()
    assert demo.fresh_output_dir(base) == base            # empty is fine
    (base / "x").write_text("old run")
    assert demo.fresh_output_dir(base) == tmp_path / "demo-2"
    (tmp_path / "demo-2").mkdir()
    (tmp_path / "demo-2" / "y").write_text("old run")
    assert demo.fresh_output_dir(base) == tmp_path / "demo-3"


def test_missing_config_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--config"):
        demo.run(["--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")])


def _regraded_accuracy(eval_dir):
    rows = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines()]
    held = {p.prompt: p for p in task.split("held_out")}
    assert len(rows) == len(held) and {r["problem"] for r in rows} == set(held)
    # independent verdicts: the reference answer comes from the task, not from the file
    return sum(task.grade(r["response"], held[r["problem"]].answer) for r in rows) / len(rows)


@pytest.mark.slow
@pytest.mark.parametrize("export_hf", [True, False])
def test_short_demo_run_reports_what_its_samples_say(tmp_path, export_hf):
    """Graded after training: the exported student read back from disk, or (export_hf false:
    nothing exported) the trained student in memory."""
    summary = demo.run(["--out", str(tmp_path / "demo"), "--set", "steps=2",
                        "--set", f"checkpoint.export_hf={str(export_hf).lower()}",
                        "--set", "rollout.rollout_batch_size=16",
                        "--set", "optimizer.train_batch_size=16",
                        "--set", "optimizer.micro_batch_size=8",
                        "--set", "checkpoint.async_save=false",
                        "--set", "logging.progress=false", "--set", "logging.tensorboard=false"])
    out = tmp_path / "demo"
    for who, key in (("teacher", "teacher_accuracy"), ("student_before", "student_accuracy_before"),
                     ("student_after", "student_accuracy_after")):
        assert summary[key] == pytest.approx(_regraded_accuracy(out / "eval" / who))
    assert summary["teacher_accuracy"] > summary["student_accuracy_before"]
    assert 0.0 < summary["coverage_student"] <= 1.0
    assert (out / "hf_student" / "model.safetensors").is_file() == export_hf
    assert (summary["hf_student"] is not None) == export_hf
    assert json.loads((out / "demo_summary.json").read_text()) == summary
    assert summary["plots"] and all(p.endswith(".png") for p in summary["plots"])
