# The two commands a user needs: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-newest test-oldest lint clean

# pytest workers for the suites (pytest-xdist): most multi-process tests wait on each other
# more than they compute, so 2 workers fill 2 cores; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST_ARGS = -q -n $(TEST_WORKERS) --dist worksteal tests

# The oldest releases pyproject.toml allows; `make test-oldest` runs the suite against them.
OLDEST := jax==0.10.0 jaxlib==0.10.0 orbax-checkpoint==0.12.6 tensorstore==0.1.85 \
	flax==0.12.2 optax==0.2.6 grain==0.2.15 numpy==2.0.2 crc32c==2.4
OLDEST_VENV := .venv-oldest

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip check
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP) lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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
	$(OLDEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The newest releases `pyproject.toml` allows, on Python 3.12 (JAX >= 0.11 needs it): pyenv's
# newest 3.12 where pyenv is installed, else a `python3.12` on PATH; `make PY_NEWEST=...` overrides.
PY_NEWEST ?= $(shell v=$$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$$' | sort -t. -k3 -n | tail -n1); \
	if [ -n "$$v" ]; then PYENV_VERSION=$$v pyenv which python3.12; else command -v python3.12; fi)
NEWEST := jax jaxlib flax orbax-checkpoint tensorstore optax grain
NEWEST_VENV := .venv-newest

$(NEWEST_VENV)/.installed: pyproject.toml Makefile
	@test -n "$(PY_NEWEST)" || { echo "make test-newest needs Python 3.12: install it (pyenv install 3.12)" \
		"or name one with make test-newest PY_NEWEST=/path/to/python3.12" >&2; exit 1; }
	test -d $(NEWEST_VENV) || $(PY_NEWEST) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/pip install --quiet --upgrade pip
	$(NEWEST_VENV)/bin/pip install --quiet -e '.[dev]'
	$(NEWEST_VENV)/bin/pip install --quiet --upgrade $(NEWEST)
	$(NEWEST_VENV)/bin/pip check
	touch $@

test-newest: $(NEWEST_VENV)/.installed
	$(NEWEST_VENV)/bin/mypy
	$(NEWEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(NEWEST_VENV) build *.egg-info
