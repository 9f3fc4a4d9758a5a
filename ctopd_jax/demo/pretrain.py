"""Pretrain the demo's tiny teacher and student by plain SFT on the synthetic task.

    python -m ctopd_jax.demo.pretrain                 # both, into ctopd_jax/assets/demo/
    python -m ctopd_jax.demo.pretrain --role student --out /tmp/x --eval-every 100
    python -m ctopd_jax.demo.pretrain --pair char     # the same-tokenizer pair, assets/demo_char/
    python -m ctopd_jax.demo.pretrain --pair char_tools   # tool-use char pair, assets/demo_char_tools/

The committed checkpoints under ``ctopd_jax/assets/demo/{teacher,student}`` are exactly what
this command writes (fixed seeds; float32 on CPU). Each directory holds ``config.json`` +
``model.safetensors`` (what ``models.load_hf_checkpoint`` and transformers read), the side's
tokenizer files, and ``pretrain.json`` recording the recipe and the held-out accuracy.
Measured: a rerun of ``--role student`` reproduced the committed model.safetensors byte for byte
(61 s on the 2-core CPU); the teacher's 400 steps take ~5 min there when the machine is idle.

Recipe decisions (SPEC is silent; this is demo scaffolding, not the method under test):
- Teacher: Qwen2 architecture (q/k/v bias, tied embeddings) over ``tiny_bpe``; trained long
  enough to solve the held-out set almost perfectly.
- Student: Llama architecture over ``tiny_unigram`` (a different tokenizer kind), smaller, and
  trained on the SAME data for far fewer steps. It therefore already writes well-formed
  responses (so on-policy samples align well with the teacher and the grader can read them)
  but still gets many single-digit facts wrong: a gap that on-policy distillation can close.
- Sequences are tokenized exactly as the trainer re-tokenizes samples (``retokenize``: the
  side's chat template with no system prompt, ``tok(prompt + response) + [eos]``), and the loss
  is token-mean cross-entropy over the response tokens and the EOS. Batches are padded to a
  fixed length so one program is compiled.
- Optimizer: the trainer's AdamW (``ctopd_jax.step.optimizer``; SPEC §1 betas, clipping, cosine
  with min lr and warmup) with a demo-sized learning rate.

``--pair char_tools`` (the tool-use task, ``tools_task.py``): the char pair's architectures and
vocabulary, trained on the two-turn transcripts laid out exactly as the multi-turn rollout lays
them out (``tools_sft_batch``): chat prompt, turn 1 (``<calc>A*B</calc>``), the observation
(``<result>N</result>``), turn 2 (``The answer is N.``) and the EOS, each part encoded on its own;
the loss covers turn 1, turn 2 and the EOS only (prompt and observation masked). Held-out
accuracy runs the tool loop (``tools_rollout``): greedy turn 1 cut after ``</calc>``, the true
result of what the model wrote computed by ``tools_task.calculate``, greedy turn 2 until the EOS.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.common.cli import Parser, at_least
from ctopd_jax.config import OptimizerSection
from ctopd_jax.data.eval_sets import load_dataset
from ctopd_jax.demo import task, tools_task
from ctopd_jax.demo.data import ASSET_DIR
from ctopd_jax.demo.pretrain_tools import TOOLS_SEQ_LEN, tools_held_out_metrics, tools_sft_batch
from ctopd_jax.loop.mean_at_k import evaluate_model
from ctopd_jax.models import Decoder, ModelConfig, tiny_llama, tiny_qwen2
from ctopd_jax.models.weights import export_hf_checkpoint, load_hf_checkpoint
from ctopd_jax.rollout import SamplingParams, make_rollout_engine
from ctopd_jax.step.optimizer import make_optimizer
from ctopd_jax.tokenization import IGNORE_INDEX, TokenizerSide, load_tokenizer_side, retokenize

SEQ_LEN = 64            # every demo sequence (prompt + response + EOS) fits on both sides
MAX_NEW_TOKENS = 48     # responses are ~24-28 tokens; leaves room for rambling samples


@dataclasses.dataclass(frozen=True)
class PretrainSpec:
    role: str
    tokenizer: str
    make_config: Callable[[int], ModelConfig]   # vocab size -> config
    steps: int
    batch_size: int
    lr: float
    seed: int
    schedule: str = "cosine_with_min_lr"
    warmup_ratio: float = 0.05
    label_smoothing: float = 0.0   # share of each target's mass spread uniformly over the vocabulary


def teacher_config(vocab_size: int) -> ModelConfig:
    return tiny_qwen2(vocab_size=vocab_size, hidden_size=128, intermediate_size=384,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=256)


def student_config(vocab_size: int) -> ModelConfig:
    return tiny_llama(vocab_size=vocab_size, hidden_size=128, intermediate_size=384,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=256)


CHAR_ASSET_DIR = ASSET_DIR.parent / "demo_char"
CHAR_BASE_STEPS = 60    # the char teacher's "pre-tuning base" (OPD²): its own first 60 steps


def tools_student_config(vocab_size: int) -> ModelConfig:
    """The tool pair's student: a narrower Llama (hidden 64)."""
    return tiny_llama(vocab_size=vocab_size, hidden_size=64, intermediate_size=192,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                      max_position_embeddings=256)


