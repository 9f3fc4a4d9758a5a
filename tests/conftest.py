"""Root test configuration: eight host CPU devices so sharded paths are exercised on CPU.

XLA reads the flag once, when jax is first imported, so it must be set before any test module
imports jax.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
