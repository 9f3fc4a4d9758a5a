#!/usr/bin/env bash
# configs/single_gpu_full_workload.yaml (see its header for the checkpoint and data paths).
# Extra arguments go to the trainer, e.g. --resume or --set optimizer.lr=2e-6.
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
exec "$PY" -m ctopd_jax.train --config configs/single_gpu_full_workload.yaml "$@"
