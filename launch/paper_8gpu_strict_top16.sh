#!/usr/bin/env bash
# configs/paper_8gpu_strict_top16.yaml (see its header for the checkpoint and data paths).
# Extra arguments go to the trainer, e.g. --resume or --set optimizer.lr=2e-6.
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
exec "$PY" -m ctopd_jax.train --config configs/paper_8gpu_strict_top16.yaml "$@"
