"""Forward tokens/s of our jitted Decoder vs HF transformers (PyTorch CPU), same run.

Both models hold the same random weights (HF model saved, then loaded by our loader) and run
the same float32 batch; the logits are checked to agree before timing.  The two are timed in
alternating rounds so a change in machine load hits both alike; the median round is reported.

    .venv/bin/python benchmarks/model_forward.py [--layers 4 --hidden 512 --batch 4 --seq 256]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from transformers import LlamaConfig, LlamaForCausalLM

from ctopd_jax.models import weights
from ctopd_jax.models.config import ModelConfig


def bench_config(args) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_layers=args.layers, num_heads=args.hidden // 64,
        num_kv_heads=max(1, args.hidden // 256),
        head_dim=64, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 1024},
        rms_norm_eps=1e-5, tie_word_embeddings=False, family="llama",
        max_position_embeddings=4096)


def machine_info() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"cpu: {cpu}; cores visible: {os.cpu_count()}; torch threads: "
            f"{torch.get_num_threads()}; load avg (1 min): {load:.1f}\n"
            f"python {platform.python_version()}, jax {jax.__version__} "
            f"({jax.devices()[0].platform}, {jax.device_count()} devices), "
            f"torch {torch.__version__}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    cfg = bench_config(args)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict())).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model, _ = weights.load_hf_checkpoint(tmp)

    rng = np.random.RandomState(0)
    ids = rng.randint(0, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
    positions = np.broadcast_to(np.arange(args.seq, dtype=np.int32), ids.shape)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, positions):
        return nnx.merge(graphdef, state)(ids, positions)

    ids_j, pos_j = jnp.asarray(ids), jnp.asarray(positions)
    ids_t = torch.tensor(ids, dtype=torch.long)

    def run_ours():
        return forward(state, ids_j, pos_j).block_until_ready()

    def run_hf():
        with torch.inference_mode():
            return hf(ids_t).logits

    ours = np.asarray(run_ours())  # compiles
    ref = run_hf().numpy()
    err = float(np.abs(ours - ref).max())
    run_hf()

    ours_t, hf_t = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        run_ours()
        ours_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        run_hf()
        hf_t.append(time.perf_counter() - start)

    tokens = args.batch * args.seq
    ours_tps = tokens / statistics.median(ours_t)
    hf_tps = tokens / statistics.median(hf_t)
    n_params = sum(p.numel() for p in hf.parameters())
    print(machine_info())
    print(f"config: {cfg.num_layers} layers, hidden {cfg.hidden_size}, mlp "
          f"{cfg.intermediate_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} kv, vocab "
          f"{cfg.vocab_size}, {n_params / 1e6:.1f}M params, float32; batch {args.batch} x seq "
          f"{args.seq}; median of {args.rounds} alternating rounds")
    print(f"max |logits ours - HF| = {err:.2e}")
    print(f"ours (jax.jit):           {ours_tps:10.0f} tokens/s")
    print(f"HF transformers (torch):  {hf_tps:10.0f} tokens/s "
          f"(attn_implementation={hf.config._attn_implementation})")
    print(f"ratio ours / HF = {ours_tps / hf_tps:.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    main()
