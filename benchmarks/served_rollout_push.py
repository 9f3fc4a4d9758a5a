"""The cost of each weight push to a rollout server (full weights through disk, LoRA adapter),
one demo iteration's rollouts on the server against the JAX sampler, and the demo's iteration
wall time with `rollout.async_rollouts` against the synchronous loop, in one run.

    .venv/bin/python benchmarks/served_rollout_push.py [--vllm-python .venv-vllm/bin/python]
                                                        [--reps 5] [--rank 8] [--steps 8]

Two `vllm serve` processes are started in turn by ServedRolloutEngine (rollout.launch), on the
demo student (float32, CPU): one for the full student (weight_sync disk: safetensors into a fresh
folder + /collective_rpc reload_weights + /reset_prefix_cache), one for the student with rank
`--rank` LoRA adapters on every target (weight_sync adapter: PEFT files + /v1/load_lora_adapter,
the previous adapter unloaded). A push is timed from the export to the server's answer, without
the log-prob check that follows it (reported apart). Bytes are the files the server reads.
Rollouts: 64 prompts x up to 36 new tokens (the demo's rollout_batch_size and generate_max_len),
temperature 1, on the served student and on the JAX sampler (warm, one untimed call each); best
of --reps. Loop: configs/tiny_cpu_served_rollouts.yaml trained --steps iterations three times,
each with its own launched server: synchronous, async at staleness 0 and at staleness 1
(`time_wall` per iteration, the first one, which compiles, left out; median and mean).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ctopd_jax.config import load_config  # noqa: E402
from ctopd_jax.loop.trainer import Trainer  # noqa: E402
from ctopd_jax.models import lora  # noqa: E402
from ctopd_jax.models.weights import load_hf_checkpoint  # noqa: E402
from ctopd_jax.preflight import preflight  # noqa: E402
from ctopd_jax.rollout import SamplingParams  # noqa: E402
from ctopd_jax.rollout.jax_sampler import JaxSampler  # noqa: E402
from ctopd_jax.rollout.served import ServedRolloutEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_cpu_served_rollouts.yaml"
EOS, PAD = 900, 897


def student():
    return load_hf_checkpoint(ROOT / "ctopd_jax" / "assets" / "demo" / "student")[0]


def nudge(model, step: int):
    """New weights for every push (what an update does): the adapters, else the lm_head."""
    targets = [getattr(m, n + s) for _, m, n, _ in lora._sites(model)
               for s in ("_lora_a", "_lora_b")] if lora.has_adapters(model) else [model.lm_head]
    for k, var in enumerate(targets):
        key = jax.random.fold_in(jax.random.key(step), k)
        var[...] = var[...] + 1e-3 * jax.random.normal(key, var[...].shape, var[...].dtype)


def pushes(engine, model, reps):
    seconds, checks = [], []
    for step in range(1, reps + 1):
        nudge(model, step)
        engine.update_weights(model)
        m = engine.push_metrics()
        seconds.append(m["rollout_push_s"])
        checks.append(m["logprob_gap"])
    return min(seconds), engine.push_metrics()["rollout_push_bytes"], max(checks)


def best(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def iteration_walls(vllm_python: str, steps: int, *overrides: str) -> list[float]:
    """`time_wall` of iterations 2..steps of the demo config trained with `overrides`."""
    with tempfile.TemporaryDirectory() as out:
        config = load_config(CONFIG, overrides=[
            f"output_dir={out}", f"steps={steps}", f"rollout.launch_python={vllm_python}",
            "checkpoint.save=false", "checkpoint.export_hf=false", "evaluation.dataset=",
            "logging.progress=false", "logging.tensorboard=false", *overrides])
        with preflight(config) as pre:
            Trainer(config, preflight=pre).train()
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [row["time_wall"] for row in rows if row.get("step", 0) > 1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="iterations of each loop run")
    args = p.parse_args()
    rollout = dataclasses.replace(load_config(CONFIG).rollout, launch_python=args.vllm_python)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 890, 24).tolist() for _ in range(64)]
    params = SamplingParams(temperature=1.0, max_new_tokens=36, seed=0)

    model = student()
    engine = ServedRolloutEngine(model, EOS, PAD, rollout, dtype="float32", max_model_len=100)
    try:
        full = pushes(engine, model, args.reps)
        served_s, served = best(lambda: engine.generate(prompts, params), args.reps)
    finally:
        engine.close()
    sampler = JaxSampler(model, EOS, PAD, max_prompt_len=64, max_batch_size=256)
    jax_s, local = best(lambda: sampler.generate(prompts, params), args.reps)

    adapted = student()
    lora.attach(adapted, args.rank, 2.0 * args.rank, list(lora.TARGETS), seed=0)
    engine = ServedRolloutEngine(adapted, EOS, PAD, rollout, dtype="float32", max_model_len=100)
    try:
        adapter = pushes(engine, adapted, args.reps)
    finally:
        engine.close()

    print(f"weight push, best of {args.reps} (export + transfer + reload; the check apart):")
    for name, (s, size, gap) in (("full (disk)", full), (f"adapter r={args.rank}", adapter)):
        print(f"  {name:14s} {s:.3f} s  {size / 1e6:.3f} MB  (log-prob check max gap {gap:.1e})")
    print(f"  adapter / full: {adapter[0] / full[0]:.2f}x the seconds, "
          f"{adapter[1] / full[1]:.3f}x the bytes")
    tokens = served.num_generated_tokens, local.num_generated_tokens
    print(f"one demo iteration's rollouts (64 prompts, <= 36 new tokens), best of {args.reps}:")
    print(f"  vLLM server {served_s:.2f} s ({tokens[0]} tokens), JAX sampler {jax_s:.2f} s "
          f"({tokens[1]} tokens): server / JAX = {served_s / jax_s:.2f}x the wall time")

    loops = {"synchronous": (), "async, staleness 0": ("rollout.async_rollouts=true",
                                                       "rollout.async_staleness=0"),
             "async, staleness 1": ("rollout.async_rollouts=true", "rollout.async_staleness=1")}
    walls = {name: iteration_walls(args.vllm_python, args.steps, *overrides)
             for name, overrides in loops.items()}
    sync = statistics.median(walls["synchronous"])
    print(f"demo iteration wall time (time_wall of iterations 2..{args.steps}), one server each:")
    for name, values in walls.items():
        median = statistics.median(values)
        print(f"  {name:19s} median {median:.2f} s, mean {statistics.mean(values):.2f} s "
              f"({median / sync:.2f}x the synchronous median)")


if __name__ == "__main__":
    main()
