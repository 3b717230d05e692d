# prefillq: `make run` (the main job on the embedded default) and `make test`.
# Both create .venv and install the project with its worker and test extras first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
UNAME  := $(shell uname -s)

# MLX's Linux CPU wheel ships the reference BLAS (~45x slower): preload OpenBLAS, with its
# kernels named for this CPU (model/runtime/blas.py says why). Evaluated by the shell at run time.
RUN_ENV = env $$($(BIN)/python -m model.runtime.blas)
ifeq ($(UNAME),Linux)
BLAS_GLOB := /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
endif

.PHONY: install run test test-long bench bench-quick bench-llama lint system-deps clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml | system-deps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

# OpenBLAS for MLX on Linux, and redis-server for the integration tests (Debian/Ubuntu).
system-deps:
ifeq ($(UNAME),Linux)
	@missing=""; \
	ls $(BLAS_GLOB) >/dev/null 2>&1 || missing="$$missing libopenblas0-pthread"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
endif

run: install
	$(RUN_ENV) $(BIN)/prefillq run

# PYTEST_ARGS narrows it: `make test PYTEST_ARGS=tests/jobs`, or `PYTEST_ARGS="-k cancel"`
test: install
	$(RUN_ENV) $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# only the long variants of the reliability and load tests (marked `long`), which `make test`
# leaves out (pyproject's addopts)
test-long: install
	$(RUN_ENV) $(BIN)/python -m pytest -q -m long

# Both write their JSON lines to a new bench/results/ file named for the minute (bench
# refuses to overwrite one); `make bench` also redraws the committed plots in docs/bench/
# (review the diff before committing it).
STAMP := $(shell date +%Y-%m-%dT%H%M)

bench: install bench-llama
	$(BIN)/pip install --quiet -e ".[bench]"
	$(RUN_ENV) $(BIN)/python -m bench --json --plots docs/bench \
	  --llama-python $(LLAMA_VENV)/bin/python --out bench/results/cpu-full-$(STAMP).jsonl

# llama.cpp for `over_llama_cpp`, built from source (native CPU flags, no llava) in its own
# benchmark-only venv: ~10 minutes on 2 cores, once. AMX is compiled out on x86-64: on
# VMs that list amx_* in /proc/cpuinfo without granting the tile state (this one), ggml's
# AMX matmul dies with SIGILL on its first `tilezero`.
LLAMA_VENV        := .venv-llama
LLAMA_CPP_PYTHON  ?= llama-cpp-python==0.3.36
ifeq ($(shell uname -m),x86_64)
LLAMA_CFLAGS      := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
endif
bench-llama: $(LLAMA_VENV)/.installed

$(LLAMA_VENV)/.installed:
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install --quiet --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CFLAGS="$(LLAMA_CFLAGS)" \
	  CXXFLAGS="$(LLAMA_CFLAGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(LLAMA_VENV)/bin/pip install --no-cache-dir --no-binary llama-cpp-python \
	  "$(LLAMA_CPP_PYTHON)"
	touch $@

bench-quick: install
	$(BIN)/pip install --quiet -e ".[bench]"
	$(RUN_ENV) $(BIN)/python -m bench --quick --json --out bench/results/cpu-quick-$(STAMP).jsonl

lint: install
	$(BIN)/pip install --quiet ruff
	$(BIN)/ruff check model jobs worker tokentext tests bench

clean:
	rm -rf $(VENV) $(LLAMA_VENV) .pytest_cache
