# The two commands that matter: `make demo` (the whole local stack) and `make test`.
# Both create .venv and install everything on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all lint format typecheck protos bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m inference_svc.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

protos: $(STAMP)
	$(BIN)/python -m protos.generate

# Each benchmark prints its table with ratios and writes JSON under benchmarks/results/.
BENCHES := bench_fetch bench_load bench_engine bench_kernels
bench: $(STAMP)
	for b in $(BENCHES); do $(BIN)/python -m benchmarks.$$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
