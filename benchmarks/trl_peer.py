"""Our GKD against TRL's GKDTrainer on the character pair: steady step seconds and peak host memory,
side by side in one run, interleaved, on identical inputs.

    make trl-venv                                  # once: .venv-trl (torch CPU, transformers, trl)
    python benchmarks/trl_peer.py [--runs 2] [--steps 12] [--warmup 2] [--lmbda 0.5]

Identical inputs: both load the same HF checkpoints (ctopd_jax/assets/demo_char/student and
teacher: safetensors, config, tokenizer), read the same rows of the demo train set in the same
order (ours as prompt/response rows, TRL as chat messages), and take the same hyper-parameters
(batch, λ, β, sampling temperature, max_new_tokens, AdamW, schedule, steps). The λ draws are the
same too: TRL's draw is fed the project's generator (trl_peer_gkd.py), so step k is on-policy in
both or in neither. Each trainer runs in a process of its own (ours here, TRL from .venv-trl,
benchmarks/trl_peer_gkd.py), alternating, `--runs` times each.

Steady step: the interval between consecutive step ends after the first `--warmup` steps (which
compile or warm caches), everything included (generation, both passes, update, logging). Ours
also reports its phases' sum (StepTimer) as a fraction of its wall time, and what its resident
memory is made of.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from ctopd_jax.common.heap import resident_bytes
from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.config import load_config
from ctopd_jax.demo.sources import model_dir, prompt_file
from ctopd_jax.loop.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_cpu_same.yaml"
TRL_WORKER = ROOT / "benchmarks" / "trl_peer_gkd.py"


def steady(step_ends: list[float], warmup: int) -> list[float]:
    """Seconds of each step after the first `warmup`; step_ends[0] is the start of step 1."""
    intervals = np.diff(np.asarray(step_ends, dtype=np.float64))
    if len(intervals) <= warmup:
        raise ValueError(f"{len(intervals)} steps leave none after {warmup} warm-up steps; raise --steps")
    return [float(x) for x in intervals[warmup:]]


def lambda_draws(seed: int, lmbda: float, steps: int) -> list[bool]:
    """On-policy or not, per step: the gkd objective's draws (one per step, one micro-batch)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return [bool(rng.uniform() <= lmbda) for _ in range(steps)]


def write_prompts(directory: Path, rows: int) -> tuple[Path, Path]:
    """The first `rows` rows of the demo train set, as ours reads them (prompt + response) and
    as TRL's GKD collator reads them (chat messages ending in the assistant's response)."""
    source = [json.loads(line) for line in prompt_file("train").read_text().splitlines() if line.strip()]
    if len(source) < rows:
        raise SystemExit(f"--steps x --batch = {rows} rows; the demo train set has {len(source)}")
    ours, trl = directory / "ours.jsonl", directory / "trl.jsonl"
    ours.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["response"]}) + "\n"
                            for r in source[:rows]))
    trl.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                                    {"role": "assistant", "content": r["response"]}]}) + "\n"
                           for r in source[:rows]))
    return ours, trl


