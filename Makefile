# Everything runs from the project's own virtualenv (.venv), created by `make setup`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of this torch is what the machines provide; an unpinned torch would pull the
# registry's newest build with several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
# The suite starts hundreds of interpreters: the package's bytecode is compiled once first (an
# editable install compiles nothing, and PYTHONDONTWRITEBYTECODE may forbid caching it).
# It runs in two processes (pytest-xdist): most of its time is tests waiting on servers,
# not computing, so two at once fit two cores. A module, and the fleet tests, stay in one.
TEST_PROCS ?= 2
SYSTEM_PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)

.PHONY: setup run test lint protos bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(SYSTEM_PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

run: setup
	$(PY) examples/quickstart.py

test: setup
	$(PY) -m compileall -q torch_dataservice tests benchmarks examples > /dev/null
	$(PY) -m pytest -q -n $(TEST_PROCS) --dist loadscope

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

protos: setup
	$(PY) scripts/gen_protos.py

bench: setup
	$(PY) benchmarks/throughput.py --quick
