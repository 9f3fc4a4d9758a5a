"""Span-loss λ sweep on the CPU demo (SPEC §6, paper Eqs. 7–9 and §5 gradient diagnostics).

    python benchmarks/span_sweep.py [--lambdas 0 0.5 1.5] [--steps 100] [--out runs/span_sweep]
        [--no-append]

Per λ: `python -m ctopd_jax.train --config configs/tiny_cpu.yaml --set algorithm.name=span
algorithm.span_lambda=λ algorithm.span_base=topk_strict algorithm.ctkd_topk=16
algorithm.diagnostics_every=20 ...` into <out>/lambda_<λ> (every other setting is tiny_cpu's),
then `python -m ctopd_jax.evaluate` grades the exported student greedily on the demo's held-out
split (what `python -m ctopd_jax.demo` reports as "student accuracy after").

Prints the table, writes benchmarks/span_sweep.png (held-out accuracy per λ;
the diagnostics over steps) and appends the table, the command and a verdict to
benchmarks/RESULTS.md. A λ whose run directory already holds a finished run and an evaluation
summary is not re-run (delete the directory to redo it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from demo_runs import ROOT, train_then_evaluate

DIAG = ("grad_cos_mismatch", "grad_norm_ratio", "grad_cos_control")


def tag(lam: float) -> str:
    return f"{lam:g}".replace(".", "p")


def run_one(lam: float, steps: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"lambda_{tag(lam)}"
    run = train_then_evaluate(run_dir, "configs/tiny_cpu.yaml", [
        f"run_name=span_lambda_{tag(lam)}", "algorithm.name=span", f"algorithm.span_lambda={lam}",
        "algorithm.span_base=topk_strict", "algorithm.ctkd_topk=16",
        "algorithm.diagnostics_every=20", *extra], steps, "span_sweep")
    return {"lambda": lam, "run_dir": run_dir, **run}


def last_mean(rows: list[dict], key: str, n: int = 10):
    """Mean of `key` over the last n logged steps (one step's batch holds only a few mismatch
    groups, so a single step's span loss is noisy)."""
    vals = [r[key] for r in rows if r.get(key) is not None][-n:]
    return sum(vals) / len(vals) if vals else None


def diagnostics(rows: list[dict]) -> list[tuple[int, float, float, float]]:
    """(step, cos mismatch, norm ratio, cos control) at every step that logged them; the
    diagnostics of a logged step were computed on the weights before that step's update
    (update count step − 1)."""
    return [(r["step"] - 1, *(r[k] for k in DIAG)) for r in rows if all(k in r for k in DIAG)]


def fmt(v, spec=".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def table(results: list[dict]) -> str:
    lines = ["| λ | held-out acc | span_loss | strict_loss | mismatch groups / batch | "
             "grad_cos_mismatch @ update | grad_norm_ratio @ update | grad_cos_control @ update |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = diagnostics(r["rows"])
        cell = lambda i, spec: " ".join(f"{s}:{v:{spec}}" for s, *vals in d for v in [vals[i]])
        lines.append(f"| {r['lambda']:g} | {fmt(r['accuracy'], '.3f')} | "
                     f"{fmt(last_mean(r['rows'], 'span_loss'))} | "
                     f"{fmt(last_mean(r['rows'], 'strict_loss'))} | "
                     f"{fmt(last_mean(r['rows'], 'mismatch_groups'), '.1f')} | {cell(0, '.3f')} | "
                     f"{cell(1, '.3g')} | {cell(2, '.3f')} |")
    return "\n".join(lines)


def verdict(results: list[dict]) -> str:
    base = [r for r in results if r["lambda"] == 0]
    pos = [r for r in results if r["lambda"] > 0]
    parts = []
    if base and pos and all(r["accuracy"] is not None for r in results):
        below = all(r["accuracy"] < base[0]["accuracy"] for r in pos)
        parts.append(("every λ > 0 scores below λ = 0 on held-out accuracy" if below else
                      "NOT every λ > 0 scores below λ = 0 on held-out accuracy") +
                     " (" + ", ".join(f"λ={r['lambda']:g}: {r['accuracy']:.3f}" for r in results) + ")")
    d = [x for r in results for x in diagnostics(r["rows"])]
    if d:
        import numpy as np
        arr = np.asarray([x[1:] for x in d])
        near0 = float(np.median(np.abs(arr[:, 0])))
        below_ctrl = float(np.mean(arr[:, 0] < arr[:, 2]))
        parts.append(f"median |grad_cos_mismatch| = {near0:.3f} "
                     f"({'near 0' if near0 < 0.2 else 'not near 0'}), below the control cosine at "
                     f"{100 * below_ctrl:.0f}% of the diagnostic points")
        grows = []
        for r in results:
            dd = diagnostics(r["rows"])
            if len(dd) >= 2:
                grows.append(dd[-1][2] > dd[0][2])
        if grows:
            parts.append(f"the norm ratio grows from the first to the last diagnostic step in "
                         f"{sum(grows)} of {len(grows)} runs")
    return "; ".join(parts) + "."


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    lams = [r["lambda"] for r in results]
    ax[0].plot(lams, [r["accuracy"] for r in results], "o-")
    ax[0].set(xlabel="span λ", ylabel="held-out accuracy (greedy)", title="Student after 100 steps")
    for i, (key, title) in enumerate(zip(DIAG, ("cos(g_strict, g_mis)", "‖g_mis‖ / ‖g_strict‖",
                                                 "control cos (strict halves)"))):
        for r in results:
            d = diagnostics(r["rows"])
            ax[i + 1].plot([x[0] for x in d], [x[i + 1] for x in d], "o-", label=f"λ={r['lambda']:g}")
        ax[i + 1].set(xlabel="update (diagnostics before it)", ylabel=key, title=title)
        ax[i + 1].legend()
    ax[1].axhline(0, color="gray", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 0.5, 1.5])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "span_sweep")
    p.add_argument("--set", dest="extra", action="append", default=[])
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    results = [run_one(lam, args.steps, args.out, args.extra) for lam in args.lambdas]
    md = table(results)
    png = ROOT / "benchmarks" / "span_sweep.png"
    plot(results, png)
    text = (f"## Span-loss λ sweep on the CPU demo (SPEC §6)\n\n"
            f"Command: `python benchmarks/span_sweep.py --lambdas {' '.join(f'{x:g}' for x in args.lambdas)} "
            f"--steps {args.steps}` (configs/tiny_cpu.yaml with `algorithm.name=span "
            f"algorithm.span_base=topk_strict algorithm.ctkd_topk=16 algorithm.diagnostics_every=20`; "
            f"held-out accuracy: `python -m ctopd_jax.evaluate --checkpoint <run>/hf_student "
            f"--dataset demo --samples 1 --greedy`). Diagnostics are medians over replay units of "
            f"the default replay set, listed as `update:value`; span_loss, strict_loss (per student "
            f"response token) and mismatch groups per 64-response batch are means over the last 10 "
            f"steps. Plot: benchmarks/span_sweep.png.\n\n{md}\n\n"
            f"Verdict: {verdict(results)}\n")
    print(text)
    if not args.no_append:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
