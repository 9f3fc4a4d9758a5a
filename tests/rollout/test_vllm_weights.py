"""The vLLM engine's weight path and GPU settings, without starting vLLM (torch + JAX only)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from _hf_tiny import load_pair
from ctopd_jax.models.weights import hf_named_tensors
from ctopd_jax.rollout.base import RolloutConfigError
from ctopd_jax.rollout.vllm_support import check_memory_split, platform_defaults
from ctopd_jax.rollout.vllm_weights import device_named_tensors


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # qwen2 is the tied-embedding case
def test_device_tensors_equal_the_host_name_table(family, tmp_path):
    """DLPack tensors carry the same names and values as the host export (the reference),
    lm_head included when tied, and cast to the engine dtype on the device."""
    import torch

    hf, model, cfg = load_pair(family, tmp_path)
    host = dict(hf_named_tensors(model, include_tied_lm_head=True))
    got = device_named_tensors(model, "float32")
    assert [n for n, _ in got] == list(host)
    assert cfg.tie_word_embeddings == (family == "qwen2")
    for name, tensor in got:
        np.testing.assert_array_equal(tensor.numpy(), host[name])
    # HF's own state dict agrees on names and shapes (lm_head tied to the embedding in qwen2).
    hf_state = hf.state_dict()
    for name, tensor in got:
        assert tuple(hf_state[name].shape) == tuple(tensor.shape)
        np.testing.assert_allclose(hf_state[name].numpy(), tensor.numpy(), rtol=0, atol=0)
    bf16 = dict(device_named_tensors(model, "bfloat16"))
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16
        want = torch.from_numpy(host[name].copy()).to(torch.bfloat16)
        assert torch.equal(tensor, want)


def test_device_tensors_alias_jax_buffers_without_a_copy(tmp_path):
    """The torch tensors handed to vLLM point at the JAX device buffers themselves (DLPack,
    no host round trip, no copy): checked pointer by pointer."""
    import torch

    from ctopd_jax.rollout.vllm_weights import device_hf_arrays

    hf, model, cfg = load_pair("qwen2", tmp_path)
    arrays = device_hf_arrays(model, "float32")
    tensors = [(name, torch.from_dlpack(value)) for name, value in arrays]
    for (name, value), (_, tensor) in zip(arrays, tensors):
        assert tensor.data_ptr() == value.unsafe_buffer_pointer(), name
        assert tuple(tensor.shape) == value.shape
    names = [n for n, _ in arrays]
    tied = dict(tensors)
    assert tied["lm_head.weight"].data_ptr() == tied["model.embed_tokens.weight"].data_ptr()
    assert len(names) == len(set(names))


def test_platform_defaults_and_memory_split():
    assert platform_defaults(False, None, "float32") == {"dtype": "bfloat16",
                                                         "enforce_eager": False}
    assert platform_defaults(True, None, "bfloat16") == {"dtype": "float32",
                                                         "enforce_eager": True}
    assert platform_defaults(True, "bfloat16", "float32")["dtype"] == "bfloat16"
    check_memory_split(0.5, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"})
    check_memory_split(0.2, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"})  # launch/ single GPU
    check_memory_split(0.9, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    with pytest.raises(RolloutConfigError) as err:
        check_memory_split(0.5, {})  # XLA's default 0.75 + 0.5
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.45" in str(err.value)
    assert "rollout.vllm_gpu_memory_utilization=0.5" in str(err.value)
    with pytest.raises(RolloutConfigError, match="vllm_gpu_memory_utilization"):
        check_memory_split(1.2, {})
