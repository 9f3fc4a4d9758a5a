"""MetricsLogger JSONL content and resume truncation; plot writes readable PNGs."""
import json

import matplotlib.image as mpimg
import numpy as np

from ctopd_jax.metrics import MetricsLogger, StepTimer, read_metrics
from ctopd_jax.plot import plot_run


def test_jsonl_tensorboard_and_resume_truncation(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=4, progress=False)
    for step in (1, 2, 3):
        logger.log(step, {"loss": np.float32(0.5 / step), "lr": 1e-6 * step, "note": "skip-me"},
                   samples=[{"kind": "byte_mismatch", "text": "é"}])
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["loss"] == float(np.float32(0.25)) and "note" not in records[1]
    assert list((tmp_path / "tensorboard").iterdir())
    # resuming from a checkpoint at step 1 drops the records of steps 2, 3
    logger = MetricsLogger(tmp_path, total_steps=4, start_step=1, progress=False, tensorboard=False)
    logger.log(2, {"loss": 9.0})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 0.5), (2, 9.0)]
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] and samples[0]["text"] == "é"


def test_timer_accumulates_phases(monkeypatch):
    import ctopd_jax.metrics as metrics_module

    clock = iter([10.0, 10.5, 20.0, 20.25, 30.0, 32.0])  # start/stop pairs of three phases
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    timer = StepTimer()
    for _ in range(2):
        with timer("align"):
            pass
    with timer("rollout"):
        pass
    assert timer.as_metrics() == {"time_align": 0.75, "time_rollout": 2.0, "time_total": 2.75}


def test_plot_writes_pngs(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=3, progress=False, tensorboard=False)
    for step in (1, 2, 3):
        logger.log(step, {"loss": 1.0 / step, "coverage_student": 0.9, "coverage_teacher": 0.8,
                          "time_rollout": 0.1, "time_align": 0.01})
    logger.close()
    paths = plot_run(tmp_path)
    assert {p.name for p in paths} == {"loss.png", "coverage.png", "time.png"}
    image = mpimg.imread(paths[0])
    assert image.ndim == 3 and image.shape[0] > 100
