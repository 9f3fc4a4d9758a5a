"""Evaluation prompts: the SPEC §10 system prompt in each model family's own chat template.

References: a hand-written Qwen2.5 ChatML string, and transformers' ``apply_chat_template`` on
the same tokenizer directory (Qwen2.5 and Llama-3, built by setup_assets; skipped if absent).
"""
import functools

import pytest

from ctopd_jax.data.eval_sets import build_prompt, EvalProblem, load_dataset, MATH_SYSTEM_PROMPT
from ctopd_jax.tokenization.assets import cache_root
from ctopd_jax.tokenization.side import load_tokenizer_side

PROBLEM = EvalProblem("t", "What is $1+1$?", "2")


@functools.lru_cache(maxsize=None)
def _load(name):
    return load_tokenizer_side(name)  # byte views of a 150k vocabulary take seconds: once


def _real(name):
    if not (cache_root() / name / "tokenizer.json").is_file():
        pytest.skip(f"{name} tokenizer not built (python -m ctopd_jax.setup_assets)")
    return _load(name)


def test_spec_system_prompt_text():
    assert MATH_SYSTEM_PROMPT == ("Please reason step by step, and put your final answer "
                                  "within \\boxed{}.")


def test_qwen_chatml_by_hand():
    side = _real("qwen2.5")
    expected = ("<|im_start|>system\nPlease reason step by step, and put your final answer within "
                "\\boxed{}.<|im_end|>\n<|im_start|>user\nWhat is $1+1$?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert build_prompt(side, PROBLEM, MATH_SYSTEM_PROMPT) == expected


# Qwen2.5 is pinned by the hand-written string above; Llama-3 (dated system header) against
# transformers. Template rendering itself is compared with transformers in tests/tokenization.
@pytest.mark.parametrize("name", ["llama3"])
def test_matches_transformers_chat_template(name):
    side = _real(name)
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(side.path))
    messages = [{"role": "system", "content": MATH_SYSTEM_PROMPT},
                {"role": "user", "content": PROBLEM.problem}]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert build_prompt(side, PROBLEM, MATH_SYSTEM_PROMPT) == want


def test_source_messages_are_rendered_as_given():
    side = load_tokenizer_side("tiny_bpe")
    ds = load_dataset(__import__("pathlib").Path(__file__).parent / "fixtures" / "dapo_prompts.parquet")
    prompt = build_prompt(side, ds.problems[1], MATH_SYSTEM_PROMPT)
    assert prompt == ("<|im_start|>system\nYou are a careful solver.<|im_end|>\n"
                      "<|im_start|>user\nCompute $\\frac{1}{2}+\\frac{1}{3}$.<|im_end|>\n"
                      "<|im_start|>assistant\n")


def test_demo_task_prompt_has_no_math_system_turn():
    side = load_tokenizer_side("tiny_bpe")
    demo = load_dataset("demo")
    prompt = build_prompt(side, demo.problems[0], demo.system_prompt)
    assert "boxed" not in prompt and demo.problems[0].problem in prompt


def test_stop_ids_cover_end_of_turn_markers():
    from ctopd_jax.loop.mean_at_k import stop_ids

    llama = _real("llama3")
    ids = stop_ids(llama)
    assert ids[0] == llama.eos_id
    assert {llama.tokenizer.token_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>")} <= set(ids)
    tiny = load_tokenizer_side("tiny_bpe")
    assert set(stop_ids(tiny)) == {tiny.tokenizer.token_to_id("<|im_end|>"),
                                   tiny.tokenizer.token_to_id("<|endoftext|>")}
