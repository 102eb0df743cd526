# The two commands a user needs: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP) lint
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check jaxckpt tests examples
	$(BIN)/ruff format --check jaxckpt tests examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
