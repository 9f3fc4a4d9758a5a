"""SimCT and MP-OPD through the real trainer on the real Qwen2.5 -> Llama-3 tokenizer pair.

Tiny RANDOM models of the real architectures with the real vocabularies (Qwen2 preset teacher,
151,665 ids, tied embeddings; Llama preset student, 128,256 ids) run one iteration of
`Trainer` on prompts with CJK, emoji and arithmetic. The random student writes junk byte
sequences (split UTF-8 characters, added tokens, CJK pieces): every objective must take them
without a crash, with a finite loss, its own metrics in range and equal to what the segmenters
give on the same collected batch, strict pairs, and a parameter update.
"""
from __future__ import annotations

import json
import math
import time

import jax
import numpy as np
import pytest

import ctopd_jax.algorithms  # noqa: F401  (heavy imports at collection, not inside a test)
from ctopd_jax.align.atoms import FAIL_REASONS, mpopd_atoms
from ctopd_jax.align.simct import simct_segments
from ctopd_jax.config import load_config
from ctopd_jax.loop.trainer import Trainer

PROMPTS = [
    "计算 12 + 35 × 2 = ? 请一步一步地解答。",
    "What is 7 × 8 − 6? 🤔 Answer with a number.",
    "🍎🍎🍎 + 🍎🍎 = 几个苹果？ 3 + 2 = ?",
    "東京から大阪まで 515 km ÷ 5 h = ? km/h 🚄👨‍👩‍👧",
]
SAMPLES = 2   # responses per prompt: 8 responses, one micro-batch of one sample per batch shard

# ~60-100 s per run on 2 CPU cores (first run: model init, sampler and step compiles)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("real_pair") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in PROMPTS),
                    encoding="utf-8")
    return path


def run(write_config, prompt_file, qwen, llama, run_name, micro_batch=None, **algorithm):
    """(last metrics, collected host batch, params before, params after, trainer).

    One micro-batch of 8 divides over the 8 host devices, so each batch shard is prepared on
    its own and the loss runs per shard (shard_map); `micro_batch=4` does not divide: two
    micro-batches of one unit each, gradients accumulated."""
    batch = len(PROMPTS) * SAMPLES
    cfg, _ = write_config(
        run_name,
        steps=1,
        model={"student": "tiny_llama", "teacher": "tiny_qwen2",
               "student_tokenizer": "llama3", "teacher_tokenizer": "qwen2.5"},
        rollout={"rollout_batch_size": len(PROMPTS), "n_samples_per_prompt": SAMPLES,
                 "generate_max_len": 24, "max_prompt_len": 96},
        algorithm={"chunked_loss_size": 64, **algorithm},
        optimizer={"lr": 1e-3, "schedule": "constant", "warmup_ratio": 0.0, "train_batch_size": batch,
                   "micro_batch_size": micro_batch or batch},
        data={"path": str(prompt_file)},
        checkpoint={"every": 0, "keep": 1, "export_hf": False, "async_save": False},
    )
    began = time.perf_counter()
    trainer = Trainer(load_config(cfg))
    assert trainer.s_tok.vocab_size == llama.vocab_size == 128256
    assert trainer.default_parts.tokenizer.vocab_size == qwen.vocab_size
    assert trainer.student.cfg.vocab_size == llama.vocab_size and trainer.student.cfg.family == "llama"
    assert trainer.default_parts.model.cfg.vocab_size == qwen.vocab_size and trainer.default_parts.model.cfg.family == "qwen2"
    before = jax.tree.map(np.array, trainer.params)
    hosts = []
    collect = trainer.default_parts.collector.collect

    def recording(*args, **kwargs):
        hosts.append(collect(*args, **kwargs))
        return hosts[-1]

    trainer.default_parts.collector.collect = recording
    metrics = trainer.train().last_metrics
    seconds = time.perf_counter() - began
    after = jax.tree.map(np.array, trainer.params)
    assert len(hosts) == 1
    print(f"\n{run_name}: {seconds:.1f} s; lr {metrics['lr']}; " +
          ", ".join(f"{k}={v:.2f}" for k, v in sorted(metrics.items()) if k.startswith("time_")))
    print(f"responses {hosts[0].responses!r}")
    return metrics, hosts[0], before, after, trainer


def common_checks(metrics, host, before, after, kd_name):
    assert host.size == len(PROMPTS) * SAMPLES
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics[f"{kd_name}_loss"])
    assert math.isfinite(metrics["grad_norm"]) and metrics["update_applied"] == 1
    assert metrics["strict_pairs"] > 0 and metrics["strict_pairs"] == host.alignment.num_pairs
    assert metrics["student_response_tokens"] == int(host.student.response_lens.sum())
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    assert any(changed), "the student did not move"


