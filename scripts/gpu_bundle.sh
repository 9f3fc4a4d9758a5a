#!/usr/bin/env bash
# Fill .gpu_bundle/ (git-ignored, ~20 MB) with what the GPU check needs on a machine with no
# network and no npm (the lent H200 image: Python 3.12, jax 0.11 with CUDA, torch, numpy):
#   .gpu_bundle/wheels/      the packages that image lacks, as Python 3.12 x86-64 wheels
#   .gpu_bundle/tokenizers/  the real Qwen2.5 / Llama-3 tokenizers (this machine's cache,
#                            JSON re-written without whitespace; the same tokenizers)
# Run here, on a CPU machine with pip and the tokenizer cache (`make assets` builds it), then:
#   carry .gpu_bundle, and on the GPU machine run `bash scripts/gpu_check.sh` (it installs the
#   wheels into /tmp/ctopd_site and points CTOPD_JAX_CACHE at the bundle when it finds one).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.gpu_bundle
PY="${PYTHON:-python3}"
# What the lent image lacks (flax: it has another version; the rest: not at all).
WHEELS=(flax==0.12.12 grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5)
CACHE="${CTOPD_JAX_CACHE:-$HOME/.cache/ctopd_jax}/tokenizers"
for name in qwen2.5 llama3; do
  if [ ! -f "$CACHE/$name/.ready" ]; then
    echo "gpu_bundle: the $name tokenizer is not in $CACHE; run 'make assets' first" >&2
    exit 2
  fi
done
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/wheels" "$BUNDLE/tokenizers"
echo '*' > "$BUNDLE/.gitignore"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$BUNDLE/wheels" "${WHEELS[@]}"
"$PY" - "$CACHE" "$BUNDLE/tokenizers" <<'PYEOF'
import json, shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for name in ("qwen2.5", "llama3"):
    (dst / name).mkdir(parents=True)
    for f in (src / name).iterdir():
        if f.name == "tokenizer.json":   # whitespace only: 27 MB -> 14 MB
            text = json.dumps(json.loads(f.read_text()), ensure_ascii=False, separators=(",", ":"))
            (dst / name / f.name).write_text(text)
        else:
            shutil.copy2(f, dst / name / f.name)
PYEOF
du -sh "$BUNDLE"
echo "gpu_bundle: ready; carry .gpu_bundle and run: bash scripts/gpu_check.sh"
