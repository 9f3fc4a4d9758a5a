#!/usr/bin/env bash
# The GPU check: one staged run, each stage a subprocess with its own timeout, one JSON result
# per stage in $OUT (schema: the docstring of scripts/gpu_check.py), 8 minutes at most on a
# cold H200. Self-contained on a machine with jax (CUDA) preinstalled and no network, e.g. the
# lent H200 image (Python 3.12, jax 0.11): what that image lacks comes from .gpu_bundle/, made
# on a CPU machine by scripts/gpu_bundle.sh (wheels installed into /tmp/ctopd_site, the real
# tokenizers used from the bundle).
#
#   bash scripts/gpu_bundle.sh             # here, once: fills .gpu_bundle/ (carry it)
#   bash scripts/gpu_check.sh              # on the GPU machine; results in $OUT (or ./gpu_check_out)
#   bash scripts/gpu_check.sh --dry-run    # every stage at tiny shapes on the CPU (rehearsal)
#   bash scripts/gpu_check.sh --only e2e   # one or more stages (comma-separated)
#
# Stages, in order: env, e2e, e2e_pallas, strict_kernels, attention, train_step, sampler, compile_memory,
# pallas_tests (what each measures: scripts/gpu_check.py). Progress lines go to stderr as
# each part starts and ends.
# Exit status: 0 when every stage is ok, 1 when any failed or timed out (later stages still
# run), 2 when a package or the real tokenizers are missing, or on bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./gpu_check_out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
DRY=0; [[ " $* " == *" --dry-run "* ]] && DRY=1
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [ $DRY = 1 ] && PY=.venv/bin/python
if [ -d .gpu_bundle/wheels ] && [ $DRY = 0 ]; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/ctopd_site .gpu_bundle/wheels/*.whl >/tmp/ctopd_site.log 2>&1; then
    echo "gpu_check: .gpu_bundle/wheels do not install with $("$PY" -V 2>&1) here" \
         "(/tmp/ctopd_site.log); they are for Python 3.12 on x86-64: rerun scripts/gpu_bundle.sh" >&2
    exit 2
  fi
  export PYTHONPATH="/tmp/ctopd_site${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -d .gpu_bundle/tokenizers ] && [ -z "${CTOPD_JAX_CACHE:-}" ] && export CTOPD_JAX_CACHE="$PWD/.gpu_bundle"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
# What every stage imports, and (not in a dry run) the real tokenizers e2e trains with: one
# line naming the fix, exit 2, before any stage starts.
"$PY" - "$DRY" <<'PYEOF' || exit 2
import importlib, sys
missing = []
for module, package in (("jax", "jax"), ("flax", "flax==0.12.12"), ("optax", "optax"),
                        ("orbax.checkpoint", "orbax-checkpoint"), ("grain", "grain==0.2.18"),
                        ("tokenizers", "tokenizers"), ("safetensors", "safetensors"),
                        ("yaml", "pyyaml"), ("tensorboardX", "tensorboardX"), ("pytest", "pytest")):
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any import failure is a missing package here
        missing.append(f"{package} ({type(err).__name__})")
if missing:
    sys.exit(f"gpu_check: missing {', '.join(missing)}: run scripts/gpu_bundle.sh on a machine "
             f"with pip and carry .gpu_bundle")
if sys.argv[1] == "0":
    from ctopd_jax.tokenization.assets import cache_root
    absent = [n for n in ("qwen2.5", "llama3") if not (cache_root() / n / ".ready").is_file()]
    if absent:
        sys.exit(f"gpu_check: the real tokenizers {', '.join(absent)} are not in {cache_root()}: "
                 f"run scripts/gpu_bundle.sh where they are built (make assets) and carry .gpu_bundle")
PYEOF
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
fi
# 520 s: the driver's own 480 s budget plus start-up; the driver records each stage's result.
timeout 520 "$PY" scripts/gpu_check.py --out "$OUT_DIR" "$@"
