# prefillq: `make run` (the main job on the embedded default) and `make test`.
# Both create .venv and install the project with its worker and test extras first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
UNAME  := $(shell uname -s)

# MLX's Linux CPU wheel ships the reference BLAS (~45x slower): preload OpenBLAS, with its
# kernels named for this CPU (worker/blas.py says why). Evaluated by the shell at run time.
RUN_ENV = env $$($(BIN)/python -m worker.blas)
ifeq ($(UNAME),Linux)
BLAS_GLOB := /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
endif

.PHONY: install run test bench bench-quick lint system-deps clean

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

test: install
	$(RUN_ENV) $(BIN)/python -m pytest -q

bench: install
	$(BIN)/pip install --quiet -e ".[bench]"
	$(RUN_ENV) $(BIN)/python -m bench --json --plots docs/bench

bench-quick: install
	$(BIN)/pip install --quiet -e ".[bench]"
	$(RUN_ENV) $(BIN)/python -m bench --quick --json

lint: install
	$(BIN)/pip install --quiet ruff
	$(BIN)/ruff check model jobs worker tests

clean:
	rm -rf $(VENV) .pytest_cache
