# moe-l2 — developer entry points. `make run` and `make test` work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MOE := $(VENV)/bin/moe-l2
STAMP := $(VENV)/.installed

.PHONY: install run test lint format bench build-llama demo-model clean help

help:
	@echo "make install   create $(VENV) with moe-l2 and its dev tools"
	@echo "make run       start the stack locally (MODEL=path.gguf, else a generated demo model)"
	@echo "make test      run the test suite (builds the patched llama-server on first use)"
	@echo "make lint      ruff check + format check"
	@echo "make bench     run the benchmarks under bench/ (JSON results in bench/results/)"

install: $(STAMP)

# torch is pinned first: an unpinned resolution pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[all,dev]'
	@touch $@

build-llama: $(STAMP)
	$(MOE) build-llama

run: $(STAMP)
	$(MOE) up $(if $(MODEL),--model $(MODEL))

# The engine is built (or found in the cache) before pytest so its progress is visible.
test: $(STAMP)
	$(MOE) build-llama
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(MOE) build-llama
	$(PY) bench/telemetry_overhead.py

demo-model: $(STAMP)
	$(MOE) make-demo-model models/demo.gguf

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
