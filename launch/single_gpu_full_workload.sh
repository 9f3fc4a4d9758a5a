#!/usr/bin/env bash
# configs/single_gpu_full_workload.yaml (see its header for the checkpoint and data paths).
# Extra arguments go to the trainer, e.g. --resume or --set optimizer.lr=2e-6.
# The XLA pool: 1 - vllm_gpu_memory_utilization (0.20) - 0.05 headroom (python -m ctopd_jax.plan).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.75}"
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
exec "$PY" -m ctopd_jax.train --config configs/single_gpu_full_workload.yaml "$@"
