"""The native JAX sampler against HF transformers on tiny random Llama / Qwen2 models."""
import numpy as np
import pytest

import jax
import torch

from _hf_tiny import hf_greedy, hf_response_logprobs, load_pair, random_prompts
from ctopd_jax.rollout.base import RolloutConfigError, SamplingParams
from ctopd_jax.rollout.jax_sampler import JaxSampler, compiled_variants
from ctopd_jax.rollout.logprob_gap import logprob_gap, response_logprobs


# Shapes are kept inside one bucket set (batch <= 8, prompt <= 16, new tokens <= 8) so the
# tests share a few compiled programs; both families run the HF parity tests, llama the rest.
MAX_NEW = 8


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    hf, model, cfg = load_pair(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf, model, cfg = load_pair("llama", tmp_path_factory.mktemp("llama_only"))
    return "llama", hf, model


def test_greedy_equals_hf_generate(pair):
    family, hf, model = pair
    prompts = random_prompts(np.random.default_rng(1), 5, max_len=16)  # ragged: exercises left padding
    sampler = JaxSampler(model, eos_ids=None, pad_id=0)
    result = sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    for prompt, tokens in zip(prompts, result.token_ids):
        assert tokens == hf_greedy(hf, prompt, MAX_NEW)
    assert result.finish_reasons == ["length"] * 5

    # Stop on EOS: pick as EOS a token sample 0 emits after step 0 (and not at step 0).
    first = result.token_ids[0]
    eos = next(t for t in first[1:] if t != first[0])
    stopper = JaxSampler(model, eos_ids=[eos], pad_id=0)
    stopped = stopper.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    for prompt, tokens, reason in zip(prompts, stopped.token_ids, stopped.finish_reasons):
        want = hf_greedy(hf, prompt, MAX_NEW, eos_id=eos)
        assert tokens == want
        assert reason == ("stop" if want[-1] == eos and eos in want else "length")
    assert stopped.finish_reasons[0] == "stop"


def test_sampling_logprobs_are_hf_raw_logprobs(pair):
    """Returned log-probs equal HF teacher-forced log-probs of the sampled tokens (gap ~ 0)."""
    family, hf, model = pair
    prompts = random_prompts(np.random.default_rng(2), 3, max_len=16)
    sampler = JaxSampler(model, eos_ids=[5], pad_id=0)
    result = sampler.generate(prompts, SamplingParams(temperature=1.3, top_k=40, top_p=0.95,
                                                      max_new_tokens=MAX_NEW, n=2, seed=3))
    assert result.prompt_index == [0, 0, 1, 1, 2, 2]
    reference = [hf_response_logprobs(hf, p, t)
                 for p, t in zip(result.prompt_ids, result.token_ids)]
    gap = logprob_gap(result.logprobs, reference)
    assert gap["logprob_gap_tokens"] == result.num_generated_tokens
    assert gap["logprob_gap_max"] < 1e-4
    # The trainer-side recomputation with our own decoder agrees too.
    ours = response_logprobs(model, result.prompt_ids, result.token_ids)
    assert logprob_gap(ours, reference)["logprob_gap_max"] < 1e-4


def test_first_token_frequencies_follow_filtered_hf_distribution(llama):
    """2048 samples of one step: frequencies match softmax of HF logits after T / top-k / top-p."""
    family, hf, model = llama
    prompt = [7, 19, 33, 101]
    temperature, top_k, top_p = 1.5, 12, 0.8
    sampler = JaxSampler(model, eos_ids=None, pad_id=0, max_batch_size=2048)
    draws = 2048
    result = sampler.generate([prompt], SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, n=draws, seed=11))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double().numpy() / temperature
    order = np.argsort(-logits)
    kept = order[:top_k]
    probs = np.exp(logits[kept] - logits[kept].max())
    probs /= probs.sum()
    ahead = np.cumsum(probs) - probs
    kept = kept[ahead < top_p]
    want = np.zeros_like(logits)
    want[kept] = np.exp(logits[kept] - logits[kept].max())
    want /= want.sum()
    freq = np.bincount([t[0] for t in result.token_ids], minlength=len(logits)) / draws
    assert set(np.nonzero(freq)[0]) <= set(kept.tolist())
    np.testing.assert_allclose(freq, want, atol=0.035)


def test_seeded_sampling_is_reproducible_and_chunking_invariant(llama):
    family, hf, model = llama
    prompts = random_prompts(np.random.default_rng(3), 3, max_len=16)
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, max_new_tokens=8, n=2,
                            seed=123)
    big = JaxSampler(model, eos_ids=None, pad_id=0, max_batch_size=8)
    a = big.generate(prompts, params)
    b = big.generate(prompts, params)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    other_seed = big.generate(prompts, params.replace(seed=124))
    assert other_seed.token_ids != a.token_ids
    # A sample's randomness depends on (seed, sample index, step) only, not on the batch it ran in.
    small = JaxSampler(model, eos_ids=None, pad_id=0, max_batch_size=2)
    assert small.generate(prompts, params).token_ids == a.token_ids