# The same-tokenizer pair (`--pair char`): both sides use the repository's character vocabulary
# (tokenization/char_vocab.py). The teacher_base checkpoint is a snapshot of the teacher's own
# run after CHAR_BASE_STEPS steps (its "pre-tuning base"); 300 constant-lr steps reached only
# 25% held-out accuracy, hence 600 steps with the cosine schedule (held-out 0.385 / 0.95 / 1.0 at
# steps 200 / 300 / 400).
# Distillable (issue 23): the teacher is trained with label smoothing 0.02, so it is accurate
# (greedy held-out 1.0) but never certain. Without it the teacher reached SFT loss 1e-4 and, after
# the student's first sampled mistake, put 0.996 on one token (entropy 0.012 nats): confidently
# arbitrary where on-policy distillation reads it. With it: 0.972 / 0.226 nats there (0.189 nats
# on reference solutions: mostly the smoothing floor), recorded in teacher/pretrain.json
# ("on_student_errors", `record_teacher_entropy`). The student has the cross pair's student
# architecture (hidden 128; the old 64-wide student was still at SFT loss 0.46 and 0.185 after
# 80 steps: it had not learned to copy the operands yet, so no per-token signal could teach it
# the digits in 100 iterations) and 100 constant-lr steps: loss 0.10, held-out 0.32 (measured on
# one curve of this recipe: 0.14 / 0.32 / 0.54 / 0.90 at steps 80 / 100 / 120 / 140, so it can
# learn the task) - the same place as the cross student (0.395, loss 0.11).
CHAR_SPECS = {
    "teacher": PretrainSpec("teacher", "char", teacher_config, steps=600, batch_size=64,
                            lr=3e-3, seed=11, label_smoothing=0.02),
    "student": PretrainSpec("student", "char", student_config, steps=100, batch_size=64,
                            lr=3e-3, seed=12, schedule="constant"),
}

CHAR_TOOLS_ASSET_DIR = ASSET_DIR.parent / "demo_char_tools"

# The tool-use character pair (`--pair char_tools`): the char pair's teacher config, vocabulary
# and lr, with a narrower student (hidden 64, the char pair's student before issue 23) and no
# label smoothing. Not rebuilt with the char pair's issue-23 recipe: its student already writes
# the format (tool call made 0.99, loss 0.13) and the recipe sweep found it can be taught at a
# small lr (benchmarks/RESULTS.md, "Recipes per objective"). Both models first learn the format with the wrong operands and results (loss ~0.45),
# then learn to copy them within a few dozen steps. Teacher: 400 cosine steps (measured held-out
# 0.945 at step 300 of that run, 1.0 at 400; a 300-step cosine run was still at 0.015 at step
# 250, and constant lr had not started copying by step 150). Student: constant lr, whose copy
# emerges between steps 120 (0.045) and 130; measured held-out at steps 123..130: 0.11, 0.125,
# 0.175, 0.17, 0.33, 0.315, 0.6, 0.445; 128 steps it is (format right, copies often wrong).
# Measured on the shared 2-core CPU: teacher 344 s (with 4 evaluations) at a light load, 537 s
# and 10.4 min for both roles at load average ~6; the student's 128 steps take ~40-60 s.
CHAR_TOOLS_SPECS = {
    "teacher": PretrainSpec("teacher", "char", teacher_config, steps=400, batch_size=64,
                            lr=3e-3, seed=21),
    "student": PretrainSpec("student", "char", tools_student_config, steps=128, batch_size=64,
                            lr=3e-3, seed=22, schedule="constant"),
}

