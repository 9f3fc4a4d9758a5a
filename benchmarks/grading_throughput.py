"""Grading throughput (samples/s) on a MATH-like mix, and the time bound on adversarial input.

    python benchmarks/grading_throughput.py [--samples 4000] [--workers 2] [--timeout 2]

Mix: responses of ~1.5 kB of reasoning ending in a boxed answer, drawn from a pool of
(prediction, reference) pairs in the proportions a mean@32 run sees: mostly exact or numeric
matches and wrong numbers (decided in process), some needing sympy (surds, polynomials,
pi-forms), some unboxed. Reported against a reference measured in the same run: the in-process
fast path alone (string/numeric rules, no sympy), so the ratio shows what the bounded
symbolic step costs. Verdict caching is disabled per pass (fresh grader) except where noted.

Adversarial: a batch holding towers like 9^{9^{9}} (a single C-level big-integer power) among
normal samples; the run must finish in about (adversarial count x timeout / workers) plus the
normal work, and each tower is reported as a timeout or error, never a hang. The bound is CPU
time (see grading/pool.py), so on a loaded machine the wall time per tower grows with the load.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import time

from ctopd_jax.grading import MathGrader, extract_answer, normalize_answer, reference_answer
from ctopd_jax.grading.equivalence import compare

FAST = [("42", "42"), ("\\frac{1}{2}", "0.5"), ("17", "18"), ("-3", "-3"), ("1,000", "1000"),
        ("\\dfrac{3}{4}", "\\frac34"), ("(1,2)", "(1, 2)"), ("[0,1)", "(0,1)"), ("12", "\\text{12 cm}")]
SYMBOLIC = [("2\\sqrt{3}", "\\sqrt{12}"), ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
            ("x^2+2x+1", "(x+1)^2"), ("\\frac{\\pi}{3}", "\\frac{2\\pi}{6}"), ("3\\sqrt{2}", "4")]
REASONING = ("Let us think step by step. We expand the expression and collect terms; "
             "then we substitute the known values. ") * 12


def make_mix(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    responses, golds = [], []
    for i in range(n):
        r = rng.random()
        if r < 0.8:
            pred, gold = rng.choice(FAST)
        elif r < 0.95:
            pred, gold = rng.choice(SYMBOLIC)
            # vary the symbolic pairs so the verdict cache cannot answer most of them
            pred, gold = f"{pred}+{i}", f"{gold}+{i}"
        else:
            responses.append(REASONING + "so I think it is 5")
            golds.append("5")
            continue
        responses.append(f"{REASONING}Therefore the answer is $\\boxed{{{pred}}}$.")
        golds.append(gold)
    return responses, golds


def fast_path_only(responses, golds) -> float:
    start = time.perf_counter()
    for r, g in zip(responses, golds):
        e = extract_answer(r)
        if e is not None:
            compare(normalize_answer(e), normalize_answer(reference_answer(g)))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--adversarial", type=int, default=4)
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
    responses, golds = make_mix(args.samples)

    ref = fast_path_only(responses, golds)
    print(f"reference (in-process string/numeric rules only): {len(responses) / ref:,.0f} samples/s")

    with MathGrader(timeout_s=args.timeout, workers=args.workers) as grader:
        grader.grade_many(responses[:8], golds[:8])  # start the workers outside the timing
        start = time.perf_counter()
        results = grader.grade_many(responses, golds)
        full = time.perf_counter() - start
    methods: dict[str, int] = {}
    for r in results:
        methods[r.method] = methods.get(r.method, 0) + 1
    print(f"full grader ({args.workers} sympy workers): {len(responses) / full:,.0f} samples/s "
          f"= {ref / full:.3f}x the fast path; methods {methods}")

    normal_r, normal_g = responses[:200], golds[:200]
    towers = ["9^{9^{9}}", "10^{10^{10}}", "7^{7^{7^{7}}}", "(2^{2^{40}})!"]
    adv_r = normal_r + [f"\\boxed{{{towers[i % len(towers)]}}}" for i in range(args.adversarial)]
    adv_g = normal_g + ["5"] * args.adversarial
    with MathGrader(timeout_s=args.timeout, workers=args.workers) as grader:
        grader.grade_many(responses[:8], golds[:8])
        start = time.perf_counter()
        base = grader.grade_many(normal_r, normal_g)
        base_t = time.perf_counter() - start
    with MathGrader(timeout_s=args.timeout, workers=args.workers) as grader:
        grader.grade_many(responses[:8], golds[:8])
        start = time.perf_counter()
        adv = grader.grade_many(adv_r, adv_g)
        adv_t = time.perf_counter() - start
    load = os.getloadavg()[0]
    outcomes = [r.method for r in adv[len(normal_r):]]
    print(f"adversarial: {args.adversarial} towers among {len(normal_r)} samples took {adv_t:.1f}s "
          f"(same 200 without towers: {base_t:.2f}s; bound per tower: {args.timeout}s CPU + <1s "
          f"rounding + worker restart, stretched by load avg {load:.1f} on {os.cpu_count()} CPUs) "
          f"outcomes {outcomes}; "
          f"normal verdicts unchanged: {[r.correct for r in adv[:len(normal_r)]] == [r.correct for r in base]}")


if __name__ == "__main__":
    main()
