#!/usr/bin/env bash
# One node, 8 GPUs, FSDP over all of them: configs/paper_8gpu_strict_full.yaml (see its header for the checkpoint and data paths).
# Extra arguments go to the trainer, e.g. --resume or --set optimizer.lr=2e-6.
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
exec "$PY" -m ctopd_jax.train --config configs/paper_8gpu_strict_full.yaml "$@"
