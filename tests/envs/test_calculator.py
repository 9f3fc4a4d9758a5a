"""The calculator environment: safe arithmetic, refusals that are fast, final-answer reward."""
import time

import pytest

from ctopd_jax.data.prompts import Prompt
from ctopd_jax.envs import EnvConfigError, StepResult, make_environment, run_step


def _prompt(answer=None, source="math.jsonl:3"):
    extra = {} if answer is None else {"answer": answer}
    return Prompt(messages=({"role": "user", "content": "What is 6*7?"},), source=source,
                  extra=extra)


def _env(answer=None, **settings):
    env = make_environment("calculator", **settings)
    assert env.reset(_prompt(answer)) == ""
    return env


def _calc(env, expression):
    start = time.perf_counter()
    result = env.step(f"Let me compute. <calc>{expression}</calc>")
    elapsed = time.perf_counter() - start
    assert (result.reward, result.done) == (0.0, False)
    assert result.observation.startswith("<result>") and result.observation.endswith("</result>")
    return result.observation[len("<result>"):-len("</result>")], elapsed


# Expected values written by hand, not computed by the code under test.
VALUES = [
    ("7/2", "3.5"), ("8/2", "4"), ("2**10", "1024"), ("-(3)*4", "-12"), ("(1+2)*3", "9"),
    ("10//3", "3"), ("10%3", "1"), ("-7//2", "-4"), ("-7%3", "2"), ("1.5*2", "3"),
    ("0.1+0.2", "0.3"), ("1/3", "0.3333333333"), ("2**-1", "0.5"), ("+5", "5"),
    ("--5", "5"), ("2**3**2", "512"), ("1 + 2 * 3", "7"), ("  12  ", "12"),
    ("1e15", "1e+15"), ("1e14", "100000000000000"), ("2.5e-3", "0.0025"),
    ("10**30", "1" + "0" * 30), ("123456789*1000", "123456789000"), ("7.0//2", "3"),
    ("1000000**2", "1000000000000"), ("4**0.5", "2"),
]


@pytest.mark.parametrize("expression, expected", VALUES)
def test_values(expression, expected):
    assert _calc(_env(), expression)[0] == expected


REFUSED = [
    ("9**9**9", "exponent"), ("10**100", "exponent"), ("__import__('os')", "Call"),
    ("(1).__class__", "Attribute"), ("'a'*3", "str"), ("1/0", "division by zero"),
    ("5%0", "division by zero"), ("5//0.0", "division by zero"), ("0**-1", "division by zero"),
    ("1+" * 150 + "1", "200 characters"), ("(" * 60 + "1" + ")" * 60, "nested"),
    ("[1,2]", "List"), ("lambda: 1", "Lambda"), ("2 +* 3", "parse"), ("", "empty"),
    ("x + 1", "Name"), ("1 < 2", "Compare"), ("True + 1", "bool"), ("1j", "complex"),
    ("(-8)**(1/3)", "complex"), ("10**30 + 1", "too large"), ("10**20 * 10**20", "too large"),
    ("1234567**2", "too large"), ("1e308*10", "finite"), ("2.0**1000", "too large"),
    ("1" * 40, "too large"), ("-" * 70 + "1", "too complex"), ("{1: 2}", "Dict"),
    ("(1, 2)", "Tuple"), ("1 if 1 else 2", "IfExp"), ("1 << 3", "LShift"),
    ("1 & 3", "BitAnd"), ("~1", "Invert"), ("f'{1}'", "JoinedStr"),
]


@pytest.mark.parametrize("expression, reason", REFUSED)
def test_refusals_are_fast_error_observations(expression, reason):
    value, elapsed = _calc(_env(), expression)
    assert value.startswith("error: ")
    assert reason in value
    assert elapsed < 0.1


def test_300_character_expression_is_refused():
    expression = "1+" * 149 + "11"
    assert len(expression) == 300
    value, elapsed = _calc(_env(), expression)
    assert value.startswith("error: ") and elapsed < 0.1


