# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
# The CPU torch wheel goes in first so the `torch>=2.2,<3` range is already met and pip does not
# fetch a multi-GB CUDA build; on a CUDA machine install the torch you want before `make`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: install demo test lint typecheck check clean image

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
	$(BIN)/ruff check carpool tests scripts
	$(BIN)/ruff format --check carpool tests scripts

typecheck: install
	$(BIN)/mypy

# What CI runs before the compose stage: lint, types (package and tests), then every test.
check: lint typecheck test

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache $(EXTRAS)/wheels $(EXTRAS)/ca-bundle.pem

# `make image`: the image CI runs (docs/OPERATIONS.md). The torch `make install` would give this host
# goes into a wheelhouse in the build context and the image installs exactly that build (its version
# with any local label, e.g. +cpu); the image's pip trusts the CA bundle this host's pip trusts, so
# the build works behind a TLS-intercepting proxy and never fetches a torch the host would not. Set PYTHON_IMAGE for a base built without registry access (scripts/local-base-images.sh)
# and TORCH_INDEX_URL for torch from another index.
IMAGE ?= carpool:latest
PYTHON_IMAGE ?= python:3.11-slim
TORCH_INDEX_URL ?=
EXTRAS := docker/build-extras
PIP := $(if $(wildcard $(BIN)/pip),$(BIN)/pip,$(PY) -m pip)
CA_BUNDLE ?= $(or $(PIP_CERT),$(shell $(PIP) config get global.cert 2>/dev/null))

image:
	rm -rf $(EXTRAS)/wheels $(EXTRAS)/ca-bundle.pem
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version 3.11 --dest $(EXTRAS)/wheels \
		$(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") "$(TORCH)"
	$(if $(CA_BUNDLE),cp "$(CA_BUNDLE)" $(EXTRAS)/ca-bundle.pem)
	version=$$(basename $(EXTRAS)/wheels/torch-*.whl | cut -d- -f2) && \
	DOCKER_BUILDKIT=0 docker build -t "$(IMAGE)" --build-arg "PYTHON_IMAGE=$(PYTHON_IMAGE)" \
		--build-arg WHEELHOUSE=wheels --build-arg "TORCH_SPEC=torch==$$version" \
		$(if $(CA_BUNDLE),--build-arg CA_BUNDLE=ca-bundle.pem) .
