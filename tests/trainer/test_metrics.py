"""MetricsLogger JSONL content, rotation and set-aside on resume (nothing is destroyed), line
based progress when redirected; plot writes readable, labelled PNGs."""
import io
import json
import threading
import time

import matplotlib.image as mpimg
import matplotlib.pyplot  # noqa: F401  (heavy imports at collection, not inside a test)
import tensorboardX  # noqa: F401
import numpy as np

from ctopd_jax.common.metrics import MetricsLogger, StepTimer, read_metrics, run_values
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
    # resuming from a checkpoint at step 1 sets the records of steps 2, 3 aside
    logger = MetricsLogger(tmp_path, total_steps=4, start_step=1, progress=False, tensorboard=False)
    logger.log(2, {"loss": 9.0})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 0.5), (2, 9.0)]
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] and samples[0]["text"] == "é"


def test_timer_accumulates_phases(monkeypatch):
    import ctopd_jax.common.metrics as metrics_module

    # the timer's creation, start/stop pairs of three phases, the end of the step
    clock = iter([10.0, 10.0, 10.5, 20.0, 20.25, 30.0, 32.0, 33.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    timer = StepTimer()
    for _ in range(2):
        with timer("align"):
            pass
    with timer("rollout"):
        pass
    assert timer.as_metrics() == {"time_align": 0.75, "time_rollout": 2.0, "time_total": 2.75,
                                  "time_wall": 23.0, "time_other": 20.25, "time_compile": 0.0}


class _Work:
    """Device work stand-in: ready once `done` is set (what jax.block_until_ready waits on)."""

    def __init__(self):
        self.done = threading.Event()

    def block_until_ready(self):
        self.done.wait()
        return self


def test_timer_device_phase_ends_with_its_work_and_phases_partition_the_wall(monkeypatch):
    import ctopd_jax.common.metrics as metrics_module

    # creation; rollout 0–1; student dispatch 1–1.1; prepare 1.2–2 (while the device works);
    # the student's device work is seen done at 3; the step ends at 3.5
    clock = iter([0.0, 0.0, 1.0, 1.0, 1.1, 1.2, 2.0, 3.0, 3.5])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    timer, work = StepTimer(), _Work()
    with timer("rollout"):
        pass
    with timer("student") as since:
        pass
    timer.device("student", work, since)
    with timer("prepare"):
        pass
    work.done.set()
    m = timer.as_metrics()
    # the student phase runs from its dispatch to the end of its device work; the host's
    # prepare lay under it and costs nothing; what is left of the wall is time_other
    assert m["time_rollout"] == 1.0 and m["time_student"] == 2.0 and m["time_prepare"] == 0.0
    assert (m["time_total"], m["time_wall"], m["time_other"]) == (3.0, 3.5, 0.5)


def test_timer_device_programs_run_one_after_another():
    timer = StepTimer()
    timer._device = [("teacher", 0.0, 2.0), ("student", 1.0, 3.0), ("student", 5.0, 6.0)]
    timer._host = [("prepare", 1.5, 4.0)]
    timer._settle()
    # the second program starts when the first ends (2, not its dispatch at 1); the host's
    # prepare keeps only 3–4, when the device was idle
    assert timer.seconds == {"teacher": 2.0, "student": 2.0, "prepare": 1.0}


def test_timer_counts_the_compiles_inside_its_iteration():
    import jax
    import jax.numpy as jnp

    double = jax.jit(lambda x: x * 2)
    jax.block_until_ready(double(jnp.ones(3)))   # compiled before: not this timer's
    timer = StepTimer()
    with timer("student"):
        jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))))
    compiled = timer.as_metrics()["time_compile"]
    assert 0.0 < compiled <= timer.seconds["student"]
    again = StepTimer()
    with again("student"):   # a program compiled earlier: nothing to compile
        jax.block_until_ready(double(jnp.ones(3)))
    assert again.as_metrics()["time_compile"] == 0.0


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


