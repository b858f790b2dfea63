# Two entry points that work on a fresh machine: `make demo` and `make test`.
# jax >= 0.11 needs Python >= 3.12: use python3.12 from PATH, else pyenv's.
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= --disable-pip-version-check -q

.PHONY: setup demo test test-gpu lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "need Python >= 3.12 (python3.12 on PATH or under ~/.pyenv)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	$(PY) -m pip install $(PIP_FLAGS) -e '.[test]'
	touch $@

demo: setup
	$(PY) -m jax_kda

test: setup
	$(PY) -m pytest -q

test-gpu: setup
	$(PY) -m pytest -q -m gpu

lint: setup
	$(PY) -m ruff check jax_kda tests

clean:
	rm -rf $(VENV) build *.egg-info
