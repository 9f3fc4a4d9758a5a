"""How noisy is the sampled OPD gradient against the exact one on the same responses? (issue 23)

    python benchmarks/opd_gradient_noise.py [--batches 8] [--lr 1e-4]

On the character pair (configs/tiny_cpu_same.yaml, the starting student), each of `--batches`
rollout batches (64 responses, sampled once by the student) gives the first optimizer step's
gradient of three objectives on the SAME responses:

- opd (sampled, tinker's estimator): −Σ_t g_t ∇log π_θ(y_t), g_t = log π_T(y_t) − log π_θ(y_t);
- vopd: the same with the value baseline −KL_t (A_t = g_t + KL_t), which changes its variance only;
- opd2: OPD²'s gated delta advantage (its base: model.teacher_base, `--opd2-base`), whose
  expectation is not opd_full's: its cosine says how much of its step points where the reverse
  KL descends;
- opd_full: Σ_t ∇KL_t(π_θ ‖ π_T) over the whole vocabulary, the sampled estimator's expectation
  over each position's token (SPEC §9).

Printed per batch and as medians: cos(g, g_full) and ‖g‖ / ‖g_full‖ of each sampled objective,
and each objective's cos(g of this batch, g of the next batch); opd_full's is the scale of "the
same signal". When the sampled
gradient's cosine to the exact one on the same responses is far below the exact gradient's own
batch-to-batch cosine, a step of the sampled estimator is mostly noise at that batch size.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OBJECTIVES = ("opd", "vopd", "opd2", "opd_full")
SAMPLED = OBJECTIVES[:-1]


def flat(grads) -> np.ndarray:
    import jax
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(grads)])


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def trainers(out: Path, lr: float, seed: int, opd2_base: str) -> dict:
    from ctopd_jax.config import load_config
    from ctopd_jax.demo.compare import write_config
    from ctopd_jax.trainer import Trainer

    built = {}
    for name in OBJECTIVES:
        path = write_config(name, out / "configs", pair="char")
        base = [f"model.teacher_base={opd2_base}"] if name == "opd2" else []   # only opd2 reads one
        built[name] = Trainer(load_config(path, [f"optimizer.lr={lr}", f"seed={seed}", f"output_dir={out / name}",
                                                 *base, "logging.progress=false", "logging.tensorboard=false"]))
    return built


def gradients(built: dict, batches: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Per batch, each objective's gradient (one micro-batch of the whole batch) on the
    responses that the first trainer's collector sampled."""
    from ctopd_jax import teacher_batches
    from ctopd_jax.metrics import StepTimer
    from ctopd_jax.step.grad import zero_grads

    first = built[OBJECTIVES[0]]
    out = []
    for b in range(batches):
        timer = StepTimer()
        (name, host), = teacher_batches.collect(first.teachers, first.config, first.objective,
                                                first.stream.next_batch(), seed + b, timer, b).items()
        row = {}
        for objective, trainer in built.items():
            _, _, _, grads = trainer.micro_batch(trainer.teachers[name], host, 0, host.size,
                                                 host.tokens(0, host.size), 1, zero_grads(trainer.params),
                                                 timer, None)
            row[objective] = flat(grads)
        out.append(row)
        print(f"[opd_gradient_noise] batch {b}: " + ", ".join(
            f"cos({k}, opd_full) {cos(row[k], row['opd_full']):.3f}, "
            f"|{k}|/|opd_full| {np.linalg.norm(row[k]) / np.linalg.norm(row['opd_full']):.2f}"
            for k in SAMPLED), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--opd2-base", default="demo:char_teacher_base",
                    help="opd2's model.teacher_base (demo:char_student: the starting student)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "opd_gradient_noise")
    args = ap.parse_args(argv)
    if args.batches < 2:
        print("--batches must be >= 2 (the exact gradient's batch-to-batch cosine needs two)", file=sys.stderr)
        return 2
    rows = gradients(trainers(args.out, args.lr, args.seed, args.opd2_base), args.batches, args.seed)
    summary = {f"cos({k}, opd_full) same responses": statistics.median([cos(r[k], r["opd_full"]) for r in rows])
               for k in SAMPLED}
    summary.update({f"|{k}| / |opd_full|": statistics.median([np.linalg.norm(r[k]) / np.linalg.norm(r["opd_full"])
                                                   for r in rows]) for k in SAMPLED})
    summary.update({f"cos({k}, {k} of the next batch)": statistics.median([cos(a[k], b[k]) for a, b in zip(rows, rows[1:])])
                    for k in OBJECTIVES})
    mean_opd = np.mean([r["opd"] for r in rows], axis=0)
    mean_full = np.mean([r["opd_full"] for r in rows], axis=0)
    summary[f"cos(mean of {len(rows)} opd, mean of {len(rows)} opd_full)"] = cos(mean_opd, mean_full)
    print("| measure (median over batches) | value |\n|---|---|")
    for k, v in summary.items():
        print(f"| {k} | {v:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
