# torchrelay developer loop. `make demo` and `make test` create the virtual environment.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint format proto up down demo bench chaos conformance e2e clean

$(STAMP): pyproject.toml constraints/dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints/dev.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider tests

e2e: $(STAMP)
	TORCHRELAY_E2E=all $(BIN)/python -m pytest -p no:cacheprovider -m "e2e" tests

conformance: $(STAMP)
	TORCHRELAY_CONFORMANCE=all $(BIN)/python -m pytest -p no:cacheprovider tests/conformance

chaos: $(STAMP)
	TORCHRELAY_CHAOS=all $(BIN)/python -m pytest -p no:cacheprovider tests/chaos

lint: $(STAMP)
	$(BIN)/ruff check libs services tests
	$(BIN)/ruff format --check libs services tests
	$(BIN)/mypy --strict libs/torchrelay services

format: $(STAMP)
	$(BIN)/ruff check --fix libs services tests
	$(BIN)/ruff format libs services tests

proto: $(STAMP)
	$(BIN)/python -m services.protogen proto

up: $(STAMP)
	$(BIN)/torchrelay up

down: $(STAMP)
	$(BIN)/torchrelay down

demo: $(STAMP)
	$(BIN)/torchrelay demo

bench: $(STAMP)
	$(BIN)/pip install -q -c constraints/dev.txt -e '.[dev,bench]'
	$(BIN)/python -m tests.bench

clean:
	rm -rf $(VENV) .torchrelay bench-results
