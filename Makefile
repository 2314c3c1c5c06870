# moe-l2 — developer entry points. `make run` and `make test` work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MOE := $(VENV)/bin/moe-l2
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

# check-cuda's target GPU: Hopper (H100/H200) by default, a compile check that needs no GPU here;
# ARCH=native compiles for the GPU of this machine (one must be present).
ARCH ?= 90

.PHONY: install lock run test check lint format bench build-llama build-llama-vulkan check-cuda bench-gpu demo-model clean help

help:
	@echo "make install   create $(VENV) with moe-l2 and its dev tools, from the lock file (test, check and lint do)"
	@echo "make lock      re-resolve the lock files requirements/*.txt (UPGRADE=1: newest versions)"
	@echo "make run       start the stack locally (MODEL=path.gguf, else a generated demo model); installs no dev tools"
	@echo "make test      run the test suite (builds the CPU and Vulkan llama-servers on first use)"
	@echo "make check     the inner loop: the tests that need no llama build, no Docker, no Vulkan (~4 min)"
	@echo "make check-cuda  compile and link the CUDA llama-server for ARCH (default 90; ARCH=native on a GPU)"
	@echo "make bench-gpu   the GPU check: CUDA build, ds-v2-lite shape, offload benchmark"
	@echo "make lint      ruff check + format check, hadolint on the Dockerfiles, the import layers and cycles, the docs' names"
	@echo "make bench     the routing telemetry's cost: bench/telemetry_overhead.py (JSON in bench/results/)"

install: $(STAMP)

# The lock files (docs/dependencies.md): every package at its pinned version, every file checked
# against its hash, then the project itself, editable, with no resolution of its own
# (--no-deps) and built by the locked setuptools (--no-build-isolation). Two installs share the
# venv: the developer's (dev.txt: the stack and the dev tools, for test, check, lint) and the
# stack's alone (run.txt, for run: the same pins, none of the tools). torch is the local CPU
# build where pip's find-links holds one (the torch-cpu.txt constraint selects it); elsewhere it
# is PyPI's, whose CUDA libraries are locked apart (torch-cuda.txt). find-links: the environment's
# (PIP_FIND_LINKS) and pip's configuration's, as pip itself reads them.
LOCK := requirements/dev.txt
RUN_LOCK := requirements/run.txt
FIND_LINKS := $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
TORCH_LOCK := $(if $(wildcard $(addsuffix /torch-*+*.whl,$(FIND_LINKS))),\
	-c requirements/torch-cpu.txt,-r requirements/torch-cuda.txt)

# Debian 12's python3 has no ensurepip until `apt-get install python3-venv`: `-m venv` then prints
# ten lines and leaves a venv without pip behind. Checked first, so that it is one line and nothing
# is made (expanded only when a venv is to be made: $(error) stops make there). version() finds the
# pip wheel ensurepip installs, which a bare `import` of a leftover empty folder would not.
VENV_ERROR = $(PYTHON) cannot make a virtual environment (no ensurepip): apt-get install python3-venv
define make_venv
$(if $(shell $(PYTHON) -c 'import ensurepip, venv; ensurepip.version()' >/dev/null 2>&1 || echo no),\
	$(error $(VENV_ERROR)))
$(PYTHON) -m venv $(VENV)
endef

# dev.txt holds all of run.txt at the same pins: a developer's venv is also the stack's.
$(STAMP): pyproject.toml $(LOCK) $(lastword $(TORCH_LOCK))
	$(make_venv)
	$(PY) -m pip install --quiet --require-hashes -r $(LOCK) $(TORCH_LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $@ $(RUN_STAMP)

$(RUN_STAMP): pyproject.toml $(RUN_LOCK) $(lastword $(TORCH_LOCK))
	$(make_venv)
	$(PY) -m pip install --quiet --require-hashes -r $(RUN_LOCK) $(TORCH_LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $@

# Re-resolves requirements/*.txt after a change to pyproject.toml's dependencies or to
# requirements/torch.in, keeping the other pins; UPGRADE=1 takes every package's newest version.
lock: $(STAMP)
	$(PY) requirements/lock.py $(if $(UPGRADE),--upgrade)

build-llama: $(STAMP)
	$(MOE) build-llama

# The software GPU (docs/test-bed.md): Mesa's llvmpipe runs the Vulkan backend on the CPU.
build-llama-vulkan: $(STAMP)
	$(MOE) build-llama --vulkan

# Required before landing a patch that touches compiled GPU code (docs/test-bed.md): 30+ min cold on
# 2 cores, minutes with a warm ccache. The build first (its progress shows), then the link checks.
check-cuda: $(STAMP)
	$(MOE) build-llama --cuda --arch $(ARCH) --portable --test-hooks
	MOE_L2_TEST_CUDA_BUILD=1 MOE_L2_TEST_CUDA_ARCH='$(ARCH)' $(PY) -m pytest -q -rs tests/test_cuda_toolchain.py

# No $(STAMP): the GPU machine has no package index; gpu_check.sh sets Python up from .bench-gpu/
# (bench/gpu_setup.py, any python3 >= 3.11). BINARY=path[.xz]: a llama-server built elsewhere.
bench-gpu:
	bench/gpu_check.sh $(if $(LLVMPIPE),--llvmpipe) $(if $(BINARY),--binary $(BINARY)) $(GPU_CHECK_ARGS)

# The stack alone: no dev tool is installed for it (run.txt).
run: $(RUN_STAMP)
	$(MOE) up $(if $(MODEL),--model $(MODEL))

# The engines are built (or found in the cache) before pytest so their progress is visible. The
# Vulkan one needs its packages (docs/test-bed.md): without glslc a developer's run skips its tests,
# while CI (CI set) builds it anyway, so a missing package is an error there. After it, llvmpipe
# compiles the probe's pipelines into Mesa's shader cache, a step with its time (tests/llvmpipe_probe.py:
# a cold cache once outran the probe's bound and failed CI on a fresh machine, issue 42).
test: $(STAMP)
	$(MOE) build-llama --test-hooks
	$(MOE) build-llama --rpc --test-hooks
	$(if $(or $(CI),$(shell command -v glslc)),$(MOE) build-llama --vulkan --test-hooks && $(PY) -m tests.llvmpipe_probe)
	$(PY) -m pytest $(PYTEST_ARGS)

# The inner loop (README, "Which to run"): the tests that need no llama.cpp build, no Docker engine and no
# Vulkan, and are not marked slow. tests/selection.py marks every test that uses an engine build
# (llama_binary, rpc_binary, vulkan_binary), so a new one is left out without a mark by hand.
CHECK_MARKS := not llama and not vulkan and not containers and not cuda_build and not slow

check: $(STAMP)
	$(PY) -m pytest -q -m "$(CHECK_MARKS)" $(PYTEST_ARGS)

# Every Dockerfile, the stand-ins' included; .hadolint.yaml says why each ignored rule is ignored.
DOCKERFILES := $(wildcard services/*/Dockerfile tests/containers/standins/*.Dockerfile)

# lint-imports: pyproject.toml's contracts, the packages' layers and no import cycle among the modules
# (tests/import_cycles.py: a broken one lists every cycle, each import on it with its line).
# docs_check: every make target, moe-l2 subcommand and flag, and MOE_L2_* variable that README.md and
# docs/*.md name exists in the code (moe_l2_ops/docs_check.py), each stale one as file:line.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint --config .hadolint.yaml $(DOCKERFILES)
	$(VENV)/bin/lint-imports
	$(PY) -m moe_l2_ops.docs_check

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
