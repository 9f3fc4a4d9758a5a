import pytest

from ctopd_jax.tokenization.assets import cache_root
from ctopd_jax.tokenization.side import cached_tokenizer_side


def _real(name):
    if not (cache_root() / name / ".ready").is_file():
        from ctopd_jax.tokenization.setup_assets import setup_assets
        setup_assets()
    return cached_tokenizer_side(name)


@pytest.fixture(scope="session")
def qwen():
    return _real("qwen2.5")


@pytest.fixture(scope="session")
def llama():
    return _real("llama3")


@pytest.fixture(scope="session")
def tiny_bpe():
    return cached_tokenizer_side("tiny_bpe")


@pytest.fixture(scope="session")
def tiny_unigram():
    return cached_tokenizer_side("tiny_unigram")
