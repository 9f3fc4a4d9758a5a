"""Where does a same-tokenizer OPD run's student put its probability? (issue 23)

    python benchmarks/tail_mass.py RUN_DIR [RUN_DIR ...]

For the character pair's starting student and the final checkpoint of each run directory
(benchmarks/recipe_sweep.py writes them under runs/recipe_sweep/runs/<objective>/<run-id>), on
the held-out problems' reference solutions (teacher-forced, every response position and the EOS):

- `tail mass`: the mean probability of the "tail", the vocabulary entries that occur in no
  prompt and no reference solution of the task (characters it never writes);
- `entropy`: the mean next-token entropy, nats;
- `early EOS`: the mean probability of EOS at the positions before the last (where it ends the
  answer too soon);
- rows for the teacher, whose label smoothing (0.02 of each target's mass spread over the
  vocabulary) sets what the reverse KL asks the tail to hold, and for the starting student.

Why it matters: the sampled OPD advantage averages −KL_t, and the exact reverse-KL gradient pulls
the tail up to the teacher's smoothing floor; on the never-written tokens' lm_head columns both
keep one sign batch after batch (benchmarks/opd_gradient_noise.py), so AdamW moves them at full
step size however small their gradient is.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def restored_student(run_dir: Path):
    """The student of `run_dir`'s latest checkpoint."""
    from ctopd_jax.loop.checkpoint import Checkpointer
    from ctopd_jax.config import from_dict
    from ctopd_jax.loop.trainer import Trainer

    tree = json.loads((run_dir / "config.json").read_text())
    tree["output_dir"] = str(run_dir)      # nothing is written: the trainer only restores
    trainer = Trainer(from_dict(tree))
    checkpointer = Checkpointer(run_dir / "checkpoints", every=0, keep=100, async_save=False)
    step = trainer._resume(checkpointer)      # what `train(resume=True)` does before its first step
    checkpointer.close()
    if not step:
        raise SystemExit(f"{run_dir}: no checkpoint to restore; give a run directory that holds checkpoints/")
    return trainer.student


def stats(model, side, problems) -> dict[str, float]:
    from ctopd_jax.demo.pretrain import response_logprob_rows

    prompts = [side.render_prompt(p.prompt) for p in problems]
    solutions = [p.solution for p in problems]
    rows = response_logprob_rows(model, side, prompts, solutions)      # [response tokens + EOS, V] each
    written = set()
    for text in prompts + solutions:
        written.update(side.encode(text))
    written.add(side.eos_id)
    tail = np.array(sorted(set(range(rows[0].shape[1])) - written))
    probs = [np.exp(r) for r in rows]
    return {"tail mass": float(np.mean(np.concatenate([p[:, tail].sum(-1) for p in probs]))),
            "entropy": float(np.mean(np.concatenate([-(p * r).sum(-1) for p, r in zip(probs, rows)]))),
            "early EOS": float(np.mean(np.concatenate([p[:-1, side.eos_id] for p in probs]))),
            "tail tokens": float(len(tail))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--problems", type=int, default=100, help="held-out problems (the first n)")
    args = ap.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "config.json").is_file()]
    if missing:
        print(f"not a run directory (no config.json): {missing[0]}; give runs/recipe_sweep/runs/<objective>/<run-id>",
              file=sys.stderr)
        return 2
    from ctopd_jax.demo import task
    from ctopd_jax.models.weights import load_hf_checkpoint
    from ctopd_jax.tokenization import load_tokenizer_side

    side = load_tokenizer_side("char")
    problems = task.split("held_out")[:args.problems]
    assets = ROOT / "ctopd_jax" / "assets" / "demo_char"
    models = {"teacher": load_hf_checkpoint(assets / "teacher")[0],
              "starting student": load_hf_checkpoint(assets / "student")[0]}
    print("| model | tail mass | entropy (nats) | early EOS |\n|---|---|---|---|")
    for name, model in models.items():
        s = stats(model, side, problems)
        print(f"| {name} | {s['tail mass']:.2e} | {s['entropy']:.3f} | {s['early EOS']:.2e} |", flush=True)
    for run in args.runs:
        s = stats(restored_student(run), side, problems)
        print(f"| {run.parent.name} {run.name} | {s['tail mass']:.2e} | {s['entropy']:.3f} | {s['early EOS']:.2e} |",
              flush=True)
    print(f"(tail: {int(s['tail tokens'])} of the vocabulary's entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
