# Shared by the launchers: run from the repository root with its virtual environment.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
# Let XLA use most of each GPU; vLLM takes its own share (rollout.vllm_gpu_memory_utilization).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.55}"
export TOKENIZERS_PARALLELISM=false
