"""The training-time log-prob gap: the engine's sampling-time log-probs of the sampled tokens
against the student step's own log-probs at the same rows (same weights, τ = 1, top_p = 1).

The demo's trained student mostly samples the canonical tokenization of its own text, so its
re-tokenized responses equal the sampled ids and the rows line up; a misaligned row (off by one
position or sample) would show a gap of several nats."""
import pytest

from ctopd_jax.common.metrics import StepTimer
from ctopd_jax.config import from_dict
from ctopd_jax.loop.trainer import Trainer

from conftest import tiny_tree


@pytest.mark.slow  # loads the demo pair and compiles one step (~1-2 min on 2 cores)
def test_gap_is_zero_where_the_retokenized_response_equals_the_samples(tmp_path):
    tree = tiny_tree(tmp_path / "gap", steps=1, **{
        "model.student": "demo:student", "model.teacher": "demo:teacher",
        "model.student_tokenizer": "", "model.teacher_tokenizer": "", "data.path": "demo:train",
        "rollout.generate_max_len": 36})
    trainer = Trainer(from_dict(tree))
    metrics, _ = trainer.iteration(StepTimer())
    assert "logprob_gap" in metrics, "no re-tokenized response equalled its sampled ids"
    assert metrics["logprob_gap"] < 1e-4, metrics["logprob_gap"]