def test_no_recompile_within_buckets(llama):
    family, hf, model = llama
    rng = np.random.default_rng(4)
    sampler = JaxSampler(model, eos_ids=[3], pad_id=0)
    sampler.generate(random_prompts(rng, 3, max_len=9),
                     SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=5, seed=1))
    before = compiled_variants()
    # Same buckets (batch 4, prompt 16, new tokens 8), other values of the traced knobs.
    sampler.generate(random_prompts(rng, 4, max_len=15),
                     SamplingParams(temperature=1.2, top_k=50, top_p=0.5, max_new_tokens=7, seed=2))
    sampler.generate(random_prompts(rng, 4, min_len=10, max_len=12),
                     SamplingParams(temperature=0.3, top_k=2, top_p=0.99, max_new_tokens=8, seed=3))
    assert compiled_variants() == before
    # n = 2: 2 prompts x 2 samples fill the same 4 slots. The samples of a prompt share its one
    # prefill, so the prefill batch is 2 prompts (a 2-row program, new unless an earlier test
    # made it); decoding, admission and the page pool are the 4-slot programs already compiled.
    # A second n = 2 call with other prompts and knobs then compiles nothing at all.
    counts = sampler_programs()
    sampler.generate(random_prompts(rng, 2, min_len=10, max_len=12),
                     SamplingParams(temperature=0.3, top_k=2, top_p=0.99, max_new_tokens=8, seed=3, n=2))
    after = sampler_programs()
    new = {k: after[k] - counts[k] for k in counts if after[k] != counts[k]}
    assert new in ({}, {"prefill_pages": 1}), (counts, after)
    result = sampler.generate(random_prompts(rng, 2, max_len=15),
                              SamplingParams(temperature=1.1, top_k=9, top_p=0.7, max_new_tokens=6,
                                             seed=4, n=2))
    assert len(result.token_ids) == 4 and sampler_programs() == after


def sampler_programs() -> dict:
    """Compiled programs per device function of the sampler (their sum is compiled_variants)."""
    from ctopd_jax.rollout import paged_decode

    return {f: getattr(paged_decode, f)._cache_size()
            for f in ("decode_until_refill", "prefill_pages", "admit_newcomers", "new_pool")}


def test_sharded_on_mesh_equals_unsharded(llama, tmp_path):
    from ctopd_jax.mesh.device_mesh import make_mesh
    from ctopd_jax.models.weights import load_hf_checkpoint

    family, hf, model = llama
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    hf.save_pretrained(tmp_path)
    sharded, _ = load_hf_checkpoint(tmp_path, mesh=mesh)
    prompts = random_prompts(np.random.default_rng(5), 5, max_len=16)
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    want = JaxSampler(model, eos_ids=None, pad_id=0).generate(prompts, params)
    got = JaxSampler(sharded, eos_ids=None, pad_id=0, mesh=mesh).generate(prompts, params)
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(want.logprobs),
                               atol=1e-5)


def test_update_weights_is_a_pointer_swap(llama, tmp_path):
    """After update_weights (or an in-place param update) the next rollout uses new weights."""
    from flax import nnx

    family, hf, model = llama
    prompts = [[4, 5, 6, 7]] * 5
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    sampler = JaxSampler(model, eos_ids=None, pad_id=0)
    before = sampler.generate(prompts, params)
    other = nnx.clone(model)
    state = nnx.state(other, nnx.Param)
    nnx.update(other, jax.tree.map(lambda x: x * 1.5 + 0.01, state))
    sampler.update_weights(other)
    after = sampler.generate(prompts, params)
    assert after.logprobs != before.logprobs
    ref = response_logprobs(other, after.prompt_ids, after.token_ids)
    assert logprob_gap(after.logprobs, ref)["logprob_gap_max"] < 1e-4


