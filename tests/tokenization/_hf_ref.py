"""transformers reference tokenizers, loaded once per test session (they take seconds)."""
import functools

from transformers import AutoTokenizer


@functools.lru_cache(maxsize=None)
def hf_reference(path: str):
    return AutoTokenizer.from_pretrained(path)