SPECS = {
    "teacher": PretrainSpec("teacher", "tiny_bpe", teacher_config, steps=400, batch_size=64,
                            lr=3e-3, seed=1),
    # constant lr: the first N steps of a longer run are exactly the N-step recipe, so the
    # student's strength can be chosen from one curve (--eval-every) and reproduced.
    "student": PretrainSpec("student", "tiny_unigram", student_config, steps=100, batch_size=64,
                            lr=3e-3, seed=2, schedule="constant"),
}


def sft_batch(side: TokenizerSide, problems: list[task.Problem]):
    """(input_ids, labels, attention_mask) numpy arrays of one SFT batch, [B, SEQ_LEN]."""
    prompts = [side.render_prompt(p.prompt) for p in problems]
    batch = retokenize(side, prompts, [p.solution for p in problems], max_length=SEQ_LEN)
    pad = SEQ_LEN - batch.seq_len
    ids = np.pad(batch.input_ids, ((0, 0), (0, pad)), constant_values=side.pad_id)
    labels = np.pad(batch.labels, ((0, 0), (0, pad)), constant_values=IGNORE_INDEX)
    mask = np.pad(batch.attention_mask, ((0, 0), (0, pad)), constant_values=False)
    return ids, labels, mask


def response_logprob_rows(model: Decoder, side: TokenizerSide, prompts: list[str], responses: list[str]):
    """Per sample, the model's next-token log-probs [response tokens + EOS, V] (teacher-forced)."""
    batch = retokenize(side, prompts, responses)
    positions = jnp.broadcast_to(jnp.arange(batch.seq_len, dtype=jnp.int32), batch.input_ids.shape)
    logits = model(jnp.asarray(batch.input_ids), positions, jnp.asarray(batch.attention_mask))
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    supervised = batch.labels != IGNORE_INDEX
    return [logp[b][supervised[b]] for b in range(len(prompts))]


def teacher_entropy_after_student_errors(teacher: Decoder, student: Decoder, side: TokenizerSide,
                                         problems: list[task.Problem], seed: int = 0) -> dict:
    """How the teacher behaves where on-policy distillation asks it to: after the student's own
    mistakes. The student samples one response per problem at temperature 1 (as the trainer's
    rollouts do); in each wrong response, the teacher's next-token entropy (nats) and top-1
    probability are averaged over the positions whose prefix already holds the first character
    that departs from the reference solution (the char pair: one token per character). The
    same on the reference solutions, for contrast. A near-deterministic teacher (entropy ~0 after
    an error) is confidently arbitrary there; on-policy signal then pushes the student to it."""
    engine = make_rollout_engine("jax", student, [side.eos_id], side.pad_id)
    prompts = [side.render_prompt(p.prompt) for p in problems]
    sampled = engine.generate([side.encode(p) for p in prompts],
                              SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=seed))
    responses = [side.decode(t) for t in sampled.token_ids]
    wrong = [(p, r, q.solution) for p, r, q in zip(prompts, responses, problems)
             if not task.grade(r, q.answer)]
    def stats(rows):
        rows = np.concatenate(rows) if rows else np.zeros((0, 1))
        probs = np.exp(rows)
        return (float(-(probs * rows).sum(-1).mean()) if len(rows) else None,
                float(probs.max(-1).mean()) if len(rows) else None, len(rows))
    after_error = []
    if wrong:
        teacher_rows = response_logprob_rows(teacher, side, [w[0] for w in wrong], [w[1] for w in wrong])
        for (_, r, ref), rows in zip(wrong, teacher_rows):
            first = next((i for i, (a, b) in enumerate(zip(r, ref)) if a != b), min(len(r), len(ref)))
            after_error.append(rows[first + 1:])   # row i predicts token i: prefixes holding token `first`
    reference = response_logprob_rows(teacher, side, prompts, [q.solution for q in problems])
    h_err, top1_err, n_err = stats(after_error)
    h_ref, top1_ref, _ = stats(reference)
    return {"student_sampled_accuracy": 1 - len(wrong) / len(problems),
            "teacher_entropy_after_student_error_nats": h_err,
            "teacher_top1_after_student_error": top1_err, "positions_after_student_error": n_err,
            "teacher_entropy_on_reference_nats": h_ref, "teacher_top1_on_reference": top1_ref}


