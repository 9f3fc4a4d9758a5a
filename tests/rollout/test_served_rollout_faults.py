"""The served rollouts' client (rollout/served.py) when its server misbehaves mid-batch, at the
client level against a stand-in answering in the shape recorded from vLLM (_rollout_stand_in.py;
a real vLLM runs only in the vllm lane). The rule is the served teacher's (transport.py):
- retried within rollout.retries, then the same samples as undisturbed: a restart (the server
  stops listening while the request is held unanswered, refuses connections for 1.2 s, then
  listens again on the same port) and an answer that is not JSON (a truncated body, a proxy's
  HTML page with 200);
- waited for, not retried: a slow answer (past the 1 s health probe, within rollout.timeout_s);
- one line naming rollout.url, and nothing more sent for that batch: fewer log-probs than tokens
  (JSON of the wrong shape, not retried: the same request gets the same answer), and answers
  that stay broken past the retries.
The trainer adds the step to resume from (a ServedRolloutError is a TeacherServiceError):
tests/trainer/test_served_faults.py runs that under training (slow lane).
Requests go one at a time (rollout.max_concurrency 1), so the fault lands on a known prompt.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from _rollout_stand_in import RolloutStandIn, sample_ids
from ctopd_jax.config import load_config
from ctopd_jax.models.weights import load_hf_checkpoint
from ctopd_jax.rollout import SamplingParams
from ctopd_jax.rollout.served import ServedRolloutEngine, ServedRolloutError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_cpu_served_rollouts.yaml"
STUDENT = ROOT / "ctopd_jax" / "assets" / "demo_char" / "student"
EOS, PAD = 2, 0
PROMPTS = [[5 + i, 40 + 3 * i, 17, 30 + i, 11] for i in range(3)]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=7)
RETRIES = 4   # backoff 0.1, 0.2, 0.4, 0.8 s: 1.5 s in all, past the restart's 1.2 s


@pytest.fixture(scope="module")
def served():
    """(engine, stand-in): the char student pushed to the stand-in, its log-prob check passed."""
    model, cfg = load_hf_checkpoint(STUDENT, dtype="float32")
    stand_in = RolloutStandIn(cfg.vocab_size)
    rollout = dataclasses.replace(load_config(CONFIG).rollout, url=stand_in.url, launch=False,
                                  launch_python="", max_concurrency=1, timeout_s=5.0,
                                  retries=RETRIES, backoff_s=0.1)
    engine = ServedRolloutEngine(model, EOS, PAD, rollout, dtype="float32", max_model_len=64)
    yield engine, stand_in
    engine.close()
    stand_in.close()


@pytest.fixture(scope="module")
def undisturbed(served):
    engine, stand_in = served
    result = engine.generate(PROMPTS, PARAMS)
    seeds = [body["seed"] for body in stand_in.scoring_requests[-len(PROMPTS):]]
    # the stand-in's own samples, prompt-major, n per prompt: the client changed nothing
    assert result.token_ids == [sample_ids(p, seed, j, PARAMS.max_new_tokens)
                                for p, seed in zip(PROMPTS, seeds) for j in range(PARAMS.n)]
    return result


@pytest.fixture
def stand_in(served):
    engine, stand_in = served
    stand_in.script[:] = []
    yield stand_in
    stand_in.script[:] = []


def generate_with(served, stand_in, *faults):
    """The batch with the second prompt's request faulting; (result, requests sent, actions)."""
    engine, _ = served
    stand_in.script[:] = ["ok", *faults]
    before = len(stand_in.scoring_requests)
    result = engine.generate(PROMPTS, PARAMS)
    return result, len(stand_in.scoring_requests) - before, stand_in.actions[before:]


def assert_same_samples(result, undisturbed):
    assert result.token_ids == undisturbed.token_ids
    assert result.logprobs == undisturbed.logprobs
    assert result.prompt_index == undisturbed.prompt_index
    assert result.finish_reasons == undisturbed.finish_reasons


@pytest.mark.parametrize("faults,extra", [
    pytest.param(["restart:1.2"], 1, id="restart"),
    pytest.param(["slow:1.3"], 0, id="slow"),
    pytest.param(["truncated", "html"], 2, id="not-json-twice")])
def test_a_transient_fault_is_retried_and_gives_the_same_samples(served, stand_in, undisturbed,
                                                                 faults, extra):
    probes = stand_in.health_checks
    result, sent, actions = generate_with(served, stand_in, *faults)
    assert actions[1: 1 + len(faults)] == faults
    assert sent == len(PROMPTS) + extra
    if faults[0].startswith("restart"):   # the retry came once the server listened again
        assert stand_in.scoring_requests[-2] == stand_in.scoring_requests[-3]
        assert stand_in.arrived[-2] >= stand_in.back_at
    if faults[0].startswith("slow"):      # the client asked whether it lived, and waited
        assert stand_in.health_checks > probes
    assert_same_samples(result, undisturbed)


@pytest.mark.parametrize("faults,words", [
    pytest.param(["short"], ["the vllm_server answer does not match the request (choice 0 has "
                             f"{PARAMS.max_new_tokens} token_ids but "
                             f"{PARAMS.max_new_tokens - 1} logprobs.token_logprobs); not "
                             "retried"], id="fewer-log-probs"),
    pytest.param(["html"] * (RETRIES + 1),
                 ["POST /v1/completions: the answer is not JSON (b'<html>",
                  f"(after {RETRIES} retries); its answers are broken"], id="never-json")])
def test_a_fault_that_stops_the_batch_is_one_line_naming_rollout_url(served, stand_in,
                                                                     undisturbed, faults, words):
    with pytest.raises(ServedRolloutError) as info:
        generate_with(served, stand_in, *faults)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"rollout.url {stand_in.url}: "), line
    for word in words:
        assert word in line, line
    # the first prompt, then the faulting one's tries; the third prompt is never sent
    assert stand_in.actions[-len(faults) - 1:] == ["ok", *faults]
    assert stand_in.scoring_requests[-1]["prompt"] == [PROMPTS[1]]
    stand_in.script[:] = []
    assert_same_samples(served[0].generate(PROMPTS, PARAMS), undisturbed)   # healthy again
