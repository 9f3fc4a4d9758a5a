#!/usr/bin/env bash
# GPU check for the strict kernels (issue 4). Self-contained on a machine with jax (CUDA) and
# torch (CUDA) preinstalled, e.g. the lent H200 (python 3.12, jax 0.11.x): nothing is installed.
#   1. the kernel tests with Pallas compiled (not interpreted) for the GPU;
#   2. pallas vs xla vs PyTorch timings at the real shapes (V_S 128,256, V_T 151,665,
#      V∩ 109,567, 2,048 rows), strict full and strict top-16, rkl.
# Usage: bash scripts/gpu_check.sh [rows]      (writes logs to $OUT if set, else ./gpu_check_out)
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./gpu_check_out}"
mkdir -p "$OUT_DIR"
ROWS="${1:-2048}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=cuda          # the tests' conftest only sets cpu when unset
export CTOPD_PALLAS_INTERPRET=0    # kernel-level tests compile Pallas too
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
$PY -c "import jax, torch; print('jax', jax.__version__, jax.devices()); print('torch', torch.__version__, torch.cuda.is_available())" | tee -a "$OUT_DIR/gpu.txt"

status=0
if $PY -c "import pytest" 2>/dev/null; then
  for backend in mosaic triton; do
    echo "== kernel tests, Pallas GPU backend: $backend" | tee -a "$OUT_DIR/tests.txt"
    CTOPD_PALLAS_GPU_BACKEND=$backend timeout 240 $PY -m pytest -q -p no:cacheprovider \
      tests/kernels/test_strict_pallas.py tests/kernels/test_strict_kd.py tests/test_losses.py \
      2>&1 | tail -40 | tee -a "$OUT_DIR/tests.txt" || status=1
  done
else
  echo "pytest is not installed here: skipping the test run, timings only" | tee "$OUT_DIR/tests.txt"
fi

echo "== timings (rows=$ROWS)" | tee "$OUT_DIR/bench.txt"
timeout 300 $PY scripts/gpu_bench.py --rows "$ROWS" 2>&1 | tee -a "$OUT_DIR/bench.txt" || status=1
exit $status
