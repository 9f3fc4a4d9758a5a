# Two commands do all the set-up: `make demo` (the main job) and `make test` (the suite).
# Each creates or reuses the virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ASSETS := $(HOME)/.cache/ctopd_jax/tokenizers/.ready

.PHONY: demo test test-fast test-vllm assets

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

assets: $(STAMP)
	$(PY) -m ctopd_jax.tokenization.setup_assets

demo: $(STAMP) assets
	$(PY) -m ctopd_jax.demo

test-fast: $(STAMP) assets
	$(PY) -m pytest -q

test: test-fast
