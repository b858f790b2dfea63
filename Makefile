# Two entry points that work on a fresh machine: `make demo` and `make test`.
# jax >= 0.11 needs Python >= 3.12: the first interpreter among these that really runs and is new enough
# (pyenv's shims exist for versions that are not active, so each candidate is tried).
PYTHON_CANDIDATES = python3.12 python3.13 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3
PYTHON312 ?= $(firstword $(foreach p,$(PYTHON_CANDIDATES),$(shell $(p) -c 'import sys; assert sys.version_info >= (3, 12); print(sys.executable)' 2>/dev/null)))
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= --disable-pip-version-check -q
# Where an NVIDIA driver answers, the CUDA plugin of JAX comes too (else the demo and the GPU tests
# would silently run the reference on CPU-only jax).
EXTRAS ?= $(if $(shell nvidia-smi -L 2>/dev/null),test$(comma)cuda13,test)
comma := ,
# pip -q hides the build's own output: say what the next minutes are (the kernel build also writes
# one line per compiled kernel to the terminal, when there is one: jax_kda/_aot/build.py).
INSTALL_NOTE = $(if $(filter 0,$(JAX_KDA_BUILD_KERNELS)),installing jax_kda without kernels (JAX_KDA_BUILD_KERNELS=0),installing jax_kda and its dependencies; its build compiles every GPU kernel ahead of time (a few minutes))

.PHONY: setup demo test test-gpu lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "need Python >= 3.12 (python3.12 on PATH or under ~/.pyenv)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	@echo "$(INSTALL_NOTE)"
	$(PY) -m pip install $(PIP_FLAGS) -e '.[$(EXTRAS)]'
	touch $@

demo: setup
	$(PY) -m jax_kda

# Tests in parallel processes (pytest-xdist), one per CPU core up to 8. Work stealing: each worker
# starts on one contiguous share of the tests (so a module's shared fixtures are mostly set up
# once) and takes over the end of another's share when it runs out. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= auto
test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 8 --dist worksteal

test-gpu: setup
	$(PY) -m pytest -q -m gpu

lint: setup
	$(PY) -m ruff check jax_kda tests benchmarks scripts

clean:
	rm -rf $(VENV) build *.egg-info
