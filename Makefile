# Two entry points on a fresh machine: `make demo` (the main job) and `make test`.
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: demo test lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lever-actors generate $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check lever_actors tests

bench: $(STAMP)
	$(VENV)/bin/lever-actors bench $(ARGS)
