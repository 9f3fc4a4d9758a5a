"""episode_collector.EpisodeCollector on scripted engines: the host batch of turn-structured
episodes (trained rows, rollout log-probs, turns, rewards, TCOD's curriculum, SAGE's judge)."""
from __future__ import annotations

import numpy as np
import pytest

from ctopd_jax.algorithms import get_objective
from ctopd_jax.collect.episode_collector import EpisodeCollector
from ctopd_jax.common.metrics import StepTimer
from ctopd_jax.config import from_dict
from ctopd_jax.data.prompts import Prompt
from ctopd_jax.envs import make_environment
from ctopd_jax.tokenization import load_tokenizer_side

from scripted_engine import EOS, ScriptedEngine


@pytest.fixture(scope="module")
def side():
    return load_tokenizer_side("char")


def collector(side, name, script, *, environment="calculator", judge_script=None, n=1, budget=80, **settings):
    config = from_dict({"algorithm": {"name": name, **settings},
                        "rollout": {"environment": environment, "generate_max_len": budget, "n_samples_per_prompt": n}})
    obj = get_objective(config.algorithm)
    env = (lambda: make_environment(environment)) if environment else None
    judge = ScriptedEngine(side, judge_script) if judge_script is not None else None
    return EpisodeCollector(side, ScriptedEngine(side, script), config.rollout, obj, environment=env,
                            teacher_engine=judge), obj


def rows(answer, **extra):
    return Prompt(({"role": "user", "content": "Compute 12 * 34."},), "t:1", {"answer": answer, **extra})


def test_batch_trains_only_student_tokens_with_turns_and_rewards(side):
    c, obj = collector(side, "sod", [["<calc>12*34</calc>", "The answer is 408." + EOS],
                                     ["The answer is 7." + EOS]])
    host = c.collect([rows("408"), rows("408")], 0, StepTimer())
    assert list(host.student.response_lens) == [18 + 19, 17]
    np.testing.assert_array_equal(host.turns.turn, [0] * 18 + [1] * 19 + [0] * 17)
    np.testing.assert_array_equal(host.turns.rewards, [1.0, 0.0])
    np.testing.assert_array_equal(host.rollout_logprobs[1], 1.0)     # every student token was sampled
    labels = host.student.labels[0][host.student.loss_mask[0]]
    assert side.decode(labels, skip_special_tokens=False) == "<calc>12*34</calc>The answer is 408." + EOS
    arrays = obj.prepare(host, 0, 2)
    w = arrays.response_weight > 0
    np.testing.assert_array_equal(arrays.terms.turn_segment[w], [0] * 18 + [1] * 19 + [2] * 17)
    np.testing.assert_array_equal(arrays.terms.first_segment[w], [0] * 37 + [2] * 17)
    assert host.turn_stats["reward"] == 0.5 and host.turn_stats["student_turns"] == 1.5


def test_outcome_advantage_is_group_normalised(side):
    c, obj = collector(side, "sod", [["The answer is 408." + EOS], ["The answer is 1." + EOS]], n=2)
    host = c.collect([rows("408")], 0, StepTimer())
    np.testing.assert_allclose(host.turns.outcome, [1.0, -1.0], atol=1e-5)
    arrays = obj.prepare(host, 0, 2)
    w = arrays.response_weight > 0
    np.testing.assert_allclose(arrays.terms.outcome_advantage[w], [1.0] * 19 + [-1.0] * 17, atol=1e-5)


def test_tcod_b2f_replays_the_dataset_expert_prefix(side):
    expert = {"expert_turns": ["<calc>12*34</calc>", "The answer is 408."]}
    c, _ = collector(side, "tcod", [["The answer is 408." + EOS]], tcod_mode="b2f", tcod_period=5)
    host = c.collect([rows("408", **expert)], 0, StepTimer(), rollout_index=0)   # c(0) = 2 − 1 = 1
    context = c.engine.calls[0][0]
    assert side.decode(context, skip_special_tokens=False).endswith("<calc>12*34</calc><result>408</result>")
    assert list(host.student.response_lens) == [19] and host.turn_stats["expert_prefix_turns"] == 1.0
    c, _ = collector(side, "tcod", [["<calc>12*34</calc>", "The answer is 408." + EOS]], tcod_mode="b2f",
                     tcod_period=5)
    host = c.collect([rows("408", **expert)], 0, StepTimer(), rollout_index=5)   # c(5) = 0: plain OPD
    assert list(host.student.response_lens) == [37] and host.turn_stats["expert_prefix_turns"] == 0.0


def test_tcod_f2b_limits_the_turns(side):
    c, _ = collector(side, "tcod", [["<calc>1+1</calc>", "<calc>2+2</calc>"]], tcod_period=5)
    host = c.collect([rows("4")], 0, StepTimer(), rollout_index=4)    # k(4) = 1
    assert len(c.engine.calls) == 1 and host.turn_stats["turn_limit"] == 1
    assert host.finish_reasons == ["turns"]


def test_sage_teacher_judge_labels_each_turn(side):
    judge = [["Strong"], ["weak"], ["gibberish"]]   # one judge call per student turn, in order
    c, obj = collector(side, "sage_opd", [["<calc>12*34</calc>", "The answer is 408." + EOS],
                                          ["The answer is 7." + EOS]], judge_script=judge)
    host = c.collect([rows("408"), rows("408")], 0, StepTimer())
    np.testing.assert_array_equal(host.turns.judgment, [1.0] * 18 + [0.5] * 19 + [1.0] * 17)
    assert c.notes["sage_judge_labels"] == ["strong", "weak", "strong"]
    prompt = side.decode(c.teacher_engine.calls[0][1], skip_special_tokens=False)
    assert "Student step: The answer is 408." in prompt and "Feedback after the step: (none)" in prompt
    first = side.decode(c.teacher_engine.calls[0][0], skip_special_tokens=False)
    assert "Student step: <calc>12*34</calc>" in first and "Feedback after the step: <result>408</result>" in first


def test_text_world_episode_with_expert_prefix(side):
    """B2F over the text world: the first expert actions are replayed through the environment,
    the student plays the rest; the reward comes from the environment."""
    from ctopd_jax.envs.text_world import task_rows

    row = task_rows()[0]                      # take apple, go hall, drop apple
    prompt = Prompt(({"role": "user", "content": row["prompt"]},), "tw:1", dict(row))
    c, _ = collector(side, "tcod", [["drop apple" + EOS]], environment="text_world", tcod_mode="b2f",
                     tcod_period=5, budget=400)
    host = c.collect([prompt], 0, StepTimer(), rollout_index=0)     # c(0) = 3 − 1 = 2 actions replayed
    context = side.decode(c.engine.calls[0][0], skip_special_tokens=False)
    assert "take apple" in context and "go hall" in context and "drop apple" not in context
    np.testing.assert_array_equal(host.turns.rewards, [1.0])
    assert list(host.student.response_lens) == [len("drop apple") + 1]
