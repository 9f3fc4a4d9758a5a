"""Tokenizers against their models and each other, and the prompts rendered and encoded."""
from __future__ import annotations

from pathlib import Path

from ctopd_jax.collect.collector import render
from ctopd_jax.config import TrainConfig
from ctopd_jax.data.eval_sets import build_prompt
from ctopd_jax.loop.build import context_room
from ctopd_jax.loop.objective_factory import check_models, check_pair
from ctopd_jax.preflight.errors import fail
from ctopd_jax.preflight.models import model_cfg
from ctopd_jax.tokenization import overlap as vocab_overlap   # patched by tests: read at call time
from ctopd_jax.tokenization.side import load_tokenizer_side


def load_tokenizer(config: TrainConfig, role: str, directory: Path | None, cfg=None):
    """model.<role>'s tokenizer side, no larger than the model's vocabulary (`cfg`: its
    config.json's ModelConfig, None for a preset)."""
    side = _tokenizer_side(config, role, directory)
    if cfg is not None and cfg.vocab_size < side.vocab_size:
        raise fail(f"model.{role}: vocabulary {cfg.vocab_size} (config.json) is smaller than "
                   f"its tokenizer's {side.vocab_size}; pair the model with the tokenizer "
                   f"it was trained with (model.{role}_tokenizer)")
    return side


def _tokenizer_side(config: TrainConfig, role: str, directory: Path | None):
    field_name = f"model.{role}_tokenizer"
    spec = getattr(config.model, f"{role}_tokenizer")
    if not spec:
        if directory is None:
            raise fail(f"{field_name}: model.{role}={getattr(config.model, role)!r} is a preset "
                       f"without a tokenizer; set {field_name} (e.g. tiny_bpe, qwen2.5, or a "
                       "directory with tokenizer.json)")
        spec, field_name = str(directory), f"{field_name} (empty: the model.{role} directory)"
    try:
        return load_tokenizer_side(spec)
    except Exception as err:  # TokenizerLoadError, OSError, the Rust tokenizer's errors
        raise fail(f"{field_name}={spec!r}: {err}") from None


def check_overlap(objective, teacher, student):
    try:
        overlap = vocab_overlap.overlap_map(teacher, student)
    except vocab_overlap.NoOverlapError as err:
        raise fail(f"model.teacher_tokenizer / model.student_tokenizer: {err}; choose a pair "
                   "with common tokens (python -m ctopd_jax.inspect_pair shows the overlap)") \
            from None
    check_pair(objective, overlap)   # e.g. ctkd_topk <= |V∩|
    return overlap


def encode_prompts(side, prompts, role: str, field_name: str):
    """Every prompt rendered with `side`'s template and encoded; a prompt holding text the
    tokenizer can only map to its unknown token (no byte fallback) is refused, naming the row
    and the characters: the teacher would score, and the aligner compare, other text."""
    texts = [render(side, p) for p in prompts]
    encoded = side.tokenizer.encode_batch(texts, add_special_tokens=False)
    unk = side.special_token_strings.get("unk_token")
    unk_id = side.tokenizer.token_to_id(unk) if unk else None
    if unk_id is not None:
        for prompt, text, enc in zip(prompts, texts, encoded):
            spans = [enc.offsets[i] for i, t in enumerate(enc.ids) if t == unk_id]
            lost = [text[a:b] for a, b in spans if text[a:b] != unk]
            if lost:
                raise fail(f"{prompt.source}: the {role} tokenizer ({field_name}) cannot encode "
                           f"{lost[0]!r} (it becomes {unk!r}); use a tokenizer with byte "
                           "fallback, or remove those characters from the data")
    return encoded


def check_prompt_lengths(config: TrainConfig, prompts, student, student_cfg, data_path: Path) -> None:
    """At least one prompt must fit rollout.max_prompt_len once rendered (the trainer drops the
    longer ones with a warning; with none left there is nothing to train on); the longest kept
    one plus rollout.generate_max_len must fit the student's positions (the engine refuses it
    at the first rollout otherwise); no prompt may lose text to the student's tokenizer (nor
    to a teacher's: _check_teacher)."""
    encoded = encode_prompts(student, prompts, "student", "model.student_tokenizer")
    limit, new = config.rollout.max_prompt_len, config.rollout.generate_max_len
    kept = [len(e.ids) for e in encoded if len(e.ids) <= limit]
    if not kept:
        raise fail(f"rollout.max_prompt_len: {limit} student tokens, but the shortest rendered "
                   f"prompt of {data_path} has {min(len(e.ids) for e in encoded)}; raise "
                   "rollout.max_prompt_len")
    positions = model_cfg(config, "student", student_cfg).max_position_embeddings
    if max(kept) + new > positions:
        raise fail(f"rollout.generate_max_len: {new} new tokens after the longest kept prompt "
                   f"of {data_path} ({max(kept)} student tokens) need {max(kept) + new} "
                   f"positions, over the student's max_position_embeddings {positions}; lower "
                   f"rollout.generate_max_len to <= {positions - max(kept)} or "
                   "rollout.max_prompt_len")


def check_eval_prompts(config: TrainConfig, objective, eval_set, student, student_cfg) -> None:
    """Evaluation inside training generates with the training engine: every problem's prompt
    must fit the engine's prompt length and, with generate_max_len, the student's positions;
    found here rather than at the first evaluation, possibly hours into the run."""
    if eval_set is None or not eval_set.problems:
        return

    texts = [build_prompt(student, p, eval_set.system_prompt) for p in eval_set.problems]
    lengths = [len(e.ids) for e in student.tokenizer.encode_batch(texts, add_special_tokens=False)]
    longest = max(lengths)
    problem = eval_set.problems[lengths.index(longest)]
    rollout = config.rollout
    room = rollout.max_prompt_len + context_room(objective, rollout, student)
    where = f"evaluation.dataset {config.evaluation.dataset}: problem {problem.id!r}"
    if longest > room:
        raise fail(f"{where} renders to {longest} student tokens, over the {room} the training "
                   "engine accepts (rollout.max_prompt_len); raise rollout.max_prompt_len, or "
                   "evaluate after training with python -m ctopd_jax.evaluate")
    positions = model_cfg(config, "student", student_cfg).max_position_embeddings
    if longest + rollout.generate_max_len > positions:
        raise fail(f"{where} renders to {longest} student tokens; with rollout.generate_max_len "
                   f"{rollout.generate_max_len} that is over the student's "
                   f"max_position_embeddings {positions}; lower rollout.generate_max_len")


def check_objective_models(config: TrainConfig, objective, teacher_side, teacher_cfg) -> None:
    """The objective's checks against the teacher's config and tokenizer (before any weight)."""
    check_models(config, objective, model_cfg(config, "teacher", teacher_cfg), teacher_side)
