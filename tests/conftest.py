"""Shared set-up. The producer-side Celery app reads CARPOOL_* at import, so the test session points
it at its own redis-server's address before anything imports ``carpool.celery_edge.app`` (unit tests may
import it first; they never connect). The integration fixture starts the server on that port, so no
test ever talks to a Redis on the default port that happens to run on the machine."""

from __future__ import annotations

import os

from hypothesis import settings

from carpool.tools.embedded import free_port

TEST_REDIS_PORT = free_port()
os.environ["CARPOOL_TEST_REDIS_PORT"] = str(TEST_REDIS_PORT)
os.environ["CARPOOL_BROKER_URL"] = f"redis://127.0.0.1:{TEST_REDIS_PORT}/0"
os.environ["CARPOOL_RESULT_BACKEND"] = f"redis://127.0.0.1:{TEST_REDIS_PORT}/1"

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

# Timing belongs in benchmarks: on a shared 2-core host an example may take seconds, which says
# nothing about the property checked (Hypothesis's default 200 ms deadline failed such runs).
settings.register_profile("carpool", deadline=None)
settings.load_profile("carpool")