def edge_cases(host):
    """What the junk held: samples with a split UTF-8 character, with an added token."""
    split = sum(r.decode("utf-8", "replace") != r.decode("utf-8", "ignore") for r in host.student.resp_bytes)
    added = 0
    for b in range(host.size):
        lo, hi = host.student.resp_offsets[b], host.student.resp_offsets[b + 1]
        ids = host.student.resp_ids[lo:hi]
        ids = ids[ids != host.student.eos_id]
        added += int((~host.student.resp_pairable[lo:lo + len(ids)]).any())
    return {"split_utf8": split, "added_token": added}


@pytest.mark.parametrize("mode,micro_batch", [("raw_logit", 8), ("mean_logprob", 4)])
def test_simct_on_the_real_pair(write_config, prompt_file, qwen, llama, mode, micro_batch):
    metrics, host, before, after, _ = run(write_config, prompt_file, qwen, llama, f"simct_{mode}",
                                          micro_batch, name="simct", span_score_mode=mode)
    common_checks(metrics, host, before, after, "simct")
    print(f"simct {mode} edge cases {edge_cases(host)}; " +
          ", ".join(f"{k}={metrics[k]:.4g}" for k in sorted(metrics) if k.startswith(("simct", "align"))))
    seg = simct_segments(host.teacher, host.student)
    rows = len(seg)
    assert rows > 0
    assert 0 < metrics["align_ratio"] <= 1
    assert metrics["simct_segments_per_sample"] == pytest.approx(rows / host.size)
    span = float(seg.is_span.mean())
    assert 0 <= metrics["simct_span_row_fraction"] <= 1
    assert metrics["simct_span_row_fraction"] == pytest.approx(span)
    assert metrics["simct_kept_row_fraction"] == 1.0            # no G(h) mask
    # SPEC §7's align_ratio over the whole batch, from the segments
    g = seg.segments.astype(np.int64)
    aligned = np.maximum(g[:, 2] - g[:, 1], g[:, 4] - g[:, 3]).sum()
    total = np.maximum(host.student.response_lens, host.teacher.response_lens).sum()
    assert metrics["align_ratio"] == pytest.approx(aligned / total, rel=1e-6)


@pytest.mark.parametrize("mode", ["atomic", "grass_chunk", "align", "random2-5"])
def test_mp_opd_on_the_real_pair(write_config, prompt_file, qwen, llama, mode):
    # grass_chunk on two unsharded micro-batches: its noise EMA is updated by one host callback
    # per micro-batch in sample order; in a sharded micro-batch each shard calls back on its own,
    # unordered (not deterministic, and the reported noise variance is summed over shards).
    metrics, host, before, after, trainer = run(write_config, prompt_file, qwen, llama, f"mp_opd_{mode}",
                                                4 if mode == "grass_chunk" else None,
                                                name="mp_opd", mp_opd_mode=mode, grass_chunk_atoms=3)
    print(f"mp_opd {mode} edge cases {edge_cases(host)}; " +
          ", ".join(f"{k}={metrics[k]:.4g}" for k in sorted(metrics) if k.startswith("mp_opd")))
    atoms = mpopd_atoms(host.teacher, host.student)
    counts = atoms.fail_counts()
    for reason in FAIL_REASONS:
        value = metrics[f"mp_opd_fail_{reason}"]
        assert value >= 0 and value == pytest.approx(counts[reason] / host.size)
    valid = int(atoms.sample_valid.sum())
    assert valid + sum(counts.values()) == host.size
    assert valid > 0, f"every sample failed closed: {counts}"
    assert metrics["mp_opd_atoms_per_sample"] == pytest.approx(len(atoms.atoms) / valid)
    if mode in ("grass_chunk", "align"):
        assert 0 <= metrics["mp_opd_fallback_fraction"] <= 1
    if mode == "grass_chunk":
        assert 0 < metrics["mp_opd_grass_alpha"] <= 1
        assert trainer.objective.state_dict()["grass_noise_updates"] > 0
        # the σ² the samples used (the EMA before each update) and the EMA after the last
        # update: both positive, in no fixed order (a last sample's large s² lifts the EMA
        # past every value used before it)
        assert trainer.objective.noise.sigma2 > 0 and metrics["mp_opd_grass_noise_var"] > 0
    common_checks(metrics, host, before, after, "mp_opd")
