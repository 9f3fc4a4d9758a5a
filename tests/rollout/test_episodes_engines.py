"""Multi-turn episodes through both engines (rollout/episodes.py): greedy episodes of the same
model are the same turns, cuts and observations with the JAX sampler and with vLLM, and every
student token's rollout log-prob equals the model's own recomputation over the episode.

The JAX half runs in the default suite; the vLLM half is marked `vllm` (its own venv/process).
"""
from __future__ import annotations

import numpy as np
import pytest

from ctopd_jax.algorithms.turns import STUDENT
from ctopd_jax.envs import StepResult
from ctopd_jax.rollout import SamplingParams, make_rollout_engine
from ctopd_jax.rollout.episodes import play
from ctopd_jax.rollout.logprob_gap import response_logprobs
from ctopd_jax.tokenization import load_tokenizer_side

from _hf_tiny import load_pair

MAX_TURNS = 3
BUDGET = 24


class Echo:
    """A tool that answers any turn containing a frequent character: the model's random text
    stops at the tool tag often, so episodes have several turns."""
    name = "echo"

    def __init__(self, stop):
        self.tool_stop, self.turns = stop, 0

    def reset(self, prompt):
        self.turns = 0
        return ""

    def step(self, text):
        self.turns += 1
        return StepResult(f"[{self.turns}]", 0.0, False)


def prompt_ids():
    rng = np.random.default_rng(0)
    return [rng.integers(9, 100, n).tolist() for n in (5, 9, 12, 7)]


def episodes(engine, side, stop):
    return play(engine, side, [None] * 4, prompt_ids(),   # Echo reads no prompt
                SamplingParams(temperature=0.0, max_new_tokens=BUDGET),
                environment=lambda: Echo(stop), max_turns=MAX_TURNS)


def check_logprobs(model, side, eps):
    for ep in eps:
        full = [t for s in ep.segments for t in s.ids]
        recomputed = response_logprobs(model, [ep.prompt_ids], [full])[0]
        at = 0
        for s in ep.segments:
            if s.role == STUDENT and s.logprobs is not None:
                got = np.asarray(s.logprobs, np.float64)
                known = ~np.isnan(got)
                np.testing.assert_allclose(got[known], np.asarray(recomputed[at:at + len(s.ids)])[known],
                                           atol=2e-4)
            at += len(s.ids)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, model, _ = load_pair("llama", tmp_path_factory.mktemp("ep"), vocab_size=104, hidden_size=128,
                            intermediate_size=256)
    side = load_tokenizer_side("char")
    # the tool tag: the character in most of the model's greedy first turns
    jax_engine = make_rollout_engine("jax", model, eos_ids=[side.eos_id], pad_id=0)
    probe = jax_engine.generate(prompt_ids(), SamplingParams(temperature=0.0, max_new_tokens=BUDGET))
    texts = [side.decode(t) for t in probe.token_ids]
    stop = max(sorted(set("".join(texts))), key=lambda c: sum(c in t for t in texts))
    return model, side, stop, jax_engine


def test_jax_sampler_episodes(pair):
    model, side, stop, engine = pair
    eps = episodes(engine, side, stop)
    assert max(ep.student_turns for ep in eps) > 1, "the probe's tool tag should split some episode"
    for ep in eps:
        for s in ep.segments[:-1]:
            if s.role == STUDENT:
                assert stop in side.decode(s.ids) and side.decode(s.ids).endswith(stop) or s.ids[-1] == side.eos_id
    check_logprobs(model, side, eps)


@pytest.mark.vllm
def test_vllm_gives_the_same_episodes(pair):
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
    model, side, stop, jax_engine = pair
    vllm_engine = make_rollout_engine("vllm", model, eos_ids=[side.eos_id], pad_id=0, max_model_len=128)
    try:
        got = episodes(vllm_engine, side, stop)
    finally:
        vllm_engine.close()
    want = episodes(jax_engine, side, stop)
    assert [[(s.role, s.ids) for s in ep.segments] for ep in got] == \
        [[(s.role, s.ids) for s in ep.segments] for ep in want]
    check_logprobs(model, side, got)
