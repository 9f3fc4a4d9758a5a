#!/usr/bin/env bash
# The GPU check: one staged run, each stage a subprocess with its own timeout, one JSON result
# per stage in $OUT (schema: the docstring of scripts/gpu_check.py), about 8 minutes at most on
# an H100/H200. Self-contained on a machine with jax (CUDA) preinstalled, e.g. the lent H200
# (python 3.12, jax 0.11.x): nothing is installed; the repository is imported from its checkout.
# That image's flax version is unread; flax 0.12.12 is the one verified with jax 0.11-0.12. To
# bring it: `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl
# flax==0.12.12` here, carry .whl, and start the command with `pip install -q --no-index
# --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site;` (kept on PYTHONPATH).
#
#   bash scripts/gpu_check.sh              # on the GPU machine; results in $OUT (or ./gpu_check_out)
#   bash scripts/gpu_check.sh --dry-run    # every stage at tiny shapes on the CPU (rehearsal)
#   bash scripts/gpu_check.sh --only env,strict_kernels
#
# Stages: env (copy GB/s, bf16 matmul TFLOP/s), strict_kernels (pallas vs xla at the real
# vocabularies), attention (einsum vs blockwise vs cuDNN), compile_memory (teacher scoring,
# student step, sampler vs bytes_limit), train_step (3B student: tokens/s, MFU), sampler
# (tokens/s), pallas_tests (tests/kernels compiled for the GPU).
# Exit status: 0 when every stage is ok, 1 when any failed or timed out (later stages still
# run), 2 on bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./gpu_check_out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [[ " $* " == *" --dry-run "* ]] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
fi
# 500 s: the driver's own 480 s budget plus start-up; the driver records each stage's result.
timeout 500 "$PY" scripts/gpu_check.py --out "$OUT_DIR" "$@"
