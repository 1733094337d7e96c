# Everything a user types. The first `make` creates .venv and installs the project into it.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NPROC ?= 2
ARGS ?=

.PHONY: help venv train test lint clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(BIN)/.installed  ## create .venv with the project and its dev tools

train: venv  ## train the built-in default locally: NPROC processes (CPU or GPUs), ARGS="key=value ..."
	$(BIN)/torchrun --standalone --nproc-per-node=$(NPROC) -m trainer $(ARGS)

test: venv  ## run the test suite
	$(BIN)/pytest

lint: venv  ## ruff and mypy
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:  ## remove runs and caches (keeps .venv)
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
