# The two commands a user needs: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-oldest lint clean

# The oldest releases pyproject.toml allows; `make test-oldest` runs the suite against them.
OLDEST := jax==0.10.0 jaxlib==0.10.0 orbax-checkpoint==0.12.6 tensorstore==0.1.85 \
	flax==0.12.2 optax==0.2.6 grain==0.2.15 numpy==2.0.2 crc32c==2.4
OLDEST_VENV := .venv-oldest

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

$(OLDEST_VENV)/.installed: pyproject.toml Makefile
	test -d $(OLDEST_VENV) || $(PY) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install --quiet --upgrade pip
	$(OLDEST_VENV)/bin/pip install --quiet -e '.[dev]' $(OLDEST)
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -m pytest -q tests

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build *.egg-info
