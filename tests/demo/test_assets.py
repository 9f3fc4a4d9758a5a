"""The committed demo checkpoints: right architectures and tokenizers, and a teacher that
really knows the task where the student does not (teacher-forced on held-out solutions)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ctopd_jax.demo import data, task
from ctopd_jax.demo.pretrain import SEQ_LEN, SPECS, sft_batch
from ctopd_jax.models.weights import load_hf_checkpoint
from ctopd_jax.tokenization import IGNORE_INDEX, load_tokenizer_side
from ctopd_jax.tokenization.assets import resolve_tokenizer_dir


@pytest.fixture(scope="module")
def sides():
    out = {}
    for role in data.ROLES:
        model, cfg = load_hf_checkpoint(data.checkpoint_dir(role))
        out[role] = (model, cfg, load_tokenizer_side(str(data.checkpoint_dir(role))))
    return out


def test_architectures_and_tokenizer_kinds(sides):
    _, t_cfg, t_side = sides["teacher"]
    _, s_cfg, s_side = sides["student"]
    assert t_cfg.family == "qwen2" and t_cfg.qkv_bias and t_cfg.tie_word_embeddings
    assert s_cfg.family == "llama" and not s_cfg.qkv_bias
    assert t_side.kind == "byte_level" and s_side.kind == "metaspace"
    assert t_cfg.vocab_size == t_side.vocab_size and s_cfg.vocab_size == s_side.vocab_size


def test_checkpoint_tokenizers_are_the_committed_ones():
    """If the small tokenizers are retrained, the demo checkpoints must be rebuilt with
    `python -m ctopd_jax.demo.pretrain` (they were trained on the old token ids)."""
    for role, spec in SPECS.items():
        ours = (data.checkpoint_dir(role) / "tokenizer.json").read_text()
        assert ours == (resolve_tokenizer_dir(spec.tokenizer) / "tokenizer.json").read_text(), role


def _teacher_forced_token_accuracy(model, side, problems):
    ids, labels, mask = sft_batch(side, problems)
    assert ids.shape[1] == SEQ_LEN
    positions = jnp.broadcast_to(jnp.arange(SEQ_LEN), ids.shape)
    pred = np.asarray(model(jnp.asarray(ids), positions, jnp.asarray(mask)).argmax(-1))
    rows = labels != IGNORE_INDEX
    per_sample = ((pred == labels) | ~rows).all(axis=1)
    return per_sample.mean()


def test_teacher_knows_the_task_and_student_starts_behind(sides):
    problems = task.split("held_out")[:48]
    teacher = _teacher_forced_token_accuracy(sides["teacher"][0], sides["teacher"][2], problems)
    student = _teacher_forced_token_accuracy(sides["student"][0], sides["student"][2], problems)
    assert teacher == 1.0          # every response token (and EOS) is the teacher's argmax
    assert student < 0.8
    recorded = {r: json.loads((data.checkpoint_dir(r) / "pretrain.json").read_text())
                for r in data.ROLES}
    assert recorded["teacher"]["held_out_accuracy"] - recorded["student"]["held_out_accuracy"] > 0.3


def test_char_pair_is_distillable():
    """The committed character pair (issue 23): a teacher that solves the task but is never
    certain (label smoothing), and a student of the recipe's architecture that starts far behind."""
    from ctopd_jax.demo.pretrain import CHAR_ASSET_DIR, CHAR_SPECS

    side = load_tokenizer_side("char")
    (teacher, t_cfg), (student, s_cfg) = (load_hf_checkpoint(CHAR_ASSET_DIR / r) for r in ("teacher", "student"))
    assert s_cfg.hidden_size == CHAR_SPECS["student"].make_config(side.vocab_size).hidden_size
    problems = task.split("held_out")[:48]
    assert _teacher_forced_token_accuracy(teacher, side, problems) == 1.0
    assert _teacher_forced_token_accuracy(student, side, problems) < 0.8
    ids, labels, mask = sft_batch(side, problems)
    positions = jnp.broadcast_to(jnp.arange(SEQ_LEN), ids.shape)
    logp = np.asarray(jax.nn.log_softmax(teacher(jnp.asarray(ids), positions, jnp.asarray(mask)), -1))
    entropy = -(np.exp(logp) * logp).sum(-1)[labels != IGNORE_INDEX]
    assert entropy.mean() > 0.1          # not near-deterministic (the old teacher: ~0.001 nats)
    recorded = {r: json.loads((CHAR_ASSET_DIR / r / "pretrain.json").read_text()) for r in ("teacher", "student")}
    assert recorded["teacher"]["label_smoothing"] == CHAR_SPECS["teacher"].label_smoothing > 0
    errors = recorded["teacher"]["on_student_errors"]
    assert errors["teacher_entropy_after_student_error_nats"] > 0.1 and errors["positions_after_student_error"] > 0
    assert recorded["teacher"]["held_out_accuracy"] - recorded["student"]["held_out_accuracy"] > 0.5