def sft_loss(model: Decoder, input_ids, labels, attention_mask, label_smoothing=0.0):
    """Token-mean cross-entropy over the supervised (response + EOS) rows, against targets with
    ``label_smoothing`` of their mass spread uniformly over the vocabulary (0: one-hot)."""
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    logits = model(input_ids, positions, attention_mask)
    supervised = labels != IGNORE_INDEX
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.where(supervised, labels, 0)[..., None], axis=-1)[..., 0]
    ce = (1.0 - label_smoothing) * nll - label_smoothing * jnp.mean(logp, axis=-1)
    return jnp.sum(ce * supervised) / jnp.maximum(1, jnp.sum(supervised))


@nnx.jit(static_argnames="label_smoothing")
def _train_step(model, optimizer, input_ids, labels, attention_mask, label_smoothing=0.0):
    loss, grads = nnx.value_and_grad(sft_loss)(model, input_ids, labels, attention_mask,
                                                label_smoothing)
    optimizer.update(model, grads)
    return loss


def held_out_accuracy(model: Decoder, side: TokenizerSide, out_dir: Path | None = None) -> float:
    """Greedy accuracy on the held-out split, graded by the task grader (via evaluate_model)."""
    report = evaluate_model(model, side, load_dataset("demo"), greedy=True,
                            max_new_tokens=MAX_NEW_TOKENS, out_dir=out_dir)
    return report.mean_at_k


def train(spec: PretrainSpec, steps: int | None = None, eval_every: int = 0, log=print,
          snapshot: tuple[int, Callable] | None = None, pair: str = "cross"):
    """SFT ``spec`` from its seed; returns (model, side, history). ``snapshot = (n, fn)`` calls
    ``fn(model, side, history)`` after step n (the char teacher's base). ``pair="char_tools"``
    trains on the tool-use transcripts and evaluates through the tool loop."""
    steps = steps or spec.steps
    side = load_tokenizer_side(spec.tokenizer)
    cfg = spec.make_config(side.vocab_size)
    model = Decoder(cfg, rngs=nnx.Rngs(spec.seed))
    tx, _ = make_optimizer(OptimizerSection(lr=spec.lr, schedule=spec.schedule,
                                            warmup_ratio=spec.warmup_ratio, min_lr=spec.lr / 10,
                                            weight_decay=0.0), steps)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    tools = pair == "char_tools"
    train_problems = (tools_task if tools else task).split("train")
    make_batch = tools_sft_batch if tools else sft_batch
    evaluate = ((lambda m, s: tools_held_out_metrics(m, s)["held_out_accuracy"]) if tools
                else held_out_accuracy)
    rng = np.random.default_rng(spec.seed)
    history, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        batch = make_batch(side, task.sample(train_problems, spec.batch_size, rng))
        loss = float(_train_step(model, optimizer, *map(jnp.asarray, batch),
                                 label_smoothing=spec.label_smoothing))
        row = {"step": step, "loss": loss, "time_s": round(time.perf_counter() - start, 1)}
        if eval_every and (step % eval_every == 0 or step == steps):
            row["held_out_accuracy"] = evaluate(model, side)
        if step % 10 == 0 or "held_out_accuracy" in row or step == steps:
            log(f"[{spec.role}] " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                              f"{k}={v}" for k, v in row.items()))
        history.append(row)
        if snapshot is not None and step == snapshot[0]:
            snapshot[1](model, side, list(history))
    return model, side, history


