"""Tokenizer pairs: loading from disk, byte views, chat rendering, both-side re-tokenization
and the shared-vocabulary overlap map (SPEC §1.3, §2, §3)."""
from ctopd_jax.tokenization.assets import resolve_tokenizer_dir
from ctopd_jax.tokenization.chat import ChatTemplateError, render_chat
from ctopd_jax.tokenization.overlap import NoOverlapError, OverlapMap, overlap_map
from ctopd_jax.tokenization.retokenize import (IGNORE_INDEX, RetokenizedBatch, retokenize,
                                               retokenize_pair)
from ctopd_jax.tokenization.side import (TokenizerLoadError, TokenizerSide, cached_tokenizer_side,
                                         load_tokenizer_side)

__all__ = ["ChatTemplateError", "IGNORE_INDEX", "NoOverlapError", "OverlapMap",
           "RetokenizedBatch", "TokenizerLoadError", "TokenizerSide", "cached_tokenizer_side", "load_tokenizer_side",
           "overlap_map", "render_chat", "resolve_tokenizer_dir", "retokenize", "retokenize_pair"]