def test_fresh_start_rotates_an_existing_log_and_never_truncates(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (tmp_path / "metrics.1.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    logger = MetricsLogger(tmp_path, total_steps=2, progress=False, tensorboard=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert logger.moved == [tmp_path / "metrics.2.jsonl"]
    assert json.loads((tmp_path / "metrics.2.jsonl").read_text())["loss"] == 3.0
    assert json.loads((tmp_path / "metrics.1.jsonl").read_text())["loss"] == 4.0
    assert [r["loss"] for r in read_metrics(tmp_path)] == [1.0]


def test_resume_sets_later_rows_aside_and_keeps_elapsed_running(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=4, progress=False, tensorboard=False)
    for step in (1, 2, 3):
        logger.log(step, {"loss": float(step)})
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')                  # a kill in the middle of a write
    first = read_metrics(tmp_path)
    assert [r["step"] for r in first] == [1, 2, 3]  # the damaged last line is skipped
    logger = MetricsLogger(tmp_path, total_steps=4, start_step=2, progress=False, tensorboard=False)
    logger.log(3, {"loss": 30.0})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    aside = (tmp_path / "metrics.after_step_2.jsonl").read_text().splitlines()
    assert json.loads(aside[0])["loss"] == 3.0 and aside[1] == '{"step": 4, "lo'
    assert rows[2]["elapsed_s"] >= rows[1]["elapsed_s"]
    assert all(abs(r["wall_time"] - time.time()) < 3600 for r in rows)



def test_a_row_records_the_resident_memory_at_its_step_and_run_values_leave_the_readings_out(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=2, progress=False, tensorboard=False)
    logger.log(1, {"loss": 1.0, "time_student": 0.5})
    held = np.ones(64 * 2 ** 20 // 8)                  # 64 MiB more resident by step 2
    logger.log(2, {"loss": 2.0, "time_student": 0.4})
    logger.close()
    first, second = read_metrics(tmp_path)
    status = open("/proc/self/status").read()
    now = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024
    assert second["host_rss_bytes"] - first["host_rss_bytes"] >= 60 * 2 ** 20
    assert abs(now - second["host_rss_bytes"]) < 16 * 2 ** 20, (now, second)
    assert run_values(second) == {"step": 2, "loss": 2.0}   # the clock's and the machine's out
    del held

def test_redirected_output_is_line_based_and_messages_get_their_own_lines(tmp_path):
    stream = io.StringIO()                            # not a TTY: no bar, one line per step
    logger = MetricsLogger(tmp_path, total_steps=2, tensorboard=False, stream=stream)
    logger.write("overlap: {}")
    logger.log(1, {"loss": 0.5, "tokens_per_s": 10.0})
    logger.write("a message")
    logger.log(2, {"loss": 0.25})
    logger.close()
    lines = stream.getvalue().split("\n")
    assert "\r" not in stream.getvalue()
    assert lines[0] == "overlap: {}" and lines[1].startswith("step 1/2  loss 0.5  tokens_per_s 10")
    assert lines[2] == "a message" and lines[3].startswith("step 2/2  loss 0.25")


def test_plots_label_axes_and_keep_equal_series_visible(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    drawn, labels = [], []
    original_plot, original_label = Axes.plot, Axes.set_ylabel
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **k: (drawn.append(k), original_plot(ax, *a, **k))[1])
    monkeypatch.setattr(Axes, "set_ylabel", lambda ax, t, **k: (labels.append(t), original_label(ax, t, **k))[1])
    logger = MetricsLogger(tmp_path, total_steps=2, progress=False, tensorboard=False)
    for step in (1, 2):
        logger.log(step, {"loss": 1.0 / step, "kd_loss": 1.0 / step})  # kd_ratio 1: identical
    logger.close()
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["loss.png"]
    loss, kd = drawn
    assert (loss["label"], kd["label"]) == ("loss", "kd_loss")
    assert loss["linestyle"] != kd["linestyle"] and loss["linewidth"] > kd["linewidth"]
    assert labels == ["loss (per student response token)"]


def test_a_row_lost_after_its_checkpoint_comes_back_from_the_checkpoint(tmp_path):
    """The trainer starts step 2's checkpoint with the lines step 2 will log (`lines`); the
    process dies with the row half-written and its samples half there. The resume from step 2
    writes the row and the missing samples once, and a second resume adds nothing."""
    logger = MetricsLogger(tmp_path, total_steps=3, progress=False, tensorboard=False)
    logger.log(1, {"loss": 1.0}, samples=[{"text": "a"}])
    carried = logger.lines(2, {"loss": 0.5}, samples=[{"text": "b"}, {"text": "c"}])
    logger.close()
    with open(tmp_path / "samples.jsonl", "a") as f:   # the kill: one of two samples, half a row
        f.write(json.dumps({"step": 2, "text": "b"}) + "\n")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"loss": 0.5, "st')
    for _ in range(2):
        logger = MetricsLogger(tmp_path, total_steps=3, start_step=2, progress=False,
                               tensorboard=False, restored_lines=carried)
        logger.log(3, {"loss": 0.25})
        logger.close()
        assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 0.5), (3, 0.25)]
        samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
        assert [(s["step"], s["text"]) for s in samples] == [(1, "a"), (2, "b"), (2, "c")]
    torn = (tmp_path / "metrics.after_step_2.jsonl").read_text()
    assert torn.startswith('{"loss": 0.5, "st'), torn   # the damaged line kept aside, not lost
