"""Chaos run: a training run on the demo pair SIGKILLed at N seeded moments and resumed with
`--resume` each time ends exactly as a run never interrupted (issue 43).

    python scripts/chaos.py [--steps 60] [--kills 10] [--seed 0] [--out runs/chaos]

Two runs of `configs/tiny_cpu.yaml` (the demo pair, asynchronous Orbax checkpoints, HF export)
in subprocesses: the reference, uninterrupted, and the chaos run, killed N times. Half the
kills (seeded) are at named moments (ctopd_jax/common/kill_points.py: the rollout, the update on the
device, an asynchronous Orbax write in flight, the middle of a metrics row, the HF export,
...), the other half at seeded random times after the process started, with the last line the
run printed as the log of where it was. After each kill the run is started again, with
`--resume` once a checkpoint exists, as a user would.

Checked at the end, each a failure of its own:
- the final checkpoint: parameters, optimizer state and RNG bit for bit, and its run state
  (data position, update count, objective, guard, coverage);
- metrics.jsonl: steps 1..N once each, every value equal but the clock's (time_*, wall_time,
  elapsed_s, tokens_per_s, peak memory); samples.jsonl equal;
- the exported HF student, byte for byte;
- every resume started from the newest checkpoint committed when the kill came (no step lost
  beyond the last checkpoint).

Prints one JSON report (and writes it to <out>/chaos.json); exit 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ctopd_jax.common.metrics import run_values

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_cpu.yaml"
# the named kills, in this order, then seeded: the first five are the moments (the
# rollout, the update on the device, an async Orbax write, the metrics write, the HF export)
POINTS = ("phase:rollout", "checkpoint_write", "device:student", "metrics_write", "hf_export",
          "phase:align", "phase:sync", "phase:checkpoint")
PER_CHECKPOINT = ("phase:checkpoint", "checkpoint_write")


def overrides(steps: int, every: int, batch: int, keep: int, extra=()) -> list[str]:
    sets = [f"steps={steps}", f"checkpoint.every={every}", f"checkpoint.keep={keep}",
            f"rollout.rollout_batch_size={batch}", f"optimizer.train_batch_size={batch}",
            f"optimizer.micro_batch_size={batch}", "logging.progress=true", *extra]
    return [a for s in sets for a in ("--set", s)]


def command(out: Path, sets: list[str], resume: bool) -> list[str]:
    return [sys.executable, "-m", "ctopd_jax.train", "--config", str(CONFIG),
            "--set", f"output_dir={out}", *sets] + (["--resume"] if resume else [])


def committed_steps(out: Path) -> list[int]:
    folder = out / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir()) \
        if folder.is_dir() else []


def warm_up(out: Path, sets: list[str], env: dict) -> None:
    """The run's programs into the XLA cache (a process stopped once it logged step 2), so the
    reference takes as long as each chaos process will: the timed kills are drawn within it."""
    proc = subprocess.Popen(command(out, sets, False), env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / "metrics.jsonl"
    while proc.poll() is None and not (log.is_file() and len(log.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    proc.kill()
    proc.wait()


def plan_kills(seed: int, kills: int) -> list[dict]:
    """N kills: even ones at a named point (every point once, then seeded ones), odd ones at a
    seeded time; `u` (seeded, in [0, 1)) picks the passage or the moment once the process
    starts, within what is left of the run (`resolve`)."""
    rng = random.Random(seed)
    plan = []
    for k in range(kills):
        if k % 2 == 0:
            point = POINTS[k // 2] if k // 2 < len(POINTS) else rng.choice(POINTS[:4] + POINTS[5:])
            plan.append({"point": point, "u": rng.random()})
        else:
            plan.append({"time": True, "u": rng.random(), "v": rng.random()})
    # the export comes once the steps are done: its kill last, or the kills after it would
    # all fall on a finished run
    return [k for k in plan if k.get("point") != "hf_export"] + \
        [k for k in plan if k.get("point") == "hf_export"]


def resolve(kill: dict, remaining: int, every: int, kills_left: int, startup_s: float,
            step_s: float) -> dict:
    """The passage (a named point) or the delay in seconds (a timed kill) of `kill` for a
    process with `remaining` steps to train: within the next `span` steps, the steps left
    shared among the kills left (at least two checkpoints' worth, so a process often gets past
    one before its kill), so the kills spread over the whole run."""
    remaining_all = remaining
    remaining = min(remaining, max(2 * every, remaining // max(kills_left, 1)))
    if "time" in kill:
        # one in five during the start-up, the others within one of the steps left: after the
        # k-th step line of the process (0: the line before the loop), a fraction of a step
        u = kill["u"]
        if u < 0.2:
            return {**kill, "delay_s": round(u / 0.2 * startup_s, 2)}
        return {**kill, "after_line": int((u - 0.2) / 0.8 * remaining),
                "delay_s": round(kill["v"] * step_s, 2)}
    point = kill["point"] if remaining_all else "hf_export"   # all trained: only the export is left
    passes = 1 if point == "hf_export" else \
        -(-remaining // every) if point in PER_CHECKPOINT else remaining
    return {**kill, "point": point, "passage": 1 + int(kill["u"] * passes)}


def run_once(out: Path, sets: list[str], env: dict, kill: dict | None, log: Path) -> dict:
    """One process of the chaos run, killed as `kill` says (None: to its end)."""
    resume = bool(committed_steps(out))
    env = dict(env)
    env.pop("CTOPD_JAX_KILL_AT", None)
    if kill and "point" in kill:
        env["CTOPD_JAX_KILL_AT"] = f"{kill['point']}:{kill['passage']}"
    started = time.time()
    with open(log, "ab") as sink:
        proc = subprocess.Popen(command(out, sets, resume), env=env, stdout=sink,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = None if kill is None or "delay_s" not in kill or "after_line" in kill else \
        started + kill["delay_s"]
    while proc.poll() is None:
        if deadline is None and kill is not None and "after_line" in kill:
            text = log.read_bytes().decode("utf-8", "replace").rsplit("=== run ", 1)[-1]
            seen = [line for line in text.splitlines()
                    if line.startswith("step ") or line.startswith("run ")]
            if len(seen) > kill["after_line"]:
                deadline = time.time() + kill["delay_s"]
        if deadline is not None and time.time() >= deadline:
            proc.kill()     # SIGKILL
            break
        time.sleep(0.02)
    proc.wait()
    this_run = log.read_bytes().decode("utf-8", "replace").rsplit("=== run ", 1)[-1]
    lines = [line for line in this_run.splitlines() if line.strip()]
    resumed = re.search(r"resumed from step (\d+)", this_run)
    return {"resume": resume, "returncode": proc.returncode, "killed": proc.returncode == -9,
            "seconds": round(time.time() - started, 1), "kill": kill,
            "resumed_from": int(resumed.group(1)) if resumed else None,
            "last_line": lines[-1][:160] if lines else "", "committed_after": committed_steps(out)}


def chaos(out: Path, sets: list[str], env: dict, plan: list[dict], steps: int, every: int,
          startup_s: float, step_s: float) -> list[dict]:
    """Run to the end, applying the planned kills in order (module doc)."""
    log = out.parent / f"{out.name}.log"
    events, pending = [], list(plan)
    for _ in range(len(plan) + 5):
        with open(log, "ab") as sink:
            sink.write(f"\n=== run {len(events) + 1}\n".encode())
        done = max(committed_steps(out), default=0)
        kill = resolve(pending.pop(0), steps - done, every, len(pending) + 1, startup_s, step_s) \
            if pending else None
        event = run_once(out, sets, env, kill, log)
        events.append(event)
        if not event["killed"]:
            if event["returncode"] != 0:
                raise RuntimeError(f"run {len(events)} failed ({event['returncode']}): see {log}")
            return events
    raise RuntimeError(f"the chaos run did not finish: see {log}")


def _checkpoint(out: Path, step: int):
    import orbax.checkpoint as ocp   # heavy: only once the runs are done

    folder = out / "checkpoints" / str(step)
    meta = json.loads((folder / "meta" / "metadata").read_text())
    return ocp.StandardCheckpointer().restore(folder / "state"), meta


def compare(reference: Path, run: Path, steps: int) -> list[str]:
    """Every difference between the two runs' final state, logs and export (module doc)."""
    import numpy as np

    problems = []
    ref_state, ref_meta = _checkpoint(reference, steps)
    state, meta = _checkpoint(run, steps)
    paths = ref_meta["leaf_paths"]
    for key in sorted(ref_state):
        a, b = np.asarray(ref_state[key]), np.asarray(state.get(key))
        if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
            problems.append(f"checkpoint {steps}: {key} differs")
    if len(problems) > 3:
        problems[3:] = [f"... {len(problems) - 3} more arrays differ ({paths[:1]}...)"]
    for field in ("data", "update_count", "objective", "guard", "coverage", "checksums"):
        if ref_meta.get(field) != meta.get(field):
            problems.append(f"checkpoint {steps}: meta {field} differs")

    def rows(folder, name):
        path = folder / name
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
            if path.is_file() else []
    got, want = rows(run, "metrics.jsonl"), rows(reference, "metrics.jsonl")
    if [r["step"] for r in got] != list(range(1, steps + 1)):
        problems.append(f"metrics.jsonl steps {[r['step'] for r in got]}, not 1..{steps} once each")

    for g, w in zip(map(run_values, got), map(run_values, want)):
        diff = sorted(k for k in set(g) | set(w) if g.get(k) != w.get(k))
        if diff:
            problems.append(f"metrics.jsonl step {g['step']}: {diff} differ")
    if rows(run, "samples.jsonl") != rows(reference, "samples.jsonl"):
        problems.append("samples.jsonl differs")
    ref_hf, hf = reference / "hf_student", run / "hf_student"
    names = sorted(p.name for p in ref_hf.iterdir()) if ref_hf.is_dir() else []
    if not names or names != (sorted(p.name for p in hf.iterdir()) if hf.is_dir() else []):
        problems.append(f"hf_student files differ: {names}")
    for name in names:
        if (hf / name).is_file() and (hf / name).read_bytes() != (ref_hf / name).read_bytes():
            problems.append(f"hf_student/{name} differs")
    return problems


