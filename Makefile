# pdmesh: two commands for a newcomer (README.md): `make up` and `make test`.
# Each creates .venv when missing and installs what it needs; re-runs skip the install
# unless pyproject.toml changed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODEL ?= smollm2
ARGS ?=

.PHONY: up test test-fast test-compose lint bench clean venv

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed-run: $(VENV)/bin/python pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/bin/python pyproject.toml
	$(PIP) install -q -e '.[test,ucx]'
	touch $@ $(VENV)/.installed-run

venv: $(VENV)/.installed-run

## make up: embedded NATS + admission, prefill, decode, gateway on :8000 (TCP transport).
up: $(VENV)/.installed-run
	$(VENV)/bin/pdmesh up --model $(MODEL) --transport tcp $(ARGS)

## make lint: ruff with the rule set in pyproject.toml (part of `make test`).
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

## make test: lint, then the whole suite (slow-marked tests included), as CI runs it.
test: lint
	$(PY) -m pytest -q -ra --durations=15 $(ARGS)

test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -m "not slow" $(ARGS)

## make test-compose: build the image and run the lab stack for real under dockerd (root).
test-compose: $(VENV)/.installed-test
	bash compose/ci.sh

bench: $(VENV)/.installed-test
	$(VENV)/bin/pdmesh bench engine
	$(VENV)/bin/pdmesh bench transport
	$(VENV)/bin/pdmesh bench admission

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
