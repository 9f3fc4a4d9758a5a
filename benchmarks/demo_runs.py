"""Train-then-evaluate on the CPU demo, shared by the sweeps (objective_sweep.py, span_sweep.py).

One run: `python -m ctopd_jax.train --config CONFIG --set ...` into a run folder, then
`python -m ctopd_jax.evaluate` grades the exported student (hf_student) greedily on the demo's
held-out split into <run>/eval_held_out. A folder that already holds a finished run and an
evaluation summary is not re-run (delete it to redo).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of <run_dir>/metrics.jsonl ([] before the run wrote any)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_then_evaluate(run_dir: Path, config, sets: list[str], steps: int, label: str) -> dict:
    """Train `config` with the `--set` overrides `sets` for `steps` steps into `run_dir` unless
    it holds that finished run, then grade its student unless that was done. Returns the
    metrics rows, the held-out accuracy (mean@1) and the training seconds (None when the
    finished run was reused)."""
    rows = read_metrics(run_dir)
    finished = bool(rows) and rows[-1].get("step") == steps and (run_dir / "hf_student").is_dir()
    train_s = None
    if not finished:
        cmd = [sys.executable, "-m", "ctopd_jax.train", "--config", str(config)]
        for s in (f"output_dir={run_dir}", f"steps={steps}", *sets):
            cmd += ["--set", s]
        print(f"[{label}]", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True)
        train_s = time.perf_counter() - t0
        rows = read_metrics(run_dir)
    eval_dir = run_dir / "eval_held_out"
    if not (eval_dir / "summary.json").is_file():
        cmd = [sys.executable, "-m", "ctopd_jax.evaluate", "--config", "configs/tiny_cpu.yaml",
               "--checkpoint", str(run_dir / "hf_student"), "--dataset", "demo", "--samples", "1",
               "--greedy", "--out", str(eval_dir)]
        print(f"[{label}]", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    summary = json.loads((eval_dir / "summary.json").read_text())
    return {"rows": rows, "accuracy": summary["mean@1"], "train_s": train_s}
