"""Same numbers as a baseline commit: each objective's demo run, and a resumed run, trained in
this tree and in a `git worktree` of the baseline, on the same seed and config file.

    python benchmarks/same_as_baseline.py --baseline c714c0a [--steps 3] [--objectives strict,opd]
        [--set optimizer.micro_batch_tokens=0 ...] [--vllm-python .venv-vllm/bin/python]

For every objective (default: all registered) the config is the one `demo --algorithm NAME`
runs (demo.compare.write_config, written once here and given to both trees), with `steps`
iterations, a checkpoint at every step, no HF export, and the `--set` overrides (given to
both trees: e.g. a default changed since the baseline, set to its old value). The objectives
that read a served teacher's top-k (`needs.teacher_scores` "topk": teacher_topk_strict,
topk_gkd) run behind a vLLM server of the demo teacher that each run starts itself
(`teacher.launch`, from `--vllm-python`; float32 on the CPU, so its answers repeat exactly);
without `--vllm-python` they are skipped with a line that says so. Compared exactly
(==, not a tolerance):
every metrics.jsonl value except wall-clock ones (time_*, wall_time, elapsed_s, tokens_per_s,
peak memory), and the final checkpoint's parameters; metrics renamed since are compared under
their new names (RENAMED). Then, in this tree only, the first objective's run is SIGKILLed once
its step-1 checkpoint is on disk and resumed to `steps`, which must equal the baseline's
straight run (killed once the metrics row of step 1 is written, which the loop does after
that step's checkpoint is saved, and the checkpoint folder is committed: the state a resume
needs, and the row the comparison reads). Prints one line per check and exits 1 on any
difference.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ctopd_jax.common.metrics import run_values

ROOT = Path(__file__).resolve().parents[1]
# a served teacher (the objectives that read its top-k), started by each run (teacher.launch)
SERVED_TEACHER = ("teacher.engine=vllm_server", "teacher.launch=true", "teacher.model=demo-teacher",
                  "teacher.top_k=8", "teacher.timeout_s=120")
# the turn curriculum's metrics lost their objective prefix (issue 24): old name -> new name
RENAMED = {"tcod_turn_limit": "turn_limit", "tcod_prefix_turns": "expert_prefix_turns",
           "tcod_teacher_expert": "teacher_expert_samples"}


def train(tree: Path, config: Path, out: Path, steps: int, overrides: list[str], resume: bool = False,
          kill_after_step: int = 0) -> None:
    """`ctopd_jax.train` of `tree`; `kill_after_step`: SIGKILL it once that step is logged and
    checkpointed (`finished`)."""
    cmd = [sys.executable, "-m", "ctopd_jax.train", "--config", str(config),
           "--set", f"output_dir={out}", "--set", f"steps={steps}", "--set", "checkpoint.every=1",
           "--set", "checkpoint.export_hf=false", "--set", "checkpoint.async_save=false",
           "--set", "logging.tensorboard=false", "--set", "logging.progress=false",
           *[arg for item in overrides for arg in ("--set", item)]]
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd + (["--resume"] if resume else []), cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if kill_after_step:
        while proc.poll() is None and not finished(out, kill_after_step):
            time.sleep(0.05)
        if proc.poll() is not None:
            raise RuntimeError(f"{tree.name}: the run ended (exit {proc.returncode}) before step "
                               f"{kill_after_step} was logged and checkpointed:\n{proc.stderr.read()[-2000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{tree.name}: {' '.join(cmd[2:])} exited {proc.returncode}:\n{err[-2000:]}")


def finished(run: Path, step: int) -> bool:
    """The metrics row of `step` is whole in metrics.jsonl (a line ended by its newline) and
    its checkpoint is committed (Orbax renames `<step>.orbax-checkpoint-tmp*` to `<step>` once
    the write is complete; the loop logs the row after the synchronous save returns)."""
    path = run / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    logged = any(json.loads(line).get("step") == step for line in text.splitlines(keepends=True)
                 if line.endswith("\n"))
    return logged and (run / "checkpoints" / str(step)).is_dir()


def rows(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append({RENAMED.get(k, k): v for k, v in run_values(row).items()})
    return out


def params(run: Path) -> dict:
    """{leaf path: bytes} of the newest checkpoint's parameters (Orbax, read with numpy)."""
    import numpy as np
    import orbax.checkpoint as ocp

    step = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    restored = ocp.StandardCheckpointer().restore(run / "checkpoints" / str(step) / "state")
    return {k: np.asarray(v).tobytes() for k, v in sorted(restored.items())}


def reads_served_topk(objective_class) -> bool:
    """Whether the objective reads a served teacher's top-k (its needs at default settings;
    needs may be a property of the instance)."""
    settings = objective_class.settings_class(name=objective_class.name)
    return objective_class(settings).needs.teacher_scores == "topk"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a commit of this repository")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--objectives", default="", help="comma-separated (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override given to both trees (repeatable)")
    parser.add_argument("--vllm-python", default="",
                        help="the Python with vLLM (make .venv-vllm/.installed) that serves the teacher "
                             "of the served top-k objectives; without it they are skipped")
    args = parser.parse_args()
    from ctopd_jax.algorithms import registry
    from ctopd_jax.demo.compare import write_config

    names = [n for n in args.objectives.split(",") if n] or sorted(registry())
    served = {n for n in names if reads_served_topk(registry()[n])}
    if served and not args.vllm_python:
        print(f"{', '.join(sorted(served))}: skipped (a served teacher: pass --vllm-python)", flush=True)
        names = [n for n in names if n not in served]
    launch = [*SERVED_TEACHER, f"teacher.launch_python={Path(args.vllm_python).absolute()}"]
    overrides = {n: args.set + (launch if n in served else []) for n in names}
    work = Path(tempfile.mkdtemp(prefix="same_as_baseline_"))
    base = work / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=ROOT,
                   check=True, capture_output=True)
    failed = 0
    try:
        for name in names:
            config = write_config(name, work / "configs")
            runs = {}
            for label, tree in (("baseline", base), ("this tree", ROOT)):
                runs[label] = work / label.replace(" ", "_") / name
                train(tree, config, runs[label], args.steps, overrides[name])
            same_rows = rows(runs["baseline"]) == rows(runs["this tree"])
            same_params = params(runs["baseline"]) == params(runs["this tree"])
            failed += not (same_rows and same_params)
            print(f"{name:<12} metrics {'equal' if same_rows else 'DIFFER'}, final parameters "
                  f"{'equal' if same_params else 'DIFFER'}", flush=True)
        name = names[0]
        resumed = work / "resumed" / name
        config = work / "configs" / f"config_{name}.yaml"
        train(ROOT, config, resumed, args.steps, overrides[name], kill_after_step=1)
        train(ROOT, config, resumed, args.steps, overrides[name], resume=True)
        same = (rows(resumed) == rows(work / "baseline" / name)
                and params(resumed) == params(work / "baseline" / name))
        failed += not same
        print(f"{name:<12} killed after its step-1 row and checkpoint, resumed here == baseline run: "
              f"{'equal' if same else 'DIFFER'}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
