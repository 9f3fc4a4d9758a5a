"""A real `vllm serve` of the demo teacher on 127.0.0.1: the client's token log-probs and top-k
equal the local teacher's (this repository's Decoder forward) to float tolerance, and the
start-up check passes it and refuses the wrong vocabulary / top-k.

Marked `vllm` (and slow: the server takes ~30-60 s to start on 2 cores); runs from the vLLM venv:
`.venv-vllm/bin/python -m pytest -q -m vllm tests/teacher_service` (make test-vllm).
"""
import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

from ctopd_jax.demo.served_inputs import DEMO_TEACHER, demo_teacher_inputs  # noqa: E402
from ctopd_jax.models.weights import load_hf_checkpoint  # noqa: E402
from ctopd_jax.teacher_service import (ServedTeacher, TeacherServerCheckError,  # noqa: E402
                                       TeacherServiceSettings)
from ctopd_jax.teacher_service.local_scores import LocalTeacherScorer  # noqa: E402
from ctopd_jax.teacher_service.local_server import local_vllm_server  # noqa: E402

TOP_K = 16
VOCAB = 800  # the demo teacher's config.json vocab_size


@pytest.fixture(scope="module")
def url():
    with local_vllm_server(DEMO_TEACHER, served_name="demo-teacher", max_logprobs=32) as server:
        yield server.url


def served(url, **fields):
    settings = dict(engine="vllm_server", url=url, model="demo-teacher", top_k=TOP_K,
                    max_concurrency=4, max_tokens_per_request=512)
    settings.update(fields)
    return ServedTeacher(TeacherServiceSettings(**settings))


def test_served_scores_equal_the_local_teacher(url):
    teacher = served(url)
    info = teacher.start(VOCAB)
    assert info.max_model_len == 256 and "demo-teacher" in info.names
    sequences, starts = demo_teacher_inputs(24, seed=5)
    got = teacher.score(sequences, starts)
    model, _ = load_hf_checkpoint(DEMO_TEACHER)
    want = LocalTeacherScorer(model, TOP_K).score(sequences, starts)
    worst_token = worst_top = 0.0
    for g, w in zip(got, want):
        assert len(g) == len(w)
        worst_token = max(worst_token, float(np.abs(g.token_logprobs - w.token_logprobs).max()))
        worst_top = max(worst_top, float(np.abs(g.topk_logprobs - w.topk_logprobs).max()))
        # Same ids wherever the local top-k has no near-tie to reorder them.
        gaps = np.diff(-w.topk_logprobs, axis=1).min(axis=1)
        clear = gaps > 1e-3
        np.testing.assert_array_equal(g.topk_ids[clear], w.topk_ids[clear])
    print(f"served vs local: max |Δ token log-prob| {worst_token:.2e}, "
          f"max |Δ top-k log-prob| {worst_top:.2e}")
    # float32 on both sides (vLLM's CPU kernels vs XLA): measured ~1e-5 here.
    assert worst_token < 1e-3 and worst_top < 1e-3


def test_start_up_check_on_the_real_server(url):
    with pytest.raises(TeacherServerCheckError, match="more than the teacher's 799 vocabulary"):
        served(url).start(VOCAB - 1)
    with pytest.raises(TeacherServerCheckError, match="fewer than the teacher's 801 vocabulary"):
        served(url).start(VOCAB + 1)
    with pytest.raises(TeacherServerCheckError, match=r"top_k=33 is above the server's limit; "
                                                      r"restart the server with --max-logprobs 33"):
        served(url, top_k=33).start(VOCAB)
    with pytest.raises(TeacherServerCheckError, match="not teacher.model 'Qwen2.5-7B'"):
        served(url, model="Qwen2.5-7B").start(VOCAB)


def test_served_rows_equal_the_trainers_teacher_path(url, tiny_bpe):
    """On a re-tokenized teacher batch (as collect/collector.py builds it), the served rows equal what the
    trainer's own teacher path (teacher.teacher_hidden_rows, then the lm_head) gives at every
    loss-mask row: the row convention holds end to end."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ctopd_jax.demo import task
    from ctopd_jax.step.teacher import lm_head_of, teacher_hidden_rows
    from ctopd_jax.teacher_service.batch_rows import score_teacher_batch
    from ctopd_jax.tokenization.retokenize import retokenize

    problems = task.split("held_out")[:8]
    prompts = [f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n"
               for p in problems]
    responses = [p.solution if i % 2 else p.solution.replace("=", "=1", 1)
                 for i, p in enumerate(problems)]
    batch = retokenize(tiny_bpe, prompts, responses, pad_to_multiple=16)
    rows = score_teacher_batch(served(url), batch)

    model, _ = load_hf_checkpoint(DEMO_TEACHER)
    graphdef, state = nnx.split(model)
    flat = np.nonzero(batch.loss_mask.reshape(-1))[0].astype(np.int32)
    hidden = teacher_hidden_rows(graphdef, state, jnp.asarray(batch.input_ids),
                                 jnp.asarray(batch.attention_mask), jnp.asarray(flat))
    logprobs = np.asarray(jax.nn.log_softmax(hidden @ lm_head_of(graphdef, state), axis=-1))
    labels = batch.labels.reshape(-1)[flat]
    np.testing.assert_allclose(rows.token_logprobs[flat],
                               logprobs[np.arange(len(flat)), labels], atol=1e-3)
    np.testing.assert_allclose(rows.topk_logprobs[flat], -np.sort(-logprobs, axis=1)[:, :TOP_K],
                               atol=1e-3)
    assert rows.row_mask.sum() == len(flat)
