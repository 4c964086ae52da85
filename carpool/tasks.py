"""Producer API: ``from carpool.tasks import infer; infer.delay("text").get()``.

Importing this module imports Celery and pydantic, never torch. ``.delay()`` validates the request
before it is sent (a bad one raises :class:`~carpool.errors.InvalidInput` in the caller) and stamps
the send time, so the coordinator measures waiting from the request's real arrival.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Task
from celery.result import AsyncResult

from carpool.celery_app import app, settings_of
from carpool.validation import bind_infer_args, validate_infer

SENT_AT_HEADER = "carpool_sent_at"


class InferTask(Task):
    """``carpool.infer`` with validation at the producer."""

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> AsyncResult:
        text, model = bind_infer_args(args, kwargs)
        validate_infer(text, model, settings_of(self.app))
        headers = dict(options.pop("headers", None) or {})
        headers.setdefault(SENT_AT_HEADER, time.time())
        return super().apply_async(args, kwargs, headers=headers, **options)


@app.task(base=InferTask, name="carpool.infer", bind=False)
def infer(text: str, model: str | None = None) -> Any:
    """Embed/run ``text`` on ``model`` (default: ``CARPOOL_MODEL``).

    Normally the coordinator takes these messages and a GPU worker runs them in batches; this body
    runs only when a plain Celery worker consumes the request queue (the one-task-per-request
    baseline that ``carpool bench`` compares against).
    """
    from carpool.gpu_worker.runner import run_single

    return run_single(model or settings_of(app).model, text)


__all__ = ["infer"]
