# make train: install and train the tutorial's job.  make test: everything, slow tests too.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Not --no-compile: where PYTHONDONTWRITEBYTECODE=1 (this project's machines), every process
# would then compile torch from source at import (tried: the suite went from 5 to over 10 min).
PIP := $(BIN)/pip install --quiet --constraint constraints.txt
export OMP_NUM_THREADS ?= 1

.PHONY: install dev train test test-fast test-matrix lint docs reference bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Each install leaves a stamp: it runs again only when what it reads changed (a second
# `make test-fast` starts pytest at once instead of re-resolving every dependency).
$(VENV)/.installed-all: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[all]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[dev]'
	touch $@

install: $(VENV)/.installed-all

dev: $(VENV)/.installed-dev

train: install
	$(BIN)/ddptrain train

# Three test files at a time on 2 cores (pytest-xdist): a file's tests share its fixtures on one
# worker, and tests that wait by design (a silent store, a hang's --timeout) wait beside others'
# work: two files at a time left a third of the cores idle, four were slower (docs/development.md).
# --no-loadscope-reorder: the files go out in tests/conftest.py's order, the longest first (xdist
# otherwise sorts them by their number of tests). CI's .ci/suite_budget.py reads the output.
WORKERS ?= 3
test: dev lint docs  # the 25 slowest tests listed at the end: where the suite's time goes
	$(BIN)/pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

test-fast: dev  # the unit tests but the few slow ones: pure logic in this process, under 10 s
	$(BIN)/pytest -q -m 'not slow' tests/unit

# More of the combination matrix: make test-matrix N=200 SEED=7, or one case: make test-matrix CASE=<id>
N ?= 40
SEED ?= 1
test-matrix: dev
	MATRIX_N=$(N) MATRIX_SEED=$(SEED) MATRIX_CASE=$(CASE) $(BIN)/pytest -q tests/integration/test_matrix.py

lint: dev
	$(BIN)/ruff check src tests examples benchmarks docs
	$(BIN)/lint-imports  # the layers in pyproject.toml: dependencies point down, no cycles
	$(BIN)/mypy  # types, and unreachable code (pyproject.toml's [tool.mypy])

docs: dev  # the documentation site, into site/; --strict: a broken link or a page missing from the nav fails
	$(BIN)/python docs/make_reference.py --check  # the generated tables match the code (else: make reference)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

reference: dev  # rewrite docs/flags.md's and docs/reference.md's tables from the settings' and Task's help
	$(BIN)/python docs/make_reference.py

bench: install
	$(BIN)/ddptrain bench

clean:
	rm -rf $(VENV) runs site src/*.egg-info
