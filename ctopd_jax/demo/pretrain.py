"""Pretrain the demo's tiny teacher and student by plain SFT on the synthetic task.

    python -m ctopd_jax.demo.pretrain                 # both, into ctopd_jax/assets/demo/
    python -m ctopd_jax.demo.pretrain --role student --out /tmp/x --eval-every 100
    python -m ctopd_jax.demo.pretrain --pair char     # the same-tokenizer pair, assets/demo_char/

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
- Optimizer: the trainer's AdamW (``ctopd_jax.optimizer``; SPEC §1 betas, clipping, cosine
  with min lr and warmup) with a demo-sized learning rate.
"""
from __future__ import annotations

import argparse
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
import optax
from flax import nnx

from ctopd_jax.demo import task
from ctopd_jax.demo.data import ASSET_DIR
from ctopd_jax.models import Decoder, ModelConfig, tiny_llama, tiny_qwen2
from ctopd_jax.models.weights import export_hf_checkpoint
from ctopd_jax.optimizer import OptimizerSettings, make_optimizer
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


def char_student_config(vocab_size: int) -> ModelConfig:
    return tiny_llama(vocab_size=vocab_size, hidden_size=64, intermediate_size=192,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                      max_position_embeddings=256)


# The same-tokenizer pair (`--pair char`): both sides use the repository's character vocabulary
# (tokenization/char_vocab.py). The teacher_base checkpoint is a snapshot of the teacher's own
# run after CHAR_BASE_STEPS steps (its "pre-tuning base"); 300 constant-lr steps reached only
# 25% held-out accuracy, hence 600 steps with the cosine schedule.
CHAR_SPECS = {
    "teacher": PretrainSpec("teacher", "char", teacher_config, steps=600, batch_size=64,
                            lr=3e-3, seed=11),
    "student": PretrainSpec("student", "char", char_student_config, steps=80, batch_size=64,
                            lr=3e-3, seed=12, schedule="constant"),
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


def sft_loss(model: Decoder, input_ids, labels, attention_mask):
    """Token-mean cross-entropy over the supervised (response + EOS) rows."""
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    logits = model(input_ids, positions, attention_mask)
    supervised = labels != IGNORE_INDEX
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(supervised, labels, 0))
    return jnp.sum(ce * supervised) / jnp.maximum(1, jnp.sum(supervised))


@nnx.jit
def _train_step(model, optimizer, input_ids, labels, attention_mask):
    loss, grads = nnx.value_and_grad(sft_loss)(model, input_ids, labels, attention_mask)
    optimizer.update(model, grads)
    return loss


def held_out_accuracy(model: Decoder, side: TokenizerSide, out_dir: Path | None = None) -> float:
    """Greedy accuracy on the held-out split, graded by the task grader (via evaluate_model)."""
    from ctopd_jax.datasets import load_dataset
    from ctopd_jax.evaluate import evaluate_model

    report = evaluate_model(model, side, load_dataset("demo"), greedy=True,
                            max_new_tokens=MAX_NEW_TOKENS, out_dir=out_dir)
    return report.mean_at_k


def train(spec: PretrainSpec, steps: int | None = None, eval_every: int = 0, log=print,
          snapshot: tuple[int, Callable] | None = None):
    """SFT ``spec`` from its seed; returns (model, side, history). ``snapshot = (n, fn)`` calls
    ``fn(model, side, history)`` after step n (the char teacher's base)."""
    steps = steps or spec.steps
    side = load_tokenizer_side(spec.tokenizer)
    cfg = spec.make_config(side.vocab_size)
    model = Decoder(cfg, rngs=nnx.Rngs(spec.seed))
    tx, _ = make_optimizer(OptimizerSettings(learning_rate=spec.lr, total_steps=steps,
                                             schedule=spec.schedule,
                                             warmup_ratio=spec.warmup_ratio,
                                             min_lr=spec.lr / 10, weight_decay=0.0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train_problems = task.split("train")
    rng = np.random.default_rng(spec.seed)
    history, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        batch = sft_batch(side, task.sample(train_problems, spec.batch_size, rng))
        loss = float(_train_step(model, optimizer, *map(jnp.asarray, batch)))
        row = {"step": step, "loss": loss, "time_s": round(time.perf_counter() - start, 1)}
        if eval_every and (step % eval_every == 0 or step == steps):
            row["held_out_accuracy"] = held_out_accuracy(model, side)
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
    spec = (CHAR_SPECS if pair == "char" else SPECS)[role]
    command = "python -m ctopd_jax.demo.pretrain --role " + role + (" --pair char" if pair == "char" else "")
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
    model, side, history = train(spec, steps, eval_every, log, snapshot=snapshot)
    train_s = time.perf_counter() - start
    accuracy = held_out_accuracy(model, side)
    meta = {"role": role, "tokenizer": spec.tokenizer, "family": model.cfg.family,
            "steps": steps or spec.steps, "batch_size": spec.batch_size, "lr": spec.lr,
            "seed": spec.seed, "final_loss": history[-1]["loss"],
            "held_out_accuracy": accuracy, "train_seconds": round(train_s, 1),
            "command": command}
    save(model, side, out_root / role, meta)
    log(f"[{role}] held-out accuracy {accuracy:.3f} after {meta['steps']} steps "
        f"({train_s:.0f} s) -> {out_root / role}")
    return meta


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=sorted(SPECS), nargs="*", default=["teacher", "student"])
    parser.add_argument("--pair", choices=("cross", "char"), default="cross",
                        help="cross: the tiny_bpe/tiny_unigram pair (assets/demo); char: the "
                             "same-tokenizer character pair (assets/demo_char, teacher_base too)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: ctopd_jax/assets/demo (cross) or assets/demo_char (char)")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's steps")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also report held-out accuracy every N steps (for tuning)")
    args = parser.parse_args(argv)
    out = args.out or (CHAR_ASSET_DIR if args.pair == "char" else ASSET_DIR)
    return [pretrain(r, out, args.steps, args.eval_every, pair=args.pair) for r in args.role]


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
