"""`python -m ctopd_jax.plot RUN_DIR`: PNG curves from a run's metrics.jsonl.

Writes `<RUN_DIR>/plots/<group>.png` for the groups below (a group is skipped when the run
logged none of its keys) and prints the paths. Every axis is labelled; series of one group are
drawn with distinct line styles and widths (the first widest, underneath), so a series that
equals another (`loss` == `kd_loss` when kd_ratio is 1) stays visible; every `*_loss` key the
objective logs joins the loss plot, and a plot whose positive values span more than 100x uses a
log scale. The trainer calls
`plot_after_training(run_dir)` at the end of a run; it never fails the run.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

from ctopd_jax.common.cli import Parser, run
from ctopd_jax.common.metrics import MetricsError, read_metrics


# group -> (series keys, y-axis label)
GROUPS = {
    "loss": (("loss", "kd_loss", "ce_loss"), "loss (per student response token)"),
    "coverage": (("coverage_student", "coverage_teacher", "coverage_student_cum",
                  "coverage_teacher_cum"), "strict coverage (fraction of tokens)"),
    "lr": (("lr",), "learning rate"),
    "grad_norm": (("grad_norm",), "gradient norm (before clipping)"),
    "logprob_gap": (("logprob_gap",), "log-prob gap (rollout vs trainer)"),
    "response_length": (("response_length",), "student tokens per response"),
    "byte_mismatch": (("byte_mismatch_samples",), "byte-mismatched samples"),
    "time": (("time_rollout", "time_align", "time_prepare", "time_teacher", "time_student", "time_sync",
              "time_checkpoint", "time_eval", "time_diagnostics", "time_other"), "seconds per step"),
    "throughput": (("tokens_per_s",), "student tokens per second"),
    "memory": (("peak_device_memory_bytes",), "peak device memory (bytes)"),
    "eval": (("eval_mean_at_k", "eval_pass_at_k"), "accuracy"),
    # gradient diagnostics (SPEC §6), logged only at the diagnostic steps
    "grad_diagnostics": (("grad_cos_mismatch", "grad_cos_control", "grad_norm_ratio"),
                         "median over replay units (cosine; norm ratio)"),
    "mismatch": (("mismatch_token_fraction",), "student tokens in mismatch groups (fraction)"),
}
STYLES = ("-", "--", ":", "-.")


class PlotError(MetricsError):
    """Nothing to plot (empty log); the message names the file."""


def plot_run(run_dir: str | Path) -> list[Path]:
    """Draw every group with data; returns the PNG paths. Raises MetricsError / PlotError."""
    records = read_metrics(run_dir)
    if not records:
        raise PlotError(f"{Path(run_dir) / 'metrics.jsonl'}: the log has no rows yet; plot "
                        "after the run has logged a step")
    import matplotlib   # heavy: imported only when a plot is drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # (as above)

    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    from matplotlib.ticker import MaxNLocator   # (as above)

    # objectives log their own named sums (strict_loss, span_loss, ...): they join the loss plot
    named = sorted({k for r in records for k in r if k.endswith("_loss")} - set(GROUPS["loss"][0]))
    groups = dict(GROUPS, loss=(GROUPS["loss"][0] + tuple(named), GROUPS["loss"][1]))
    for group, (keys, ylabel) in groups.items():
        series = {k: [(r["step"], r[k]) for r in records if k in r] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        count = len(series)
        for i, (key, points) in enumerate(series.items()):
            steps, values = zip(*points)
            ax.plot(steps, values, linestyle=STYLES[i % len(STYLES)],
                    linewidth=1.2 + 1.2 * (count - 1 - i), zorder=2 + i,
                    marker="." if len(points) < 50 else None, label=key)
        values = [v for points in series.values() for _, v in points if isinstance(v, (int, float))]
        positive = [v for v in values if v > 0]
        if len(positive) == len(values) and positive and max(positive) > 100 * min(positive):
            ax.set_yscale("log")    # e.g. an untrained CE beside a small KD loss
            ylabel += ", log scale"
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(group)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{group}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def plot_after_training(run_dir: str | Path) -> list[Path]:
    """For the end of a run: draw the plots, or warn (never raise) when they cannot be drawn."""
    try:
        return plot_run(run_dir)
    except Exception as err:  # a plot must never fail a finished run
        warnings.warn(f"plots of {run_dir} not drawn: {err}", RuntimeWarning, stacklevel=2)
        return []


def _main(argv: list[str]) -> int:
    parser = Parser(prog="python -m ctopd_jax.plot", description=__doc__)
    parser.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir):
        print(path)
    return 0


def main(argv=None) -> int:
    return run(_main, argv, "python -m ctopd_jax.plot")


if __name__ == "__main__":
    sys.exit(main())
