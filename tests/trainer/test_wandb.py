"""logging.wandb: the MetricsLogger sends wandb (offline mode) every metrics.jsonl row and the run
config; a resume continues the same wandb run; a missing wandb package is one preflight line.

The offline run file (<WANDB_DIR>/wandb/offline-run-*/run-<id>.wandb) is read back here with a
small reader of its record-log framing (7-byte file header, 32 KiB blocks, each record
chunk = crc32 u32, length u16, type u8), and each record parsed with wandb's own protobuf."""
import importlib.util
import json
import struct
import time

import pytest

from ctopd_jax.common.metrics import MetricsLogger, read_metrics
from ctopd_jax.config import load_config

wandb = pytest.importorskip("wandb", reason="pip install -e '.[test]' (wandb)")

BLOCK = 32 * 1024


def _records(path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of a block
            pos += left
            continue
        if pos + 7 + length > len(data):  # still being written
            return
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _complete_records(run_file, timeout=30.0):
    """The file's records once its `exit` record is there: wandb's service writes the file
    in the background and may still be flushing it when run.finish() returns."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(_records(run_file))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or (
                time.monotonic() > deadline):
            return records
        time.sleep(0.2)


def _history(run_file):
    rows, config = [], {}
    for record in _complete_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                   for item in record.history.item}
            rows.append(row)
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            for item in updates:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return rows, config


def _log_steps(logger, steps):
    for step in steps:
        logger.log(step, {"loss": 1.0 / step, "coverage_student": 0.5, "time_rollout": 0.1 * step,
                          "tokens_per_s": 100.0 + step, "grad_norm": 2.0})


def test_wandb_offline_gets_every_row_and_config_and_resume_keeps_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    config = load_config(None, ["logging.wandb=true", "logging.wandb_mode=offline",
                                "logging.wandb_project=test", "run_name=wandb_test",
                                f"output_dir={run_dir}"])
    logger = MetricsLogger(run_dir, 5, tensorboard=False, progress=False, config=config)
    _log_steps(logger, [1, 2, 3])
    logger.close()
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    resumed = MetricsLogger(run_dir, 5, start_step=3, tensorboard=False, progress=False,
                            config=config)
    _log_steps(resumed, [4, 5])
    resumed.close()
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id

    runs = sorted((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    files = [next(r.glob("*.wandb")) for r in runs]
    assert all(f.name == f"run-{run_id}.wandb" for f in files)  # one run id, continued
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    logged = []
    for f in files:
        history, recorded = _history(f)
        logged += history
        assert recorded["run_name"] == "wandb_test"
        assert recorded["logging"]["wandb"] is True
        assert recorded["lora"]["rank"] == 0
    assert [h["_step"] for h in logged] == [1, 2, 3, 4, 5]
    for row, history in zip(rows, logged):
        for key, value in row.items():
            if key != "step":
                assert history[key] == pytest.approx(value), key


def test_missing_wandb_is_one_preflight_line(monkeypatch):
    from ctopd_jax.preflight import PreflightError, preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    config = load_config(None, ["logging.wandb=true"])
    with pytest.raises(PreflightError) as err:
        preflight(config)
    message = str(err.value)
    assert "\n" not in message.strip() and "pip install wandb" in message
    assert "logging.wandb" in message
