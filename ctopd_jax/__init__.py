"""ctopd_jax: cross-tokenizer on-policy distillation in pure JAX (README.md).

Importing the package registers every objective, so `config` can read any `algorithm:`
section by name without importing the objectives itself.
"""
import sys as _sys

# Run as a command (`python -m ctopd_jax.<command>`): SIGTERM / SIGINT answer in one line from
# this first instruction on, before the heavy imports below (run_guard's module doc).
_argv = getattr(_sys, "orig_argv", [])
if "-m" in _argv[:-1] and _argv[_argv.index("-m") + 1].startswith("ctopd_jax"):
    from ctopd_jax.run_guard import install_startup_handlers

    install_startup_handlers(f"python -m {_argv[_argv.index('-m') + 1]}")

from ctopd_jax import algorithms  # noqa: F401,E402  (the objective registry)
