"""Issue 26, families 3 and 5 (run_dir.py): output folders judged writable without writing, one
run per output folder (a live lock refuses, a dead one on this host is taken over with a
warning), and a refused write as one line naming the field."""
import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from ctopd_jax.common import cli
from ctopd_jax.common.run_dir import (LOCK_NAME, RunDirError, RunLock, check_not_in_use,
                                      check_writable, write_error)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lock(folder, pid, host=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                                "started": "2026-01-01T00:00:00"}))


# ----------------------------------------------------------------------------- writable

def test_a_new_folder_under_a_writable_one_passes_and_nothing_is_written(tmp_path):
    check_writable(tmp_path / "a" / "b", "output_dir")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["itself", "parent"])
def test_a_file_in_the_way_is_refused(tmp_path, where):
    (tmp_path / "f").write_text("x")
    target = tmp_path / "f" if where == "itself" else tmp_path / "f" / "run"
    with pytest.raises(RunDirError, match=rf"^output_dir {target}: {tmp_path / 'f'} is a file"):
        check_writable(target, "output_dir")


def test_a_folder_without_write_permission_is_refused(tmp_path, monkeypatch):
    # root passes os.access everywhere, so the answer of a non-root user is given here
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(RunDirError, match=r"^checkpoint.dir .*: permission denied to write in"):
        check_writable(tmp_path / "ck", "checkpoint.dir")


# ----------------------------------------------------------------------------- the lock

def test_the_lock_holds_pid_and_host_and_refuses_a_second_run(tmp_path):
    run = tmp_path / "runs" / "a"
    with RunLock(run):
        owner = json.loads((run / LOCK_NAME).read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        with pytest.raises(RunDirError, match=rf"^output_dir {run} is in use by another run "
                                              rf"\(pid {os.getpid()} on host "):
            RunLock(run).acquire()
        assert (run / LOCK_NAME).is_file()     # the refused run did not remove the owner's lock
    assert not (run / LOCK_NAME).exists()
    assert not (tmp_path / "runs").exists()    # the folders the lock made stayed empty: removed


def test_a_second_process_is_refused_while_the_first_holds_the_folder(tmp_path):
    code = ("import sys, time; from ctopd_jax.common.run_dir import RunLock\n"
            "lock = RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=rf"pid {holder.pid} on host"):
            check_not_in_use(tmp_path / "run")
        with pytest.raises(RunDirError, match=rf"pid {holder.pid} on host"):
            RunLock(tmp_path / "run").acquire()
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: its lock is stale now and is taken over
    with pytest.warns(RuntimeWarning, match=rf"taking over the lock of pid {holder.pid}"):
        with RunLock(tmp_path / "run"):
            assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_stale_lock_passes_preflight_and_is_taken_over_with_a_warning(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path / "run", pid)
    check_not_in_use(tmp_path / "run")
    with pytest.warns(RuntimeWarning, match=rf"taking over the lock of pid {pid} .* no longer running"):
        lock = RunLock(tmp_path / "run").acquire()
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_NAME]
    lock.release()
    assert (tmp_path / "run").is_dir()           # it existed before: kept


def test_a_lock_whose_pid_now_belongs_to_another_process_is_stale(tmp_path):
    """A restarted container may give the new trainer the pid of the killed one: the start time
    in the lock tells them apart."""
    with RunLock(tmp_path / "run"):
        owner = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert owner["start_ticks"] is not None       # Linux: read from /proc
    write_lock(tmp_path / "run", os.getpid())
    lock = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps({**lock, "start_ticks": "1"}))
    with pytest.warns(RuntimeWarning, match=rf"taking over the lock of pid {os.getpid()}"):
        RunLock(tmp_path / "run").acquire().release()
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps({**owner}))
    with pytest.raises(RunDirError, match="is in use"):   # the same pid and start: this process
        check_not_in_use(tmp_path / "run")


