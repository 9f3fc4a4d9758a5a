"""Turn-structured rollouts (rollout/episodes.py, turns.py, host.token_batch): turns, masks,
the tool-stop cut, the budget and the turn cap, on a scripted engine and the real calculator."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctopd_jax.algorithms.turns import CONTEXT, STUDENT, Episode, episode_arrays, paragraph_turns
from ctopd_jax.collect.collector import token_batch
from ctopd_jax.envs import make_environment
from ctopd_jax.rollout.base import SamplingParams
from ctopd_jax.rollout.episodes import play
from ctopd_jax.tokenization import load_tokenizer_side

from scripted_engine import EOS, ScriptedEngine


@pytest.fixture(scope="module")
def side():
    return load_tokenizer_side("char")


def prompt(answer="408"):
    from ctopd_jax.data.prompts import Prompt   # not at import: the vLLM venv collects this file without grain

    return Prompt(({"role": "user", "content": "Compute 12 * 34."},), "test:1", {"answer": answer})


def text(side, ids):
    return side.decode(ids, skip_special_tokens=False)


def test_calculator_episode_masks_the_observation_and_cuts_at_the_tool_tag(side):
    engine = ScriptedEngine(side, [["<calc>12*34</calc> ignored tail", "The answer is 408." + EOS]])
    ep = play(engine, side, [prompt()], [[1, 2]], SamplingParams(max_new_tokens=200),
              environment=lambda: make_environment("calculator"), max_turns=4)[0]
    roles = [(s.role, text(side, s.ids)) for s in ep.segments]
    assert roles == [(STUDENT, "<calc>12*34</calc>"), (CONTEXT, "<result>408</result>"),
                     (STUDENT, "The answer is 408." + EOS)]
    assert ep.reward == 1.0 and ep.finish_reason == "stop"
    # the second turn saw the first turn (cut at the tag) and the observation as its context
    assert text(side, engine.calls[1][0][2:]) == "<calc>12*34</calc><result>408</result>"
    ids, trained, lps, known, turn = episode_arrays(ep)
    assert text(side, ids[~trained]) == "<result>408</result>"
    assert list(turn[trained]) == [0] * 18 + [1] * 19
    # rollout log-probs of the kept tokens are the engine's (the cut keeps their order)
    np.testing.assert_allclose(lps[:18], -(np.arange(18) + 1) / 100)
    assert known[trained].all()


def test_turn_cap_and_budget_end_the_episode_with_an_appended_eos(side):
    engine = ScriptedEngine(side, [["<calc>1+1</calc>", "<calc>2+2</calc>", "never"],
                                   ["The answer is" + " 1" * 50]])
    eps = play(engine, side, [prompt(), prompt()], [[1], [1]], SamplingParams(max_new_tokens=80),
               environment=lambda: make_environment("calculator"), max_turns=2)
    capped, cut = eps
    assert capped.finish_reason == "turns" and len(engine.calls) == 2
    # the cap ends the episode on its last turn (no observation nobody reads), closed by an EOS
    assert [(s.role, text(side, s.ids)) for s in capped.segments] == [
        (STUDENT, "<calc>1+1</calc>"), (CONTEXT, "<result>2</result>"), (STUDENT, "<calc>2+2</calc>" + EOS)]
    assert np.isnan(capped.segments[-1].logprobs[-1])
    assert cut.finish_reason == "length"
    ids, trained, _, known, _ = episode_arrays(cut)
    assert len(ids) == 81 and ids[-1] == side.eos_id and not known[-1] and known[:-1].all()


def test_single_turn_paragraphs_and_the_f2b_turn_limit(side):
    engine = ScriptedEngine(side, [["First step.\n\nSecond step.\n\nThe answer is 3." + EOS]])
    full = play(engine, side, [prompt("3")], [[1]], SamplingParams(max_new_tokens=100))[0]
    assert [text(side, s.ids) for s in full.segments] == ["First step.\n\n", "Second step.\n\n",
                                                          "The answer is 3." + EOS]
    limited = play(ScriptedEngine(side, engine.script), side, [prompt("3")], [[1]],
                   SamplingParams(max_new_tokens=100), turn_limit=2)[0]
    assert [text(side, s.ids) for s in limited.segments] == ["First step.\n\n", "Second step.\n\n" + EOS]
    assert limited.finish_reason == "turns"


def test_b2f_expert_turns_are_replayed_as_context(side):
    engine = ScriptedEngine(side, [["The answer is 408." + EOS]])
    ep = play(engine, side, [prompt()], [[1]], SamplingParams(max_new_tokens=100),
              environment=lambda: make_environment("calculator"), expert_turns=[["<calc>12*34</calc>"]])[0]
    assert [(s.role, text(side, s.ids)) for s in ep.segments] == [
        (CONTEXT, "<calc>12*34</calc>"), (CONTEXT, "<result>408</result>"), (STUDENT, "The answer is 408." + EOS)]
    assert ep.reward == 1.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(alphabet="ab \n", min_size=0, max_size=12), min_size=1, max_size=6))
def test_paragraph_turns_partition_the_tokens(pieces):
    """Every token has one turn; turns start at 0, never decrease, step by at most 1, and a new
    turn starts exactly after a blank line (brute force over the joined text)."""
    tokens = [p.encode() for p in pieces]
    turns = paragraph_turns(tokens)
    assert len(turns) == len(tokens) and (len(turns) == 0 or turns[0] == 0)
    assert np.all(np.diff(turns) >= 0) and np.all(np.diff(turns) <= 1)
    for i in range(1, len(tokens)):
        before = b"".join(tokens[:i]) + tokens[i][:len(tokens[i]) - len(tokens[i].lstrip())]
        opens = bool(tokens[i].strip()) and before.replace(b" ", b"").endswith(b"\n\n")
        assert (turns[i] == turns[i - 1] + 1) == opens


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([STUDENT, CONTEXT]), st.integers(1, 6)), min_size=1, max_size=7),
       st.integers(1, 5))
def test_no_context_token_is_ever_in_the_loss_mask(segments, prompt_len):
    """token_batch over random episodes: the loss rows predict exactly the student tokens, and
    the turns of the trained rows are consecutive student segments."""
    eos = 2
    ep = Episode(list(range(10, 10 + prompt_len)))
    next_id = 20
    for role, n in segments:
        ep.add(list(range(next_id, next_id + n)), role, [0.0] * n if role == STUDENT else None)
        next_id += n
    ep.add([eos], STUDENT, [0.0])
    ids, trained, _, _, turn = episode_arrays(ep)
    batch = token_batch(load_tokenizer_side("char"), [ep.prompt_ids], [ids], [trained], pad_to_multiple=8)
    predicted = batch.labels[0][batch.loss_mask[0]]
    student_ids = [t for s in ep.segments if s.role == STUDENT for t in s.ids]
    assert list(predicted) == student_ids
    assert batch.response_lens[0] == len(student_ids)
    assert list(turn[trained]) == [k for k, s in enumerate([s for s in ep.segments if s.role == STUDENT])
                                   for _ in s.ids]
