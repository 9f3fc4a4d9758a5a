"""benchmarks/trl_peer.py's own logic, without TRL: the steady-step statistic, the λ draws it
expects both trainers to take, and the two prompt files holding the same rows."""
import importlib.util
from pathlib import Path

import pytest

from ctopd_jax.algorithms.gkd import Gkd, GkdSettings
from ctopd_jax.data.prompts import load_response_prompts, response_text

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "trl_peer.py"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("trl_peer", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_steady_drops_the_warm_up_steps(peer):
    ends = [10.0, 15.0, 16.5, 17.0, 17.75]          # start, then the ends of steps 1..4
    assert peer.steady(ends, 2) == [0.5, 0.75]
    with pytest.raises(ValueError, match="raise --steps"):
        peer.steady(ends, 4)


def test_lambda_draws_are_the_objectives(peer):
    """The draws fed to TRL are the gkd objective's own, one per step (one micro-batch)."""
    settings = GkdSettings(gkd_lambda=0.5, gkd_seed=3, gkd_lambda_granularity="micro_batch")
    objective = Gkd(settings)
    ours = [objective.response_sources(1)[0] == "student" for _ in range(20)]
    assert peer.lambda_draws(3, 0.5, 20) == ours
    assert 0 < sum(ours) < 20


def test_both_prompt_files_hold_the_same_rows(peer, tmp_path):
    ours, trl = peer.write_prompts(tmp_path, 5)
    a, b = load_response_prompts(ours), load_response_prompts(trl)
    assert len(a) == len(b) == 5
    assert [p.messages for p in a] == [p.messages for p in b]
    assert [response_text(p) for p in a] == [response_text(p) for p in b]
    assert all(p.messages[-1]["role"] == "user" for p in a)


def test_trl_runs_at_its_fastest_settings(peer):
    """gradient_checkpointing on (TRL's default) makes GKDTrainer generate without a KV cache and
    recompute activations: the peer must run with it off, and with our hyper-parameters."""
    hyper = {"steps": 12, "batch": 4, "lmbda": 0.5, "beta": 0.5, "temperature": 0.9,
             "max_new_tokens": 32, "gkd_seed": 0, "lr": 3e-3, "betas": [0.9, 0.98],
             "weight_decay": 0.0, "max_grad_norm": 1.0, "min_lr": 1e-5, "warmup_steps": 1,
             "max_length": 128}
    args = peer.trl_args({"output_dir": "out", "seed": 3, "hyper": hyper})
    assert args["gradient_checkpointing"] is False
    assert (args["max_steps"], args["per_device_train_batch_size"], args["learning_rate"],
            args["lmbda"], args["beta"], args["max_new_tokens"]) == (12, 4, 3e-3, 0.5, 0.5, 32)

