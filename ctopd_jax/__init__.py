"""ctopd_jax: cross-tokenizer on-policy distillation in pure JAX (README.md).

Importing the package registers every objective, so `config` can read any `algorithm:`
section by name without importing the objectives itself.
"""
from ctopd_jax import algorithms  # noqa: F401,E402  (the objective registry)
