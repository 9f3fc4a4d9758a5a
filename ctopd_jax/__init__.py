"""ctopd_jax: cross-tokenizer on-policy distillation in pure JAX (README.md).

The objectives are found by their registry on first use (ctopd_jax/config/catalog.py).
"""
import sys as _sys

# Run as a command (`python -m ctopd_jax.<command>`): SIGTERM / SIGINT answer in one line from
# this first instruction on, before the heavy imports below (run_guard's module doc).
_argv = getattr(_sys, "orig_argv", [])
if "-m" in _argv[:-1] and _argv[_argv.index("-m") + 1].startswith("ctopd_jax"):
    from ctopd_jax.common.run_guard import install_startup_handlers

    install_startup_handlers(f"python -m {_argv[_argv.index('-m') + 1]}")
