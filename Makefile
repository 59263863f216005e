# Two entry points on a fresh machine: `make demo` (the main job) and `make test`.
# The demo installs only what the library needs; the tests add the dev and bench extras.
# constraints.txt pins torch to the CPU build these machines carry.
VENV ?= .venv
PYTHON ?= python3
PIP := $(VENV)/bin/python -m pip install --quiet -c constraints.txt
CORE := $(VENV)/.installed-core
DEV := $(VENV)/.installed-dev
ARGS ?=
# two test processes (CI has two cores), the idle one taking tests queued for the other
TEST_WORKERS ?= 2

.PHONY: demo test lint bench

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip

$(CORE): pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) -e .
	touch $(CORE)

$(DEV): pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) -e '.[dev,bench]'
	touch $(CORE) $(DEV)

demo: $(CORE)
	$(VENV)/bin/lever-actors generate $(ARGS)

test: $(DEV)
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(ARGS)

lint: $(DEV)
	$(VENV)/bin/ruff check lever_actors tests benchmarks
	$(VENV)/bin/mypy

bench: $(DEV)
	$(VENV)/bin/lever-actors bench $(ARGS)