@pytest.mark.parametrize("content", ["other_host", "unreadable"])
def test_a_lock_that_cannot_be_judged_refuses(tmp_path, content):
    if content == "other_host":
        write_lock(tmp_path / "run", dead_pid(), host="elsewhere")
        expect = "on host elsewhere"
    else:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / LOCK_NAME).write_text("{half")
        expect = "an unknown process"
    for attempt in (lambda: check_not_in_use(tmp_path / "run"),
                    lambda: RunLock(tmp_path / "run").acquire()):
        with pytest.raises(RunDirError, match=expect) as err:
            attempt()
        assert f"remove {tmp_path / 'run' / LOCK_NAME}" in str(err.value)


# ----------------------------------------------------------------------------- refused writes

def test_a_refused_write_names_the_most_specific_field(tmp_path):
    fields = {"output_dir": tmp_path / "run", "checkpoint.dir": tmp_path / "run" / "checkpoints"}
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "checkpoints" / "x"))
    line = str(write_error(full, fields))
    assert line.startswith(f"checkpoint.dir: {tmp_path / 'run' / 'checkpoints' / 'x'}: no space left")
    assert "(ENOSPC)" in line and "--resume" in line
    ro = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "run" / "metrics.jsonl"))
    assert str(write_error(ro, fields)).startswith(f"output_dir: {tmp_path / 'run' / 'metrics.jsonl'}")
    assert write_error(OSError(errno.ENOENT, "gone", "x"), fields) is None


def test_every_command_reports_a_full_disk_in_one_line(capsys):
    def inner(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out/summary.json")
    assert cli.run(inner, [], "prog") == 2
    err = capsys.readouterr().err
    assert err == "prog: error: /data/out/summary.json: No space left on device\n"


# ----------------------------------------------------------------------------- a run's own files

def test_every_log_the_metrics_logger_keeps_aside_is_a_runs_own(tmp_path):
    """The files metrics.py itself writes when a run starts over or resumes (twice: the second
    set-aside of the same step takes the next free name) never make the folder look like a
    dataset: a run resumed twice must still be resumable."""
    from ctopd_jax.common.metrics import rotate_log, set_aside_after
    from ctopd_jax.common.run_dir import foreign_contents

    rows = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4))
    for name in ("metrics.jsonl", "samples.jsonl"):
        log = tmp_path / name
        log.write_text(rows)
        made = [set_aside_after(log, 2)]
        log.write_text(rows)
        made.append(set_aside_after(log, 2))
        made.append(rotate_log(log))
        assert all(p is not None and p.is_file() for p in made), made
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "metrics.after_step_2.2.jsonl" in names and "samples.1.jsonl" in names, names
    assert foreign_contents(tmp_path) is None, names
    # a dataset beside them is still one
    (tmp_path / "train.jsonl").write_text('{"prompt": "x"}\n')
    assert foreign_contents(tmp_path) == "a dataset (train.jsonl)"


def test_a_replaced_folder_is_whole_or_untouched(tmp_path):
    """The HF export's folder (checkpoint.export_student_hf): written beside its place and
    renamed into it; a stop in the middle leaves the earlier folder as it was, and the next
    write clears what a killed one left (a staging folder; an earlier folder moved aside)."""
    from ctopd_jax.common.run_dir import replaced_folder

    out = tmp_path / "hf_student"
    with replaced_folder(out) as staging:
        (staging / "model.safetensors").write_text("first")
    assert (out / "model.safetensors").read_text() == "first"
    with pytest.raises(KeyboardInterrupt):
        with replaced_folder(out) as staging:
            (staging / "model.safetensors").write_text("half")
            raise KeyboardInterrupt
    assert (out / "model.safetensors").read_text() == "first"
    # what a SIGKILL leaves: a staging folder, and the earlier folder moved aside while the
    # new one was not yet renamed into place
    (tmp_path / ".hf_student.tmp-99999").mkdir()
    (tmp_path / ".hf_student.tmp-99999" / "model.safetensors").write_text("half")
    out.rename(tmp_path / ".hf_student.old")
    with replaced_folder(out) as staging:
        assert (out / "model.safetensors").read_text() == "first"   # put back before writing
        (staging / "model.safetensors").write_text("second")
    assert (out / "model.safetensors").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_student"]
