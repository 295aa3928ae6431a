# `make` (= `make all` = `make check`) runs what CI runs: lint, types and the tests.
# The tests that need PostgreSQL and Redis skip when those are absent (they fail when CI=true).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: all check install dev lint types test

all: check

check: lint types test

install: $(VENV)/.installed

# Reinstall only when the dependencies may have changed.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev]'
	touch $@

dev: install
	$(BIN)/ratchet dev

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: install
	$(BIN)/mypy

test: install
	$(BIN)/pytest
