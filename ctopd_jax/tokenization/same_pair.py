"""One tokenizer on both sides: the check a same-tokenizer objective (it reuses the sampled ids)
makes of its teacher and student tokenizers before any model loads.

Two chat templates need not be the same text, only render the same conversations: the
conversations a run renders (system, user and assistant turns; no tool definitions, which no
run passes). Qwen2.5-Coder-0.5B's and 1.5B's packaged templates differ in their tool-call
instructions only (`{"name": ...}` against `{{"name": ...}}`) and render every run's prompt
alike."""
from __future__ import annotations

# What a run renders (data/prompts.py, the turn-based objectives' episodes), each with and
# without the assistant's opening.
PROBES = (
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Answer with a number."},
     {"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Answer with a number."},
     {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"},
     {"role": "user", "content": "And 5 * 4?"}],
)


def same_tokenizer_mismatch(teacher, student) -> str | None:
    """The first difference between two tokenizer sides that must be one tokenizer (vocabulary,
    special ids, chat template), as one line; None when they are identical."""
    if teacher.vocab_size != student.vocab_size:
        return (f"the teacher vocabulary has {teacher.vocab_size} tokens, the student's "
                f"{student.vocab_size}")
    t_vocab = teacher.tokenizer.get_vocab(with_added_tokens=True)
    s_vocab = student.tokenizer.get_vocab(with_added_tokens=True)
    if t_vocab != s_vocab:
        t_tok = {i: t for t, i in t_vocab.items()}
        s_tok = {i: t for t, i in s_vocab.items()}
        first = min(i for i in set(t_tok) | set(s_tok) if t_tok.get(i) != s_tok.get(i))
        return f"token id {first} is {t_tok.get(first)!r} for the teacher but {s_tok.get(first)!r} for the student"
    for name in ("eos_id", "pad_id", "bos_id"):
        if getattr(teacher, name) != getattr(student, name):
            return f"{name} is {getattr(teacher, name)} for the teacher but {getattr(student, name)} for the student"
    if (teacher.chat_template or "") != (student.chat_template or ""):
        return _rendering_mismatch(teacher, student)
    return None


def _rendering_mismatch(teacher, student) -> str | None:
    """Where two different chat templates render one of the PROBES differently, as one line."""
    if not (teacher.chat_template and student.chat_template):
        return f"only the {'teacher' if teacher.chat_template else 'student'} has a chat template"
    for messages in PROBES:
        for opening in (True, False):
            t = teacher.render_chat(messages, add_generation_prompt=opening)
            s = student.render_chat(messages, add_generation_prompt=opening)
            if t != s:
                at = next((i for i, (a, b) in enumerate(zip(t, s)) if a != b), min(len(t), len(s)))
                return (f"the chat templates render a {len(messages)}-message conversation "
                        f"differently at character {at} ({t[at:at + 20]!r} vs {s[at:at + 20]!r})")
    return None


def check_same_tokenizer(teacher, student, objective_name: str, what: str = "model.teacher") -> None:
    """Raise one ValueError line when a same-tokenizer objective gets two different tokenizers."""
    diff = same_tokenizer_mismatch(teacher, student)
    if diff is not None:
        raise ValueError(f"{what} / model.student: algorithm.name={objective_name} reuses the sampled ids "
                         f"and needs one tokenizer and chat template on both sides, but {diff}; use a "
                         "same-tokenizer pair (e.g. configs/tiny_cpu_same.yaml) or a cross-tokenizer "
                         "objective (topk_strict)")