def test_bad_inputs_get_clear_errors(llama):
    family, hf, model = llama
    sampler = JaxSampler(model, eos_ids=[1], pad_id=0)
    with pytest.raises(RolloutConfigError, match="prompts\\[1\\] is empty"):
        sampler.generate([[1, 2], []], SamplingParams())
    with pytest.raises(RolloutConfigError, match="outside the vocabulary"):
        sampler.generate([[1, 999]], SamplingParams())
    with pytest.raises(RolloutConfigError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(RolloutConfigError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(RolloutConfigError, match="max_position_embeddings"):
        sampler.generate([[1, 2]], SamplingParams(max_new_tokens=10_000))
    with pytest.raises(RolloutConfigError, match="eos_ids"):
        JaxSampler(model, eos_ids=[10_000])


@pytest.mark.slow  # ~45 s on 2 shared cores: compiles decode + prefill for 3 slot counts
def test_refilled_slots_equal_hf_and_one_batch(llama):
    """Samples stop at different steps (EOS) and free slots refill from the queue: with 2 slots
    for 7 samples the greedy outputs still equal HF generate per prompt, and seeded samples equal
    those of one 8-slot batch (the randomness follows the sample, not the slot)."""
    family, hf, model = llama
    prompts = random_prompts(np.random.default_rng(6), 7, max_len=16)
    free = JaxSampler(model, eos_ids=None, pad_id=0).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    # An EOS that stops some samples early and leaves others running to the length limit.
    eos = free.token_ids[0][2]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    refilled = JaxSampler(model, eos_ids=[eos], pad_id=0, max_batch_size=2,
                          refill_fraction=0.5).generate(prompts, greedy)
    assert refilled.stats["slots"] == 2 and refilled.stats["refills"] >= 3
    lengths = {len(t) for t in refilled.token_ids}
    assert len(lengths) > 1  # rows really finished at different steps
    for prompt, tokens in zip(prompts, refilled.token_ids):
        assert tokens == hf_greedy(hf, prompt, MAX_NEW, eos_id=eos)

    params = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=MAX_NEW, n=2, seed=9)
    one_batch = JaxSampler(model, eos_ids=[eos], pad_id=0, max_batch_size=16).generate(
        prompts[:4], params)
    slotted = JaxSampler(model, eos_ids=[eos], pad_id=0, max_batch_size=2).generate(
        prompts[:4], params)
    assert one_batch.stats["refills"] == 0 and slotted.stats["refills"] > 0
    assert slotted.token_ids == one_batch.token_ids
    assert slotted.finish_reasons == one_batch.finish_reasons
    np.testing.assert_allclose(np.concatenate(slotted.logprobs),
                               np.concatenate(one_batch.logprobs), atol=1e-5)  # float32 reassociation


def test_kv_cache_budget_sizes_the_page_pool_and_fails_in_one_line(llama):
    from ctopd_jax.models.kv_cache import page_pool_token_bytes

    family, hf, model = llama
    sampler = JaxSampler(model, eos_ids=None, pad_id=0, max_batch_size=4, page_size=16,
                         kv_cache_budget_gb=0.01)
    plan = sampler.plan(num_samples=100, longest_prompt=20, max_new_tokens=100)
    # 4 slots; a table row spans (prompt bucket 32 + new bucket 128) / 16 + 1 pages; the pool
    # is capped at what 4 full rows could use, far below the budget.
    assert (plan["slots"], plan["table_width"], plan["pages"]) == (4, 11, 44)
    cfg = model.cfg
    token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert page_pool_token_bytes(cfg) == token
    assert 44 * 16 * token < plan["bytes"] < 44 * 16 * token + 4 * (cfg.vocab_size * 4 + 2048)
    # A budget below one sample's pages (2 prompt + 1 tail + 7 new) is refused in one line.
    tight = JaxSampler(model, eos_ids=None, pad_id=0, max_batch_size=4, page_size=16,
                       kv_cache_budget_gb=(9 * 16 * token + 4 * (cfg.vocab_size * 4 + 1100)) / 1e9)
    with pytest.raises(RolloutConfigError) as err:
        tight.generate([[1] * 20] * 4, SamplingParams(max_new_tokens=100))
    message = str(err.value)
    assert "\n" not in message and "rollout.jax_kv_cache_budget_gb" in message
    assert "fewer than one sample" in message
    with pytest.raises(RolloutConfigError, match="kv_cache_budget_gb"):
        JaxSampler(model, eos_ids=None, kv_cache_budget_gb=0)
    with pytest.raises(RolloutConfigError, match="rollout.jax_page_size"):
        JaxSampler(model, eos_ids=None, page_size=0)


def test_the_prompt_check_is_one_function_for_every_engine():
    from ctopd_jax.rollout.base import check_prompts

    ok = check_prompts([[1, 2, 3], [4]], 10, 3, max_new_tokens=5, positions=(8, "the limit"))
    assert ok == [[1, 2, 3], [4]]
    with pytest.raises(RolloutConfigError, match=r"prompt \(3\) \+ max_new_tokens \(6\) exceeds the limit=8"):
        check_prompts([[1, 2, 3]], 10, max_new_tokens=6, positions=(8, "the limit"))
    with pytest.raises(RolloutConfigError, match="more than the engine's max prompt length 2"):
        check_prompts([[1, 2, 3]], 10, 2)
