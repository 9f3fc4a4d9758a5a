#!/usr/bin/env bash
# The embedded CPU run (configs/tiny_cpu.yaml); 8 virtual CPU devices exercise the mesh code.
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
export JAX_PLATFORMS=cpu
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
exec "$PY" -m ctopd_jax.train --config configs/tiny_cpu.yaml "$@"
