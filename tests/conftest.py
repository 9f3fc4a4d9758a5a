"""Root test configuration: eight host CPU devices so sharded paths are exercised on CPU.

XLA reads the flag once, when jax is first imported, so it must be set before any test module
imports jax.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Tokenizer sides shared by the tokenization, alignment and demo tests. The real pair is built
# into the cache by `make test` (setup_assets); a direct pytest run builds it on first use.
import pytest  # noqa: E402


def _real_side(name):
    from ctopd_jax.tokenization.assets import cache_root
    from ctopd_jax.tokenization.side import cached_tokenizer_side

    if not (cache_root() / name / ".ready").is_file():
        from ctopd_jax.tokenization.setup_assets import setup_assets
        setup_assets()
    return cached_tokenizer_side(name)


@pytest.fixture(scope="session")
def qwen():
    return _real_side("qwen2.5")


@pytest.fixture(scope="session")
def llama():
    return _real_side("llama3")


@pytest.fixture(scope="session")
def tiny_bpe():
    from ctopd_jax.tokenization.side import cached_tokenizer_side
    return cached_tokenizer_side("tiny_bpe")


@pytest.fixture(scope="session")
def tiny_unigram():
    from ctopd_jax.tokenization.side import cached_tokenizer_side
    return cached_tokenizer_side("tiny_unigram")
