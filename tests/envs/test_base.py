"""run_step cuts stuck and failing environments; make_environment's registry and errors."""
import time

import pytest

from ctopd_jax.envs import (ENVIRONMENTS, EnvConfigError, Environment, StepResult,
                            make_environment, run_step)


class _Sleepy:
    name, tool_stop = "sleepy", None

    def reset(self, prompt):
        return ""

    def step(self, text):
        time.sleep(5)
        return StepResult("late", 1.0, False)


class _Raises:
    name, tool_stop = "raises", None

    def __init__(self, error):
        self.error = error

    def reset(self, prompt):
        return ""

    def step(self, text):
        raise self.error


class _Echo:
    name, tool_stop = "echo", None

    def reset(self, prompt):
        return ""

    def step(self, text):
        return StepResult(f"you said {text}", 0.5, text == "bye")


def test_stuck_step_is_cut_at_the_timeout():
    start = time.perf_counter()
    result = run_step(_Sleepy(), "hi", 0.2)
    assert time.perf_counter() - start < 2.0
    assert result == StepResult("error: the environment did not answer within 0.2s", 0.0, True)


def test_exception_becomes_an_error_observation():
    result = run_step(_Raises(KeyError("boom")), "hi", 5.0)
    assert result == StepResult("error: KeyError: 'boom'", 0.0, True)


def test_long_multiline_exception_is_one_truncated_line():
    result = run_step(_Raises(ValueError("line one\nline two " + "x" * 500)), "hi", 5.0)
    assert "\n" not in result.observation
    assert len(result.observation) == 200
    assert result.observation.startswith("error: ValueError: line one line two xxx")
    assert (result.reward, result.done) == (0.0, True)


def test_timeout_error_raised_by_the_step_is_not_reported_as_a_timeout():
    result = run_step(_Raises(TimeoutError("socket")), "hi", 5.0)
    assert result.observation == "error: TimeoutError: socket"


def test_system_exit_and_wrong_return_type_do_not_escape():
    assert run_step(_Raises(SystemExit(3)), "hi", 5.0) == StepResult("error: SystemExit: 3", 0.0, True)

    class _Wrong(_Echo):
        def step(self, text):
            return "not a StepResult"

    result = run_step(_Wrong(), "hi", 5.0)
    assert result.done and result.reward == 0.0
    assert result.observation.startswith("error: TypeError:")


def test_normal_step_passes_through():
    assert run_step(_Echo(), "hello", 5.0) == StepResult("you said hello", 0.5, False)
    assert run_step(_Echo(), "bye", 5.0).done


def test_registry_builds_each_environment_fresh():
    assert set(ENVIRONMENTS) == {"calculator", "text_world"}
    for name in ENVIRONMENTS:
        env = make_environment(name)
        assert isinstance(env, Environment)
        assert env.name == name
        assert env is not make_environment(name)
    assert make_environment("calculator").tool_stop == "</calc>"
    assert make_environment("text_world").tool_stop is None
    assert make_environment("calculator", max_calls=3).max_calls == 3


def test_unknown_name_names_the_config_field_and_choices():
    with pytest.raises(EnvConfigError) as info:
        make_environment("chess")
    message = str(info.value)
    assert "rollout.environment" in message and "'chess'" in message
    assert "calculator" in message and "text_world" in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_bad_settings_are_config_errors():
    with pytest.raises(EnvConfigError, match="max_calls"):
        make_environment("calculator", max_calls=0)
    with pytest.raises(EnvConfigError, match="max_calls"):
        make_environment("calculator", max_calls="8")
    with pytest.raises(EnvConfigError, match="'speed'"):
        make_environment("text_world", speed=2)