def save(model: Decoder, side: TokenizerSide, out_dir: Path, meta: dict) -> Path:
    """HF checkpoint + the side's tokenizer files + pretrain.json."""
    extra = {"eos_token_id": side.eos_id, "pad_token_id": side.pad_id}
    if side.bos_id is not None:
        extra["bos_token_id"] = side.bos_id
    export_hf_checkpoint(model, model.cfg, out_dir, extra_config=extra)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(side.path / name, out_dir / name)
    (out_dir / "pretrain.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out_dir


def pretrain(role: str, out_root: Path, steps: int | None = None, eval_every: int = 0,
             log=print, pair: str = "cross") -> dict:
    spec = {"char": CHAR_SPECS, "char_tools": CHAR_TOOLS_SPECS}.get(pair, SPECS)[role]
    command = "python -m ctopd_jax.demo.pretrain --role " + role + (
        f" --pair {pair}" if pair != "cross" else "")
    start = time.perf_counter()
    snapshot = None
    if pair == "char" and role == "teacher":
        def save_base(model, side, history):
            acc = held_out_accuracy(model, side)
            save(model, side, out_root / "teacher_base",
                 {"role": "teacher_base", "tokenizer": spec.tokenizer, "family": model.cfg.family,
                  "steps": CHAR_BASE_STEPS, "batch_size": spec.batch_size, "lr": spec.lr,
                  "seed": spec.seed, "final_loss": history[-1]["loss"], "held_out_accuracy": acc,
                  "snapshot_of": "teacher", "command": command})
            log(f"[teacher_base] held-out accuracy {acc:.3f} after {CHAR_BASE_STEPS} steps")
        snapshot = (CHAR_BASE_STEPS, save_base)
    model, side, history = train(spec, steps, eval_every, log, snapshot=snapshot, pair=pair)
    train_s = time.perf_counter() - start
    extra = {}
    if pair == "char_tools":
        extra = tools_held_out_metrics(model, side)
        accuracy = extra.pop("held_out_accuracy")
        extra = {"task": "demo tools_task (tool loop simulated, greedy)", "schedule": spec.schedule,
                 "seq_len": TOOLS_SEQ_LEN, **extra}
    else:
        accuracy = held_out_accuracy(model, side)
    meta = {"role": role, "tokenizer": spec.tokenizer, "family": model.cfg.family,
            "steps": steps or spec.steps, "batch_size": spec.batch_size, "lr": spec.lr,
            "seed": spec.seed, "final_loss": history[-1]["loss"],
            "held_out_accuracy": accuracy, "train_seconds": round(train_s, 1),
            "command": command, **extra}
    if spec.label_smoothing:
        meta["label_smoothing"] = spec.label_smoothing
    save(model, side, out_root / role, meta)
    log(f"[{role}] held-out accuracy {accuracy:.3f} after {meta['steps']} steps "
        f"({train_s:.0f} s) -> {out_root / role}")
    return meta


PROG = "python -m ctopd_jax.demo.pretrain"


def main(argv=None) -> list[dict]:
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=sorted(SPECS), nargs="*", default=["teacher", "student"])
    parser.add_argument("--pair", choices=("cross", "char", "char_tools"), default="cross",
                        help="cross: the tiny_bpe/tiny_unigram pair (assets/demo); char: the "
                             "same-tokenizer character pair (assets/demo_char, teacher_base too); "
                             "char_tools: the character pair on the tool-use task "
                             "(assets/demo_char_tools)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: ctopd_jax/assets/demo (cross), assets/demo_char (char) or "
                             "assets/demo_char_tools (char_tools)")
    parser.add_argument("--steps", type=at_least(1), default=None, help="override the recipe's steps")
    parser.add_argument("--eval-every", type=at_least(0), default=0,
                        help="also report held-out accuracy every N steps (for tuning)")
    args = parser.parse_args(argv)
    out = args.out or {"char": CHAR_ASSET_DIR, "char_tools": CHAR_TOOLS_ASSET_DIR}.get(
        args.pair, ASSET_DIR)
    metas = [pretrain(r, out, args.steps, args.eval_every, pair=args.pair) for r in args.role]
    if args.pair == "char" and all((out / r / "config.json").is_file() for r in SPECS):
        record_teacher_entropy(out)
    return metas


def record_teacher_entropy(out_root: Path, log=print) -> dict:
    """Measure the char pair's teacher after its student's sampled errors (on the held-out
    prompts, seed 0) and record it in the teacher's pretrain.json."""
    teacher, _ = load_hf_checkpoint(out_root / "teacher")
    student, _ = load_hf_checkpoint(out_root / "student")
    found = teacher_entropy_after_student_errors(teacher, student, load_tokenizer_side("char"),
                                                 task.split("held_out"))
    path = out_root / "teacher" / "pretrain.json"
    meta = json.loads(path.read_text())
    meta["on_student_errors"] = found
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    log(f"[teacher] after the student's sampled errors: entropy "
        f"{found['teacher_entropy_after_student_error_nats']:.3f} nats, top-1 "
        f"{found['teacher_top1_after_student_error']:.3f} (on reference solutions "
        f"{found['teacher_entropy_on_reference_nats']:.3f} nats)")
    return found


if __name__ == "__main__":
    from ctopd_jax.common.cli import run

    sys.exit(run(lambda argv: 0 if main(argv) else 1, None, PROG))
