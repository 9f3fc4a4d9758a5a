"""Re-tokenize and strictly align 512 responses of ~1,000 tokens with the real Qwen2.5 ->
Llama-3 pair: ctopd_jax's vectorised alignment vs a straightforward pure-Python two-pointer
implementation of the same rule (SPEC §2), same run, same data; outputs compared for equality.

    python benchmarks/align_throughput.py [--responses 512] [--tokens 1000] [--repeats 3]

Prints the alignment-stage ratio (the target is >= 20x) and, for context, the end-to-end
ratio with re-tokenization (ours batched vs the reference encoding sample by sample).
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np


def make_responses(llama, count: int, tokens: int) -> list[str]:
    """Worked GSM-style solutions (reasoning-gym gsm_symbolic) chained to ~``tokens`` tokens."""
    import reasoning_gym

    data = list(reasoning_gym.create_dataset("gsm_symbolic", size=400, seed=1))
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        parts, size = [], 0
        while size < tokens:
            row = data[int(rng.integers(len(data)))]
            part = row["metadata"]["answer_cot"] + f"\nSo the answer is \\boxed{{{row['answer']}}}.\n\n"
            parts.append(part)
            size += len(llama.encode(part))
        out.append("".join(parts))
    return out


def reference_align(t_side, s_side, t_batch, s_batch):
    """Pure Python, one sample at a time: byte views from the id lists, the concatenation
    check, the two-pointer walk, the EOS pair; flat logits rows as the vectorised version."""
    pairs_t, pairs_s, pair_sample, groups, mismatched = [], [], [], [], []
    t_ids_all, s_ids_all = t_batch.input_ids.tolist(), s_batch.input_ids.tolist()
    for b in range(t_batch.batch_size):
        tp, sp = int(t_batch.prompt_lens[b]), int(s_batch.prompt_lens[b])
        tn, sn = int(t_batch.response_lens[b]) - 1, int(s_batch.response_lens[b]) - 1
        t_ids, s_ids = t_ids_all[b][tp:tp + tn], s_ids_all[b][sp:sp + sn]
        t_bytes = [t_side.token_bytes[i] for i in t_ids]
        s_bytes = [s_side.token_bytes[i] for i in s_ids]
        if b"".join(t_bytes) != b"".join(s_bytes):
            mismatched.append(b)
            continue
        t_base = b * t_batch.seq_len + tp - 1
        s_base = b * s_batch.seq_len + sp - 1
        i = j = 0
        t_end, s_end = len(t_bytes[0]) if t_bytes else 0, len(s_bytes[0]) if s_bytes else 0
        gi = gj = 0
        while i < tn and j < sn:
            if t_end == s_end:
                if (i == gi and j == gj and t_bytes[i] and not t_side.is_added[t_ids[i]]
                        and not s_side.is_added[s_ids[j]]):
                    pairs_t.append(t_base + i)
                    pairs_s.append(s_base + j)
                    pair_sample.append(b)
                else:
                    groups.append((b, t_base + gi, t_base + i + 1, s_base + gj, s_base + j + 1))
                i += 1
                j += 1
                gi, gj = i, j
                if i < tn:
                    t_end += len(t_bytes[i])
                if j < sn:
                    s_end += len(s_bytes[j])
            elif t_end < s_end:
                i += 1
                t_end += len(t_bytes[i])
            else:
                j += 1
                s_end += len(s_bytes[j])
        if gi < tn or gj < sn:
            groups.append((b, t_base + gi, t_base + tn, s_base + gj, s_base + sn))
        pairs_t.append(t_base + tn)  # the EOS pair
        pairs_s.append(s_base + sn)
        pair_sample.append(b)
    return pairs_t, pairs_s, pair_sample, groups, mismatched


def reference_retokenize(side, prompts, responses):
    """SPEC §1.3 one sample at a time (the per-sample loop a straightforward port would do)."""
    rows = []
    for prompt, response in zip(prompts, responses):
        resp = side.tokenizer.encode(response, add_special_tokens=False).ids
        full = side.tokenizer.encode(prompt + response, add_special_tokens=False).ids
        rows.append((full + [side.eos_id], len(full) - len(resp)))
    return rows


def best_of(repeats, fn):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from ctopd_jax.align import strict_align
    from ctopd_jax.tokenization import load_tokenizer_side, retokenize_pair

    qwen, llama = load_tokenizer_side("qwen2.5"), load_tokenizer_side("llama3")
    responses = make_responses(llama, args.responses, args.tokens)
    t_prompts = [qwen.render_prompt("Solve the problem.")] * len(responses)
    s_prompts = [llama.render_prompt("Solve the problem.")] * len(responses)

    t_retok, (t_batch, s_batch) = best_of(args.repeats, lambda: retokenize_pair(
        qwen, llama, t_prompts, s_prompts, responses))
    t_ours, ours = best_of(args.repeats, lambda: strict_align(t_batch, s_batch))
    t_ref, ref = best_of(args.repeats, lambda: reference_align(qwen, llama, t_batch, s_batch))
    t_ref_retok, _ = best_of(1, lambda: (reference_retokenize(qwen, t_prompts, responses),
                                         reference_retokenize(llama, s_prompts, responses)))

    pairs_t, pairs_s, pair_sample, groups, mismatched = ref
    assert ours.teacher_rows.tolist() == pairs_t, "teacher rows differ"
    assert ours.student_rows.tolist() == pairs_s, "student rows differ"
    assert ours.pair_sample.tolist() == pair_sample, "pair samples differ"
    assert [tuple(g) for g in ours.mismatch_groups.tolist()] == groups, "mismatch groups differ"
    assert np.flatnonzero(ours.byte_mismatch).tolist() == mismatched, "byte mismatch differs"

    n_s, n_t = ours.num_student_response_tokens, int(ours.teacher_response_tokens.sum())
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, numpy {np.__version__}")
    print(f"data: {len(responses)} responses, {n_s:,} student (Llama-3) / {n_t:,} teacher "
          f"(Qwen2.5) response tokens, mean {n_s / len(responses):.0f} student tokens each")
    print(f"outputs identical: {ours.num_pairs:,} strict pairs, {len(groups):,} mismatch groups, "
          f"{len(mismatched)} byte-mismatched samples; coverage student "
          f"{100 * ours.student_coverage:.2f}% teacher {100 * ours.teacher_coverage:.2f}%")
    print(f"alignment:  ours {1e3 * t_ours:8.1f} ms   pure-Python two-pointer {1e3 * t_ref:8.1f} ms"
          f"   ratio {t_ref / t_ours:6.1f}x  (best of {args.repeats})")
    print(f"end to end: ours {1e3 * (t_retok + t_ours):8.1f} ms   reference "
          f"{1e3 * (t_ref_retok + t_ref):8.1f} ms   ratio {(t_ref_retok + t_ref) / (t_retok + t_ours):6.1f}x"
          f"  (re-tokenization: ours batched {1e3 * t_retok:.0f} ms, reference per sample "
          f"{1e3 * t_ref_retok:.0f} ms)")


if __name__ == "__main__":
    main()
