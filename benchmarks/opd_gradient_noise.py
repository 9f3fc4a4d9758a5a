"""How noisy is the sampled OPD gradient against the exact one on the same responses? (issue 23)

    python benchmarks/opd_gradient_noise.py [--batches 8] [--lr 1e-4] [--top-p 0.95]
        [--opd2-base demo:char_student] [--opd2-temperature 1.0]

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

Also, per objective, the lm_head columns of the "tail": the tokens that appear in no sampled
response or prompt of any batch (characters the task never writes). Their gradient is tiny, but
AdamW divides each entry by its own running RMS, so what sets their step is how consistently its
sign repeats from batch to batch: `sign agreement` is the fraction of tail entries whose sign is
the same in consecutive batches (0.5: random, 1: constant); the same for the
columns of the tokens the batches do write, for contrast.
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


def trainers(out: Path, lr: float, seed: int, opd2_base: str, opd2_temperature: float, top_p: float) -> dict:
    from ctopd_jax.config import load_config
    from ctopd_jax.demo.compare import write_config
    from ctopd_jax.loop.trainer import Trainer

    built = {}
    for name in OBJECTIVES:
        path = write_config(name, out / "configs", pair="char")
        base = ([f"model.teacher_base={opd2_base}", f"algorithm.opd2_temperature={opd2_temperature}"]
                if name == "opd2" else [])   # only opd2 reads them
        built[name] = Trainer(load_config(path, [f"optimizer.lr={lr}", f"seed={seed}", f"output_dir={out / name}",
                                                 f"rollout.top_p={top_p}", *base, "logging.progress=false",
                                                 "logging.tensorboard=false"]))
    return built


def lm_head_of(grads) -> np.ndarray:
    import jax
    (leaf,) = [x for path, x in jax.tree_util.tree_flatten_with_path(grads)[0] if "lm_head" in jax.tree_util.keystr(path)]
    return np.asarray(leaf, np.float64)


def gradients(built: dict, batches: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Per batch, each objective's gradient (one micro-batch of the whole batch) on the
    responses that the first trainer's collector sampled; row["lm_head <objective>"] is its
    [H, V] lm_head part, row["seen"] the token ids in the batch."""
    from ctopd_jax.loop import teacher_batches
    from ctopd_jax.common.metrics import StepTimer
    from ctopd_jax.step.grad import zero_grads

    first = built[OBJECTIVES[0]]
    out = []
    for b in range(batches):
        timer = StepTimer()
        (name, host), = teacher_batches.collect(first.teachers, first.config, first.objective,
                                                first.stream.next_batch(), seed + b, timer, b).items()
        row = {"seen": set(np.unique(host.student.input_ids).tolist())}
        for objective, trainer in built.items():
            _, _, _, grads = trainer.micro_batch(trainer.teachers[name], host, 0, host.size,
                                                 host.tokens(0, host.size), 1, zero_grads(trainer.params),
                                                 timer, None)
            row[objective] = flat(grads)
            row[f"lm_head {objective}"] = lm_head_of(grads)
        out.append(row)
        print(f"[opd_gradient_noise] batch {b}: " + ", ".join(
            f"cos({k}, opd_full) {cos(row[k], row['opd_full']):.3f}, "
            f"|{k}|/|opd_full| {np.linalg.norm(row[k]) / np.linalg.norm(row['opd_full']):.2f}"
            for k in SAMPLED), flush=True)
    return out


def tail_rows(rows: list[dict]) -> dict[str, float]:
    """Sign agreement between consecutive batches of the tail tokens' lm_head gradient, against
    the same for the tokens the batches do write."""
    vocab = rows[0]["lm_head opd"].shape[1]
    tail = np.array(sorted(set(range(vocab)) - set().union(*(r["seen"] for r in rows))))
    used = np.array(sorted(set().union(*(r["seen"] for r in rows))))
    out = {"tail tokens (of the vocabulary)": float(len(tail))}
    for k in OBJECTIVES:
        for name, cols in (("tail", tail), ("written", used)):
            signs = [np.sign(r[f"lm_head {k}"][:, cols]) for r in rows]
            out[f"{k}: {name} sign agreement"] = statistics.median(
                float(np.mean(a == b)) for a, b in zip(signs, signs[1:]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--opd2-base", default="demo:char_teacher_base",
                    help="opd2's model.teacher_base (demo:char_student: the starting student)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the rollouts' top_p (the demo recipes': 0.95)")
    ap.add_argument("--opd2-temperature", type=float, default=0.7,
                    help="opd2's softmax temperature (1.0 with --opd2-base demo:char_student: at the "
                         "starting student opd2's gradient is then 0.1 x vopd's, the responses being "
                         "sampled at temperature 1)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "opd_gradient_noise")
    args = ap.parse_args(argv)
    if args.batches < 2:
        print("--batches must be >= 2 (the exact gradient's batch-to-batch cosine needs two)", file=sys.stderr)
        return 2
    built = trainers(args.out, args.lr, args.seed, args.opd2_base, args.opd2_temperature, args.top_p)
    rows = gradients(built, args.batches, args.seed)
    summary = {f"cos({k}, opd_full) same responses": statistics.median([cos(r[k], r["opd_full"]) for r in rows])
               for k in SAMPLED}
    summary.update({f"|{k}| / |opd_full|": statistics.median([np.linalg.norm(r[k]) / np.linalg.norm(r["opd_full"])
                                                   for r in rows]) for k in SAMPLED})
    summary.update({f"cos({k}, {k} of the next batch)": statistics.median([cos(a[k], b[k]) for a, b in zip(rows, rows[1:])])
                    for k in OBJECTIVES})
    summary["cos(opd2, vopd) same responses"] = statistics.median(cos(r["opd2"], r["vopd"]) for r in rows)
    summary["|opd2| / |vopd|"] = statistics.median(np.linalg.norm(r["opd2"]) / np.linalg.norm(r["vopd"]) for r in rows)
    summary.update(tail_rows(rows))
    mean_opd = np.mean([r["opd"] for r in rows], axis=0)
    mean_full = np.mean([r["opd_full"] for r in rows], axis=0)
    summary[f"cos(mean of {len(rows)} opd, mean of {len(rows)} opd_full)"] = cos(mean_opd, mean_full)
    print("| measure (median over batches) | value |\n|---|---|")
    for k, v in summary.items():
        print(f"| {k} | {v:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
