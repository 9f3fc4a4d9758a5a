"""benchmarks/trl_peer.py's own logic, without TRL: the steady-step statistic, the λ draws it
expects both trainers to take, and the two prompt files holding the same rows; and
benchmarks/trl_peer_gold.py's: GOLD's settings (its worker's GOLDConfig arguments) and its prompt
files."""
import importlib.util
import json
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



# benchmarks/trl_peer_gold.py (our topk_strict against TRL's GOLDTrainer on the real demo's pair)
# and its worker, whose module imports no torch or trl (the GOLDConfig arguments are a pure dict)
GOLD = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, GOLD / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gold_runs_at_its_fastest_settings_on_policy_and_cross_tokenizer():
    """No gradient checkpointing (SFTConfig's default is on: no KV cache in generate, activations
    recomputed), the KV cache on, float32, every step on-policy, ULD with the teacher's tokenizer,
    and our hyper-parameters, schedule included."""
    worker = _load("trl_peer_gold_worker")
    hyper = {"steps": 8, "batch": 32, "lr": 5e-5, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.0,
             "max_grad_norm": 1.0, "min_lr": 5e-6, "warmup_ratio": 0.05, "temperature": 1.0, "top_p": 1.0,
             "max_new_tokens": 16, "max_prompt_len": 64}
    args = worker.gold_args({"output_dir": "out", "seed": 0, "teacher": "T", "hyper": hyper})
    assert args["gradient_checkpointing"] is False and args["use_cache"] is True
    assert (args["bf16"], args["fp16"], args["use_vllm"], args["model_init_kwargs"]["dtype"]) == (
        False, False, False, "float32")
    assert (args["lmbda"], args["use_uld_loss"], args["teacher_tokenizer_name_or_path"]) == (1.0, True, "T")
    assert (args["max_steps"], args["per_device_train_batch_size"], args["gradient_accumulation_steps"],
            args["learning_rate"], args["max_completion_length"], args["temperature"], args["top_p"]) == (
        8, 32, 1, 5e-5, 16, 1.0, 1.0)
    assert (args["lr_scheduler_type"], args["lr_scheduler_kwargs"], args["warmup_steps"]) == (
        "cosine_with_min_lr", {"min_lr": 5e-6}, 1)   # ceil(8 x 0.05), as ours
    assert args["max_length"] - args["max_completion_length"] == 64   # GOLD's prompt budget


def test_gold_peer_prompt_files_hold_the_same_prompts(tmp_path, monkeypatch):
    """Ours' rows with data.system_prompt and GOLD's chat rows are the same conversations, in the
    same order, cycling the train file; GOLD's assistant turn is the answer (only its boundary is used)."""
    from ctopd_jax.data.prompts import load_prompts
    from ctopd_jax.demo import arithmetic

    monkeypatch.syspath_prepend(str(GOLD))
    peer = _load("trl_peer_gold")
    train, _ = arithmetic.write_files(tmp_path / "data", 60)
    rows = len(train.read_text().splitlines()) + 3
    ours, gold = peer.write_prompts(tmp_path / "work", train, rows)
    a = load_prompts(ours, "prompt", arithmetic.SYSTEM_PROMPT)
    b = [json.loads(line)["messages"] for line in gold.read_text().splitlines()]
    assert len(a) == len(b) == rows
    assert [list(p.messages) for p in a] == [m[:-1] for m in b]
    assert a[-1].messages == a[2].messages   # cycled
    answers = dict(arithmetic.problems())
    assert all(m[-1] == {"role": "assistant", "content": answers[m[1]["content"]]} for m in b)
    overrides = peer.ours_overrides({"teacher": "T", "student": "S", "ours_prompts": str(ours), "output_dir": "o",
                                     "seed": 0, "hyper": peer.hyper_params(8, 32)})
    assert "data.shuffle=false" in overrides and f"data.system_prompt={arithmetic.SYSTEM_PROMPT}" in overrides
