"""Engine selection by name and the clear errors around it (no vLLM needed)."""
import sys

import pytest

from flax import nnx

from ctopd_jax.models import Decoder, tiny_llama, tiny_qwen2
from ctopd_jax.rollout import RolloutConfigError, RolloutEngine, make_rollout_engine
from ctopd_jax.rollout.jax_sampler import JaxSampler
from ctopd_jax.rollout.vllm_engine import VllmNotInstalledError


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
    # tiny_qwen2 has head_dim 32 with hidden 64 / 4 heads: vLLM's Qwen2 would use 16.
    with pytest.raises(RolloutConfigError, match="head_dim == hidden_size / num_heads"):
        make_rollout_engine("vllm", tiny(tiny_qwen2()), eos_ids=[2])
