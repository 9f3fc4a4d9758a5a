"""Retrain the committed demo tokenizers (tiny_bpe, tiny_unigram) from generated text.

Same as ``python -m ctopd_jax.train_tokenizers``; see that module for the choices.
"""
from ctopd_jax.train_tokenizers import main

if __name__ == "__main__":
    main()
