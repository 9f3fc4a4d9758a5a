"""`python -m ctopd_jax.plot RUN_DIR`: PNG curves from a run's metrics.jsonl.

Writes `<RUN_DIR>/plots/<group>.png` for the groups below (a group is skipped when the run
logged none of its keys) and prints the paths.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ctopd_jax.metrics import read_metrics

GROUPS = {
    "loss": ("loss", "kd_loss", "ce_loss"),
    "coverage": ("coverage_student", "coverage_teacher", "coverage_student_cum", "coverage_teacher_cum"),
    "lr": ("lr",),
    "grad_norm": ("grad_norm",),
    "logprob_gap": ("logprob_gap",),
    "response_length": ("response_length",),
    "byte_mismatch": ("byte_mismatch_samples",),
    "time": ("time_rollout", "time_align", "time_teacher", "time_student", "time_sync", "time_checkpoint"),
    "throughput": ("tokens_per_s",),
    "eval": ("eval_mean_at_k", "eval_pass_at_k"),
}


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, keys in GROUPS.items():
        series = {k: [(r["step"], r[k]) for r in records if k in r] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="." if len(points) < 50 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(group)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{group}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir):
        print(path)


if __name__ == "__main__":
    main()
