# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
# The CPU torch wheel goes in first so the `torch>=2.2,<3` range is already met and pip does not
# fetch a multi-GB CUDA build; on a CUDA machine install the torch you want before `make`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: install demo test lint typecheck clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/carpool demo

test: install
	$(BIN)/pytest

lint: install
	$(BIN)/ruff check carpool tests
	$(BIN)/ruff format --check carpool tests

typecheck: install
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
