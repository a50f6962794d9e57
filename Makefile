# Quick start: `make serve` (service on the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test lint serve proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,ref]'
	touch $(STAMP)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	@if command -v node >/dev/null 2>&1; then bash clients/node/run_test.sh; \
	else echo "node not found: skipping the Node.js client test"; fi

lint: setup
	$(VENV)/bin/ruff check .

serve: setup
	$(VENV)/bin/lucekv serve

proto: setup
	$(PY) -m lucekv.server.codegen

clean:
	rm -rf $(VENV) .pytest_cache