def lost_steps(events: list[dict]) -> list[str]:
    """A kill after which the run did not resume from the newest checkpoint committed then
    (the first later process that got as far as resuming says where it started)."""
    bad = []
    for n, e in enumerate(events):
        later = [f["resumed_from"] for f in events[n + 1:] if f["resumed_from"] is not None]
        if e["killed"] and e["committed_after"] and later[:1] != e["committed_after"][-1:]:
            bad.append(f"kill {n + 1}: checkpoints {e['committed_after']} on disk, resumed from "
                       f"{later[:1]}")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=5, help="checkpoint.every")
    p.add_argument("--keep", type=int, default=2, help="checkpoint.keep")
    p.add_argument("--batch", type=int, default=64, help="rollouts (and train batch) per step")
    p.add_argument("--out", default="runs/chaos")
    p.add_argument("--set", action="append", default=[], help="another config override")
    args = p.parse_args(argv)
    out = Path(args.out).absolute()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # one XLA cache for every process (the same programs compile once; a loaded program
    # computes what the compiled one did)
    env = {"JAX_COMPILATION_CACHE_DIR": str(out / "xla_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
           **os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    sets = overrides(args.steps, args.every, args.batch, args.keep, args.set)
    warm_up(out / "warm_up", sets, env)
    start = time.time()
    reference = subprocess.run(command(out / "reference", sets, False), env=env, cwd=ROOT,
                               capture_output=True, text=True)
    if reference.returncode != 0:
        print(reference.stderr[-3000:], file=sys.stderr)
        return 1
    reference_s = time.time() - start
    rows = [json.loads(line) for line in (out / "reference" / "metrics.jsonl").read_text().splitlines()]
    train_s = rows[-1]["elapsed_s"]      # the steps' share of the reference's time
    step_s = sorted(r["time_wall"] for r in rows)[len(rows) // 2]
    shutil.rmtree(out / "warm_up", ignore_errors=True)
    plan = plan_kills(args.seed, args.kills)
    events = chaos(out / "run", sets, env, plan, args.steps, args.every,
                   startup_s=reference_s - train_s, step_s=step_s)
    problems = compare(out / "reference", out / "run", args.steps) + lost_steps(events)
    report = {"steps": args.steps, "kills_planned": len(plan),
              "kills": sum(e["killed"] for e in events), "reference_s": round(reference_s, 1),
              "chaos_s": round(sum(e["seconds"] for e in events), 1), "events": events,
              "problems": problems}
    (out / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
