"""SignalGuard (SIGTERM / SIGINT to this very process) and the DivergenceGuard's three rules."""
import io
import math
import os
import signal

import pytest

from ctopd_jax.common.run_guard import DivergenceGuard, SignalGuard, Stopped, exit_code_for


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_first_signal_sets_the_flag_second_exits_hard(sig, code):
    exits, stream = [], io.StringIO()
    previous = signal.getsignal(sig)
    with SignalGuard(hard_exit=exits.append, stream=stream) as guard:
        assert not guard.requested and guard.exit_code is None
        os.kill(os.getpid(), sig)
        assert guard.requested and guard.signum == sig and guard.exit_code == code
        assert exits == []                       # the loop finishes its step first
        os.kill(os.getpid(), sig)
        assert exits == [code]                   # a second signal: out at once
    assert signal.getsignal(sig) is previous     # handlers restored on exit
    lines = stream.getvalue().splitlines()   # the first signal has no line of its own (Stopped's)
    assert len(lines) == 1 and lines[0].startswith("second") and "without a checkpoint" in lines[0]


def test_stopped_carries_exit_code_and_one_line():
    err = Stopped(signal.SIGTERM, 7, "runs/x/checkpoints")
    assert err.exit_code == 143 == exit_code_for(signal.SIGTERM)
    assert str(err) == ("stopped by SIGTERM after step 7; checkpoint of step 7 saved in "
                        "runs/x/checkpoints; continue with --resume")


@pytest.mark.parametrize("metrics,words", [
    ({"loss": math.nan, "grad_norm": 1.0}, ["step 4", "loss not finite", "loss nan"]),
    ({"loss": 0.5, "grad_norm": math.inf}, ["grad_norm not finite", "grad norm inf"]),
    ({"loss": 0.5, "grad_norm": 1.0, "update_applied": 0}, ["refused the update", "loss 0.5"]),
])
def test_non_finite_values_stop_with_the_real_values(metrics, words):
    reason = DivergenceGuard().check(4, metrics)
    assert reason is not None and all(w in reason for w in words), reason


def test_zero_gradient_norm_for_n_steps_in_a_row():
    guard = DivergenceGuard(zero_grad_norm_steps=3)
    assert guard.check(1, {"loss": 1.0, "grad_norm": 0.0}) is None
    assert guard.check(2, {"loss": 1.0, "grad_norm": 0.0}) is None
    assert guard.check(3, {"loss": 1.0, "grad_norm": 0.5}) is None   # the run resets it
    assert guard.check(4, {"loss": 1.0, "grad_norm": 0.0}) is None
    assert guard.check(5, {"loss": 1.0, "grad_norm": 0.0}) is None
    reason = guard.check(6, {"loss": 1.0, "grad_norm": 0.0})
    assert reason.startswith("step 6: gradient norm 0.0 for 3 steps in a row (steps 4-6")
    assert DivergenceGuard(zero_grad_norm_steps=0).check(1, {"grad_norm": 0.0}) is None


def test_loss_jump_against_the_running_median():
    guard = DivergenceGuard(loss_jump_factor=10, loss_jump_window=4, loss_jump_warmup=3)
    assert guard.check(1, {"loss": 50.0, "grad_norm": 1}) is None   # no history yet: no judgement
    for step, loss in enumerate([1.0, 2.0, 1.5, 1.2], start=2):
        assert guard.check(step, {"loss": loss, "grad_norm": 1}) is None
    # the window holds the last 4 losses (1.0, 2.0, 1.5, 1.2; the early 50 has left): median 1.35
    reason = guard.check(6, {"loss": 14.0, "grad_norm": 1})
    assert reason is not None and reason.startswith("step 6: loss 14 is 10.4x the median 1.35")
    assert "guard.loss_jump_factor=10" in reason
    assert guard.check(7, {"loss": 13.0, "grad_norm": 1}) is None   # 13 / 1.35 < 10
    state = guard.state()
    fresh = DivergenceGuard(loss_jump_factor=10, loss_jump_window=4, loss_jump_warmup=3)
    fresh.restore(state)                                              # survives a resume
    assert fresh.check(8, {"loss": 200.0, "grad_norm": 1}) is not None


def test_guard_from_config_section():
    from ctopd_jax.config import load_config
    config = load_config(None, ["guard.zero_grad_norm_steps=2", "guard.loss_jump_factor=0"])
    guard = DivergenceGuard.from_config(config.guard)
    assert guard.zero_grad_norm_steps == 2 and guard.loss_jump_factor == 0
    assert guard.check(1, {"loss": 1.0, "grad_norm": 0.0}) is None
    assert "2 steps in a row" in guard.check(2, {"loss": 1e9, "grad_norm": 0.0})


def test_single_process_agreement_is_the_local_flag():
    with SignalGuard(hard_exit=lambda code: None, stream=io.StringIO()) as guard:
        assert guard.requested_everywhere() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested_everywhere() is True and guard.exit_code == 143
