"""Plain Celery doing nothing: the yardstick of ``carpool bench --accelerator``'s null pipeline.

    CARPOOL_BROKER_URL=redis://... CARPOOL_RESULT_BACKEND=redis://... \\
        celery -A carpool.tools.bench.noop_app worker -P solo

A Celery app of its own, not carpool's: Celery's defaults (JSON, the ``celery`` queue, results in
the Redis backend), one task ``noop(x): return x``, and the same Redis as carpool through the
``CARPOOL_BROKER_URL`` / ``CARPOOL_RESULT_BACKEND`` variables. What a Celery user gets for a task
that costs nothing is the rate carpool's own pipeline is compared with.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

NOOP_TASK = "carpool.bench.noop"


def noop(x: Any) -> Any:
    return x


def create_noop_app(broker_url: str, result_backend: str) -> Celery:
    """A plain Celery app on ``broker_url`` with :func:`noop` registered as :data:`NOOP_TASK`."""
    app = Celery("carpool-bench-noop", broker=broker_url, backend=result_backend, set_as_current=False)
    app.task(name=NOOP_TASK)(noop)
    return app


app = create_noop_app(
    os.environ.get("CARPOOL_BROKER_URL", "redis://localhost:6379/0"),
    os.environ.get("CARPOOL_RESULT_BACKEND", "redis://localhost:6379/1"),
)