def test_last_call_of_a_turn_is_evaluated():
    env = _env()
    result = env.step("<calc>1+1</calc> hmm, rather <calc>2*21</calc>")
    assert result == StepResult("<result>42</result>", 0.0, False)


def test_unclosed_trailing_call_counts_when_the_stop_text_was_stripped():
    env = _env()
    assert env.step("First <calc>1+1</calc>, then <calc>3*3") == StepResult(
        "<result>9</result>", 0.0, False)


@pytest.mark.parametrize("turn, answer, reward", [
    ("So 6*7 = 42. The answer is 42.", 42, 1.0),
    ("The answer is 41.", 42, 0.0),
    ("I think the answer is 40, no wait. The answer is 42", "42", 1.0),
    ("The answer is 42. Hmm, actually the answer is 43.", 42, 0.0),
    ("It is 42.", 42, 0.0),                                # no "The answer is"
    ("The answer is **42**.", 42, 1.0),
    ("The answer is: $1,234.", "1,234", 1.0),
    ("The answer is 3.5", 3.5, 1.0),
    ("The answer is 3.5000001", 3.5, 1.0),               # within 1e-6
    ("The answer is 3.50001", 3.5, 0.0),
    ("The answer is 4.0", 4, 1.0),
    ("The answer is 4", "4.0", 1.0),
    ("The answer is -12", -12, 1.0),
    ("The answer is 12", -12, 0.0),
    ("The answer is 10000000000000000000001", "10000000000000000000000", 0.0),  # exact ints
    ("The answer is 42.", None, 0.0),                     # the prompt has no answer
    ("The answer is 42.", "", 0.0),
])
def test_final_answer_reward(turn, answer, reward):
    assert _env(answer).step(turn) == StepResult("", reward, True)


def test_non_numeric_answer_column_is_a_config_error_naming_the_row():
    env = make_environment("calculator")
    with pytest.raises(EnvConfigError, match=r"math.jsonl:3.*answer"):
        env.reset(_prompt("forty-two"))


def test_max_calls_then_too_many_calls_ends_the_episode():
    env = _env(42, max_calls=2)
    assert _calc(env, "1+1")[0] == "2"
    assert _calc(env, "bad(")[0].startswith("error: ")   # refused calls count too
    assert env.step("<calc>3+3</calc>") == StepResult("<result>error: too many calls</result>",
                                                      0.0, True)


def test_default_max_calls_is_8():
    env = _env(42)
    for i in range(8):
        assert _calc(env, f"{i}+1")[0] == str(i + 1)
    assert env.step("<calc>1</calc>").done


def test_reset_clears_the_call_count_and_answer():
    env = _env(42, max_calls=1)
    _calc(env, "1+1")
    assert env.step("<calc>1+1</calc>").done
    env.reset(_prompt(7))
    assert _calc(env, "1+1")[0] == "2"                    # the call budget is back
    assert env.step("The answer is 7") == StepResult("", 1.0, True)
    env.reset(_prompt())
    assert env.step("The answer is 7") == StepResult("", 0.0, True)   # no stale answer


def test_step_after_the_end_is_reported_by_run_step():
    env = _env(42)
    env.step("The answer is 42")
    result = run_step(env, "The answer is 42", 5.0)
    assert result.done and result.reward == 0.0 and result.observation.startswith("error: ")


def test_through_run_step():
    env = _env(42)
    assert run_step(env, "<calc>6*7</calc>", 5.0) == StepResult("<result>42</result>", 0.0, False)
    assert run_step(env, "The answer is 42.", 5.0) == StepResult("", 1.0, True)


def test_a_malformed_number_is_refused_without_a_warning(recwarn):
    value, _ = _calc(_env(), "3and 4")   # Python warns "invalid decimal literal" parsing it
    assert value.startswith("error: ")
    assert not [w for w in recwarn if issubclass(w.category, SyntaxWarning)]
