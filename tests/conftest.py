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
        from ctopd_jax.setup_assets import setup_assets
        setup_assets()
    return cached_tokenizer_side(name)


def _side_fixture(fixture: str, name: str, real: bool = False):
    """The session fixture `fixture`: the tokenizer side `name` (a real one built on first use)."""
    def side():
        from ctopd_jax.tokenization.side import cached_tokenizer_side
        return _real_side(name) if real else cached_tokenizer_side(name)
    return pytest.fixture(scope="session", name=fixture)(side)


qwen = _side_fixture("qwen", "qwen2.5", real=True)
llama = _side_fixture("llama", "llama3", real=True)
tiny_bpe = _side_fixture("tiny_bpe", "tiny_bpe")
tiny_unigram = _side_fixture("tiny_unigram", "tiny_unigram")
