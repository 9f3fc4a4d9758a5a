"""Retrain the committed demo tokenizers (tiny_bpe, tiny_unigram) from generated text.

Same as ``python -m ctopd_jax.tokenization.train_small``; see that module for the choices.
"""
from ctopd_jax.tokenization.train_small import main

if __name__ == "__main__":
    main()
