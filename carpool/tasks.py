"""Producer API: ``from carpool.tasks import infer; infer.delay("text").get()``.

Importing this module imports Celery and pydantic, never torch. ``.delay()`` validates the request
before it is sent (a bad one raises :class:`~carpool.errors.InvalidInput` in the caller) and stamps
the send time, so the coordinator measures waiting from the request's real arrival.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Task
from celery.result import AsyncResult
from redis.exceptions import RedisError

from carpool.celery_edge.app import app, settings_of
from carpool.names import INFER_TASK, SENT_AT_HEADER
from carpool.producer.submit import publish_tasks
from carpool.validation import bind_infer_args, validate_infer

log = logging.getLogger(__name__)


# apply_async options the direct publish handles exactly as Celery would; any other goes through Celery.
_DIRECT_OPTIONS = frozenset({"priority", "expires", "queue"})


class InferTask(Task):  # type: ignore[misc, unused-ignore]  # Celery is untyped
    """``carpool.infer`` with validation at the producer, and a cheaper publish.

    The message is the one Celery would send (built by
    :class:`carpool.celery_edge.task_messages.TaskMessageBuilder` from Celery's own
    ``create_task_message``), published with its task-sent event in one MULTI/EXEC on a kept Redis
    client: one round trip instead of kombu's two, each of which also builds a new ``redis.Redis``.
    Calls with other options (``countdown``, ``link``, ``task_id``...), eager mode, calls from inside
    a task (parent and root ids), or a failed direct publish (then Celery's publish retry policy
    applies) take Celery's own path.
    """

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> AsyncResult:
        text, model = bind_infer_args(args, kwargs)
        validate_infer(text, model, settings_of(self.app))
        headers = dict(options.pop("headers", None) or {})
        headers.setdefault(SENT_AT_HEADER, time.time())
        if (
            options.keys() <= _DIRECT_OPTIONS
            and not self.app.conf.task_always_eager
            and self.app.current_worker_task is None
        ):
            try:
                (result,) = publish_tasks(
                    self.name, [(args or (), kwargs or {})], app=self.app, headers=headers, **options
                )
                return result
            except RedisError as exc:
                log.info("direct publish failed (%s); sending through Celery, with its retries", exc)
        return super().apply_async(args, kwargs, headers=headers, **options)


@app.task(base=InferTask, name=INFER_TASK, bind=False)  # type: ignore[untyped-decorator, unused-ignore]
def infer(text: str, model: str | None = None) -> Any:
    """Embed/run ``text`` on ``model`` (default: ``CARPOOL_MODEL``).

    Normally the coordinator takes these messages and a GPU worker runs them in batches; this body
    runs only when a plain Celery worker consumes the request queue (the one-task-per-request
    baseline that ``carpool bench`` compares against).
    """
    from carpool.gpu_worker.runner import run_single

    return run_single(model or settings_of(app).model, text)


__all__ = ["infer"]
