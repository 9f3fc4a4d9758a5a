# Shared by the launchers: run from the repository root with its virtual environment.
# Extra arguments reach the trainer as written (--set optimizer.lr=2e-6, --resume, --debug).
# Exit status: 0 done, 2 bad input (one line), 3 diverged, 143/130 stopped by SIGTERM/SIGINT
# after checkpointing (rerun with --resume). CTOPD_DEBUG=1 shows tracebacks instead of one line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
# Let XLA use most of each GPU; vLLM takes its own share (rollout.vllm_gpu_memory_utilization).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.55}"
export TOKENIZERS_PARALLELISM=false
