"""Served scores land on the teacher batch's own flat logits rows: row r = b*T + p holds the
score of labels[b, p] (the token that row predicts), for every loss-mask row, and nothing else."""
import numpy as np
import pytest

from _fake_teacher_server import FakeTeacherServer, ToyTeacher
from ctopd_jax.teacher_service import ServedTeacher, TeacherServiceSettings
from ctopd_jax.teacher_service.batch_rows import score_teacher_batch, teacher_sequences
from ctopd_jax.tokenization.retokenize import retokenize


@pytest.fixture(scope="module")
def toy():
    return ToyTeacher(vocab=800, seed=2)  # the demo teacher tokenizer's vocabulary


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_rows_follow_the_batch_row_convention(tiny_bpe, toy, engine):
    prompts = ["Compute 7 - 5 + 3.\n", "Compute 1 + 1 - 2.\nShow the steps.\n", "Go:"]
    responses = ["(7-5)=2, 2+3=5. The answer is 5.", "(1+1)=2, 2-2=0.", ""]
    batch = retokenize(tiny_bpe, prompts, responses, pad_to_multiple=16)
    fake = FakeTeacherServer(engine, toy, max_model_len=512)
    try:
        teacher = ServedTeacher(TeacherServiceSettings(engine=engine + "_server", url=fake.url,
                                                       top_k=4, max_tokens_per_request=40))
        rows = score_teacher_batch(teacher, batch)
    finally:
        fake.close()
    np.testing.assert_array_equal(rows.row_mask, batch.loss_mask.reshape(-1))
    assert rows.row_mask.sum() == batch.num_response_tokens  # EOS rows included
    ids = batch.input_ids
    for b, p in zip(*np.nonzero(batch.loss_mask)):
        r = b * batch.seq_len + p
        lp = toy.logprobs(ids[b, :p + 1].tolist())
        assert rows.token_logprobs[r] == pytest.approx(lp[batch.labels[b, p]], abs=1e-5)
        np.testing.assert_array_equal(rows.topk_ids[r], np.argsort(-lp, kind="stable")[:4])
    outside = ~rows.row_mask
    assert (rows.token_logprobs[outside] == 0).all()
    assert np.isneginf(rows.topk_logprobs[outside]).all()


def test_teacher_sequences_strip_padding_and_keep_the_eos(tiny_bpe):
    batch = retokenize(tiny_bpe, ["ab", "Compute 2 + 2."], ["c", "=4"], pad_to_multiple=32)
    sequences, starts = teacher_sequences(batch)
    for b, (seq, start) in enumerate(zip(sequences, starts)):
        assert seq[-1] == batch.eos_id and len(seq) == start + batch.response_lens[b]
        assert seq == batch.input_ids[b, :len(seq)].tolist() and start == batch.prompt_lens[b]


def test_episode_rows_skip_observations_and_keep_the_trained_tokens_after_them(tiny_bpe, toy):
    """host.token_batch (episodes): observations are context between trained tokens, so the
    whole sequence is scored and only the loss-mask rows carry values."""
    from ctopd_jax.collect.collector import token_batch

    prompts = [tiny_bpe.encode("Compute 2 + 3."), tiny_bpe.encode("Go:")]
    responses = [tiny_bpe.encode("<calc>2+3</calc>") + tiny_bpe.encode("<result>5</result>")
                 + tiny_bpe.encode("The answer is 5.") + [tiny_bpe.eos_id],
                 tiny_bpe.encode("ok") + [tiny_bpe.eos_id]]
    n_calc, n_obs = len(tiny_bpe.encode("<calc>2+3</calc>")), len(tiny_bpe.encode("<result>5</result>"))
    trained = [np.r_[np.ones(n_calc, bool), np.zeros(n_obs, bool),
                     np.ones(len(responses[0]) - n_calc - n_obs, bool)], np.ones(len(responses[1]), bool)]
    batch = token_batch(tiny_bpe, prompts, responses, trained, pad_to_multiple=16)
    fake = FakeTeacherServer("vllm", toy, max_model_len=512)
    try:
        teacher = ServedTeacher(TeacherServiceSettings(engine="vllm_server", url=fake.url, top_k=2))
        rows = score_teacher_batch(teacher, batch, top_k=0)
    finally:
        fake.close()
    assert rows.topk_ids.shape == (batch.batch_size * batch.seq_len, 0)
    np.testing.assert_array_equal(rows.row_mask, batch.loss_mask.reshape(-1))
    assert batch.loss_mask[0].sum() < batch.attention_mask[0].sum() - len(prompts[0])  # a gap
    for b, p in zip(*np.nonzero(batch.loss_mask)):
        lp = toy.logprobs(batch.input_ids[b, :p + 1].tolist())
        assert rows.token_logprobs[b * batch.seq_len + p] == pytest.approx(lp[batch.labels[b, p]], abs=1e-5)
    assert (rows.token_logprobs[~rows.row_mask] == 0).all()
