"""Packed rows against one row per sample: the student + teacher passes of one optimizer batch
(the trainer's own micro-batch step: prepare, teacher rows, student gradient), tokens/s and
padding fraction, on the same samples in the same run; and compile-only peak memory of the
student gradient at the seed config's shapes.

    python benchmarks/packed_rows.py [--workloads demo,long_tail] [--repeats 2] [--memory]

Workloads:
- demo: one rollout batch of the demo recipe's `strict` run (the demo cross-tokenizer pair,
  demo.compare.write_config), collected once by the demo student;
- long_tail: 64 synthetic samples on the tiny random pair (tests/trainer/conftest.py's models),
  lengths 16..1,024 drawn from a long tail (a math-reasoning run at small scale: most responses
  short, a few near the limit), ordered as host.sort_by_length orders a batch: longest first
  for the unpacked passes, in first-fit-decreasing micro-batches (packing.order) for the packed
  ones (the same lengths and tokens; the synthetic ids are drawn per layout).

Unpacked: `optimizer.micro_batch_size` samples per micro-batch, each in its own row padded to
the micro-batch's length bucket (pack.py). Packed: consecutive samples within
`optimizer.micro_batch_tokens` student tokens, one row per side (algorithms/packed_rows.py).
Padding fraction: pad slots ÷ all slots over both models' passes. Seconds: the best of
`--repeats` timed passes over the batch after one untimed pass (compilation), the two layouts'
passes taking turns (a shared machine's load falls on both alike).

--memory: XLA's temporary bytes of d(hidden states)/d(params) for the seed config's student
(configs/single_gpu_full_workload.yaml: Llama-3.2-3B shapes, bf16, scan + full remat, blockwise
attention) at its unpacked micro-batch (micro_batch_size rows of the longest sequence) against
the packed micro-batches its default budget (micro_batch_tokens auto) makes of full-length,
2,048-token and 1,000-token samples (compile only).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[1]


def demo_workload(out: Path, budget: int):
    from ctopd_jax.config import load_config
    from ctopd_jax.demo.compare import write_config

    config = load_config(write_config("strict", out / "configs"), [
        f"output_dir={out / 'demo'}", "evaluation.dataset=", "logging.tensorboard=false",
        "rollout.rollout_batch_size=64", "optimizer.train_batch_size=64", "optimizer.micro_batch_size=8",
        f"optimizer.micro_batch_tokens={budget}"])   # the collector orders the batch for it
    return config, None


def long_tail_workload(out: Path, budget: int):
    sys.path.insert(0, str(ROOT / "tests" / "trainer"))
    from conftest import tiny_tree
    from ctopd_jax.config import from_dict

    tree = tiny_tree(out / "long_tail", **{"rollout.rollout_batch_size": 64, "rollout.n_samples_per_prompt": 1,
                                            "optimizer.train_batch_size": 64, "optimizer.micro_batch_size": 8})
    tree["algorithm"] = {"name": "strict", "chunked_loss_size": 1024}
    tree["model"]["attention"] = "blockwise"
    return from_dict(tree), long_tail_host


def long_tail_host(trainer, budget: int, n: int = 64, seed: int = 0):
    """`n` samples, lengths 16 + 1,008 · u⁴ (median ~80, a few near 1,024), both sides, with a
    strict pair at every third response position; longest first, or with a `budget` in
    packing.order's first-fit-decreasing micro-batches of it."""
    import numpy as np

    from ctopd_jax.algorithms.packed_rows import order
    from ctopd_jax.collect.collector import HostBatch

    rng = np.random.default_rng(seed)
    lengths = np.sort(16 + (1008 * rng.uniform(size=n) ** 4).astype(int))[::-1]
    width, prompt = int(lengths.max()), 8
    if budget:
        lengths = lengths[order(lengths[:, None], budget, [-(-width // 64) * 64])]

    def side(vocab):
        ids = np.zeros((n, width), np.int32)
        mask = np.arange(width)[None] < lengths[:, None]
        ids[mask] = rng.integers(1, vocab, int(mask.sum()))
        loss_mask = (np.arange(width)[None] >= prompt - 1) & (np.arange(width)[None] < lengths[:, None] - 1)
        labels = np.concatenate([ids[:, 1:], np.zeros((n, 1), np.int32)], axis=1)
        return SimpleNamespace(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, labels=labels,
                               seq_len=width, batch_size=n, response_lens=lengths - prompt)

    overlap = trainer.default_parts.overlap
    s, t = side(overlap.student_vocab_size), side(overlap.teacher_vocab_size)
    sample, pos = np.nonzero(s.loss_mask & (np.arange(width)[None] % 3 == 0))
    rows = sample * width + pos
    return HostBatch(s, t, SimpleNamespace(pair_sample=sample, student_rows=rows, teacher_rows=rows,
                                           num_pairs=len(rows)), None, [], [])


def layout(trainer, host, tokens: int):
    """(run, padding fraction, micro-batches) of the batch's passes at micro_batch_tokens;
    run() runs them once."""
    import dataclasses

    import jax

    from ctopd_jax.algorithms.packed_rows import pack_rows
    from ctopd_jax.common.metrics import StepTimer
    from ctopd_jax.step.grad import zero_grads

    base = trainer.config
    config = dataclasses.replace(base, optimizer=dataclasses.replace(base.optimizer, micro_batch_tokens=tokens))
    trainer.config = config
    ranges, packed, teacher = trainer.micro_ranges(host, 0, host.size), trainer.packing, trainer.default_parts
    trainer.config = base
    real = slots = 0
    for start, stop in ranges:
        batch = trainer.objective.prepare(host, start, stop)
        if packed:
            batch = pack_rows(batch, tokens)
        for mask in (batch.student_mask, batch.teacher_mask):
            real += int((mask > 0).sum())
            slots += mask.size

    def run():
        trainer.config = config
        grads, total = zero_grads(trainer.params), host.tokens(0, host.size)
        for start, stop in ranges:
            _, _, _, grads = trainer.micro_batch(teacher, host, start, stop, total, 1, grads, StepTimer(),
                                                 None, packed)
        jax.block_until_ready(grads)
        trainer.config = base

    return run, 1.0 - real / slots, len(ranges)


def timed(runs, repeats: int) -> list[float]:
    """The best seconds of each run over `repeats` rounds that run each once in turn (so a
    shared machine's load falls on all alike), after one untimed round (compilation)."""
    for run in runs:
        run()
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            began = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - began)
    return best


def compare(name: str, make, budget: int, repeats: int) -> None:
    from ctopd_jax.loop import teacher_batches
    from ctopd_jax.common.metrics import StepTimer
    from ctopd_jax.loop.trainer import Trainer

    out = Path(tempfile.mkdtemp(prefix=f"packed_rows_{name}_"))
    config, synthetic = make(out, budget)
    trainer = Trainer(config)
    if synthetic is None:
        host, = teacher_batches.collect(trainer.teachers, config, trainer.objective, trainer.stream.next_batch(),
                                        config.seed, StepTimer(), 0).values()
        hosts = (host, host)
    else:
        hosts = (synthetic(trainer, 0), synthetic(trainer, budget))
    lengths = hosts[0].student.attention_mask.sum(axis=1)
    tokens = hosts[0].tokens(0, hosts[0].size)
    assert tokens == hosts[1].tokens(0, hosts[1].size)
    print(f"{name}: {len(lengths)} samples, student lengths {lengths.min()}..{lengths.max()} "
          f"(median {int(sorted(lengths)[len(lengths) // 2])}), {tokens:.0f} response tokens", flush=True)
    (run_u, pad_u, micro_u), (run_p, pad_p, micro_p) = layout(trainer, hosts[0], 0), layout(trainer, hosts[1], budget)
    seconds = timed([run_u, run_p], repeats)
    unpacked, packed = (seconds[0], pad_u, micro_u), (seconds[1], pad_p, micro_p)
    for label, (seconds, padding, micro) in (("unpacked", unpacked), (f"packed {budget}", packed)):
        print(f"  {label:<14} {micro:3d} micro-batches  {seconds:7.3f} s  {tokens / seconds:9.1f} "
              f"response tokens/s  padding {100 * padding:5.1f} %", flush=True)
    print(f"  packed / unpacked tokens/s: {unpacked[0] / packed[0]:.2f}x", flush=True)


def memory() -> None:
    import numpy as np

    from ctopd_jax.algorithms.padded_rows import micro_length
    from ctopd_jax.algorithms.packed_rows import budget, place
    from ctopd_jax.config import load_config
    from ctopd_jax.models.config import llama3_2_3b
    from ctopd_jax.models.memory_probe import student_grad_temp_bytes

    seed = load_config(ROOT / "configs" / "single_gpu_full_workload.yaml")
    tokens, r = budget(seed), seed.rollout
    cap = -(-(r.max_prompt_len + r.generate_max_len + 1) // 64) * 64   # the padded sequence length
    # the seed config's model section (its checkpoint is Llama-3.2-3B-Instruct)
    cfg = llama3_2_3b(dtype="bfloat16", param_dtype="float32", scan_layers=True, remat_policy="full",
                      mlp_chunk=1024, attention="blockwise")
    full = SimpleNamespace(attention_mask=np.ones((2, cap), bool), seq_len=cap)
    width = micro_length(full, 0, 2, 64)   # unpacked: micro_batch_size rows of the longest's bucket
    unpacked = student_grad_temp_bytes(cfg, seed.optimizer.micro_batch_size, width)
    print(f"seed student gradient, compile-only temporaries: [{seed.optimizer.micro_batch_size}, {width}] "
          f"one row per sample {unpacked / 2**30:.2f} GiB; packed at micro_batch_tokens auto = {tokens}",
          flush=True)
    # packed micro-batches of full-length samples, of 2,048-token ones and of 1,000-token ones
    for length, count in ((cap - 63, 2), (2048, 10), (1000, 20)):
        rows, width, _, _ = place([length] * count, tokens, cap)
        packed = student_grad_temp_bytes(cfg, rows, width, packed=True)
        print(f"  packed {count} x {length} tokens -> [{rows}, {width}]: {packed / 2**30:.2f} GiB "
              f"(ratio {packed / unpacked:.2f})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="demo,long_tail")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget", type=int, default=2048, help="optimizer.micro_batch_tokens of the packed runs")
    p.add_argument("--memory", action="store_true")
    args = p.parse_args()
    import jax
    print(f"jax {jax.__version__} {jax.default_backend()} x{jax.device_count()}, {os.cpu_count()} cpus", flush=True)
    makers = {"demo": demo_workload, "long_tail": long_tail_workload}
    for name in [w for w in args.workloads.split(",") if w]:
        compare(name, makers[name], args.budget, args.repeats)
    if args.memory:
        memory()


if __name__ == "__main__":
    main()