def peak_rss() -> int:
    """The most this process has held resident so far (ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tree_bytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))


def trl_args(spec: dict) -> dict:
    """TRL's GKDConfig, at its fastest documented settings for this run: the same hyper-parameters
    as ours, and gradient_checkpointing off. Its default (on) recomputes every activation in the
    backward pass, and GKDTrainer then generates with use_cache=False, re-running the whole
    sequence for every new token (~10x its on-policy step here)."""
    h = spec["hyper"]
    return dict(
        output_dir=spec["output_dir"], max_steps=h["steps"], per_device_train_batch_size=h["batch"],
        gradient_accumulation_steps=1, learning_rate=h["lr"], adam_beta1=h["betas"][0],
        adam_beta2=h["betas"][1], weight_decay=h["weight_decay"], max_grad_norm=h["max_grad_norm"],
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": h["min_lr"]},
        warmup_steps=h["warmup_steps"], lmbda=h["lmbda"], beta=h["beta"], temperature=h["temperature"],
        max_new_tokens=h["max_new_tokens"], max_length=h["max_length"], seed=spec["seed"],
        gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, bf16=False, fp16=False)


def ours_overrides(spec: dict) -> list[str]:
    h = spec["hyper"]
    return [
        f"output_dir={spec['output_dir']}", f"steps={h['steps']}", f"seed={spec['seed']}",
        "algorithm.name=gkd", f"algorithm.gkd_lambda={h['lmbda']}", f"algorithm.gkd_beta={h['beta']}",
        "algorithm.gkd_lambda_granularity=micro_batch", f"algorithm.gkd_seed={h['gkd_seed']}",
        f"rollout.temperature={h['temperature']}", "rollout.top_p=1.0",
        f"rollout.generate_max_len={h['max_new_tokens']}", f"rollout.rollout_batch_size={h['batch']}",
        f"optimizer.train_batch_size={h['batch']}", f"optimizer.micro_batch_size={h['batch']}",
        f"optimizer.lr={h['lr']}", f"optimizer.betas=[{h['betas'][0]},{h['betas'][1]}]",
        f"optimizer.weight_decay={h['weight_decay']}", f"optimizer.max_grad_norm={h['max_grad_norm']}",
        f"optimizer.min_lr={h['min_lr']}", f"optimizer.warmup_ratio={h['warmup_steps'] / h['steps']}",
        f"data.path={spec['ours_prompts']}", "data.shuffle=false", "evaluation.dataset=",
        "checkpoint.save=false", "checkpoint.export_hf=false", "logging.tensorboard=false",
        "logging.progress=false",
    ]


def timed_train(config) -> dict:
    """Train with `config` in this process (ours' side of a peer benchmark): the trainer, its
    TrainResult, each step's end (perf_counter, after the start), the resident memory after the
    imports, the JAX runtime, the trainer and at each step's end, and the peak RSS by each
    step's end."""
    rss = {"imports": resident_bytes()}
    jax.devices()
    rss["jax runtime"] = resident_bytes()
    ends, rss_steps, peaks = [], [], []

    class Timed(Trainer):
        def step(self, step, timer):
            out = super().step(step, timer)
            ends.append(time.perf_counter())
            rss_steps.append(resident_bytes())
            peaks.append(peak_rss())
            return out

    trainer = Timed(config)
    rss["trainer"] = resident_bytes()
    start = time.perf_counter()
    result = trainer.train()
    return {"trainer": trainer, "result": result, "step_ends": [start] + ends, "rss": rss,
            "rss_steps": rss_steps, "peaks": peaks}


def run_ours(spec: dict) -> dict:
    """One training run of ours in this process; its step ends, phases and memory."""
    run = timed_train(load_config(CONFIG, ours_overrides(spec)))
    trainer = run["trainer"]
    rows = read_metrics(spec["output_dir"])
    known = {"student params": tree_bytes(trainer.params) + tree_bytes(trainer.rest),
             "optimizer state": tree_bytes(trainer.opt_state),
             "teacher params": sum(tree_bytes(t.scoring[1]) for t in trainer.teachers.values())}
    live = sum(x.nbytes for x in jax.live_arrays())
    return {
        "step_ends": run["step_ends"], "rss_steps": run["rss_steps"], "rss": run["rss"],
        "peak_rss": peak_rss(),
        "bytes": {**known, "other live jax arrays": live - sum(known.values())},
        "phases": [{k: v for k, v in r.items() if k.startswith("time_")} for r in rows],
        "losses": [r["loss"] for r in rows],
    }


def spawn(python: str, script: Path, spec_path: Path, env: dict, cpus: set[int] | None) -> dict:
    """One worker run; `cpus`: the CPUs it may run on (None: all of this process's)."""
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    out = subprocess.run([python, str(script), str(spec_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, preexec_fn=pin)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{script.name} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.3f} GiB"


def summary(name: str, results: list[dict], warmup: int, on_policy: list[bool]) -> dict:
    """Mean steady seconds per run (all steps, on-policy steps, off-policy steps, steps that
    compiled nothing), mean of the runs. TRL compiles nothing; ours compiles once per new shape
    bucket (a response-token count past a power of two), also after the warm-up."""
    kinds = on_policy[warmup:]
    per_run, compiling = [], 0
    for r in results:
        s = steady(r["step_ends"], warmup)
        compiled = [p.get("time_compile", 0.0) > 0 for p in r.get("phases", [{}] * len(r["step_ends"]))][warmup:]
        compiling += sum(compiled)
        on = [x for x, k in zip(s, kinds) if k]
        off = [x for x, k in zip(s, kinds) if not k]
        warm = [x for x, c in zip(s, compiled) if not c]
        per_run.append([np.mean(v) if v else np.nan for v in (s, on, off, warm)])
    mean = np.mean(per_run, axis=0)
    runs = ", ".join(f"{x[0]:.3f}" for x in per_run)
    print(f"{name:5s} steady step {mean[0]:.3f} s (runs: {runs}); on-policy steps {mean[1]:.3f} s, "
          f"off-policy steps {mean[2]:.3f} s; {compiling} steady steps compiled, the others "
          f"{mean[3]:.3f} s; peak RSS {gib(max(r['peak_rss'] for r in results))}")
    return {"all": mean[0], "on": mean[1], "off": mean[2], "warm": mean[3],
            "peak": max(r["peak_rss"] for r in results)}


def report_memory(name: str, r: dict) -> None:
    rss = r["rss"]
    stages, previous = [], 0
    for stage, value in rss.items():
        stages.append(f"{stage} +{gib(value - previous)}")
        previous = value
    stages.append(f"first step +{gib(r['rss_steps'][0] - previous)}")
    stages.append(f"last step {gib(r['rss_steps'][-1])}")
    print(f"  {name} resident memory: " + ", ".join(stages) + f"; peak {gib(r['peak_rss'])}")
    print(f"  {name} arrays: " + ", ".join(f"{k} {v / 2 ** 20:.2f} MiB" for k, v in r["bytes"].items()))


def orchestrate(args) -> None:
    trl_python = Path(args.trl_python)
    if not trl_python.is_file():
        raise SystemExit(f"--trl-python {trl_python}: not found; create it with `make trl-venv`")
    work = Path(tempfile.mkdtemp(prefix="trl_peer_"))
    ours_prompts, trl_prompts = write_prompts(work, args.steps * args.batch)
    hyper = {"steps": args.steps, "batch": args.batch, "lmbda": args.lmbda, "beta": args.beta,
             "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "gkd_seed": args.seed,
             "lr": args.lr, "betas": [0.9, 0.98], "weight_decay": 0.0, "max_grad_norm": 1.0,
             "min_lr": 1e-5, "warmup_steps": max(1, round(0.05 * args.steps)), "max_length": 128}
    on_policy = lambda_draws(args.seed, args.lmbda, args.steps)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)   # one CPU device, as a user's run and TRL's single process
    # torch's OpenMP threads wait at every op for a thread the loaded machine descheduled (TRL's
    # step: 4.6 s on one thread, 45-50 s on two, load average ~8 on 2 cores): by default both
    # trainers get one CPU, the same one, and size their thread pools to it
    cpus = None if args.cpus == "all" else {min(os.sched_getaffinity(0))}
    results = {"ours": [], "trl": []}
    try:
        for i in range(args.runs):   # alternating, so the machine's load falls on both alike
            for side, python, script in (("ours", sys.executable, Path(__file__)),
                                         ("trl", str(trl_python), TRL_WORKER)):
                spec = {"student": str(model_dir("char_student")), "teacher": str(model_dir("char_teacher")),
                        "ours_prompts": str(ours_prompts), "trl_prompts": str(trl_prompts), "seed": args.seed,
                        "output_dir": str(work / f"{side}_{i}"), "hyper": hyper}
                spec["trl_args"] = trl_args(spec)
                spec_path = work / f"{side}_{i}.json"
                spec_path.write_text(json.dumps(spec))
                results[side].append(spawn(python, script, spec_path, env, cpus))
                print(f"run {i + 1} {side}: done", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)   # the prompt files, specs and run folders
    t = results["trl"][0]
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus ({'each run on CPU ' + str(min(cpus)) if cpus else 'all'}), "
          f"load average {os.getloadavg()[0]:.1f}; "
          f"torch {t['versions']['torch']} ({t['threads']} threads), trl {t['versions']['trl']}, "
          f"transformers {t['versions']['transformers']}")
    print(f"character pair, gkd: {args.steps} steps of {args.batch} prompts, λ {args.lmbda} "
          f"({sum(on_policy[args.warmup:])} of {args.steps - args.warmup} steady steps on-policy), β {args.beta}, "
          f"temperature {args.temperature}, max_new_tokens {args.max_new_tokens}; {args.runs} interleaved runs "
          f"each; steady = after {args.warmup} warm-up steps")
    ours = summary("ours", results["ours"], args.warmup, on_policy)
    trl = summary("TRL", results["trl"], args.warmup, on_policy)
    print(f"ours / TRL: steady step {ours['all'] / trl['all']:.3f}x (on-policy {ours['on'] / trl['on']:.3f}x, "
          f"off-policy {ours['off'] / trl['off']:.3f}x, steps that compiled nothing {ours['warm'] / trl['warm']:.3f}x); "
          f"peak RSS {ours['peak'] / trl['peak']:.3f}x")
    rows = [p for r in results["ours"] for p in r["phases"][args.warmup:]]
    wall = np.mean([p["time_wall"] for p in rows])
    print(f"ours' phases over the steady steps: {np.mean([p['time_total'] for p in rows]) / wall:.1%} of the "
          f"step wall time ({wall:.3f} s): " + ", ".join(
              f"{k[5:]} {np.mean([p.get(k, 0.0) for p in rows]):.4f}" for k in sorted(
                  {k for p in rows for k in p} - {"time_total", "time_wall", "time_compile"})))
    report_memory("ours", results["ours"][-1])
    report_memory("TRL", results["trl"][-1])
    print("final loss: ours " + ", ".join(f"{r['losses'][-1]:.4f}" for r in results["ours"]) +
          "; TRL " + ", ".join(f"{r['losses'][-1]:.4f}" for r in results["trl"]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):   # a worker run (spawn)
        print("RESULT " + json.dumps(run_ours(json.loads(Path(sys.argv[1]).read_text()))), flush=True)
        return
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lmbda", type=float, default=0.5, help="probability of an on-policy step (TRL's default)")
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus", choices=("one", "all"), default="one",
                   help="each trainer's process on one CPU (default) or on all of this process's")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    orchestrate(p.parse_args(argv))


if __name__ == "__main__":
    main()
