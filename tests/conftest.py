"""Shared set-up. The producer-side Celery app reads CARPOOL_* at import, so the test session points
it at its own embedded redis-server before anything imports ``carpool.celery_app``."""

from __future__ import annotations

import os

# Every model the integration stacks may serve; validation at .delay() accepts these.
os.environ.setdefault(
    "CARPOOL_MODELS",
    "toy,minilm,null,tests.integration.models:SlowToy,tests.integration.models:Exploding",
)
# Tests that want metrics pick a free port themselves; the default port may be taken.
os.environ.setdefault("CARPOOL_METRICS_PORT", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
