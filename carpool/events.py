"""Per-request Celery task events, so every ``infer.delay()`` shows up in Flower as its own task.

Nobody runs ``carpool.infer`` as a Celery task, so nobody would send its events; the coordinator
sends ``task-received`` when it takes a request, the worker ``task-started`` and then
``task-succeeded``/``task-failed`` with the batch's run time. Events are buffered and published as
one list message per flush (Celery's ``task.multi``; Flower and ``celery events`` accept lists),
so a batch of 32 costs one publish, not 96. Events are telemetry: a failure to send is logged and
dropped, never allowed to stop serving.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from celery import Celery
from celery.utils.saferepr import saferepr

log = logging.getLogger(__name__)

TASK_NAME = "carpool.infer"
REPR_LIMIT = 200  # characters of a result or argument shown in Flower


class TaskEvents:
    def __init__(self, app: Celery, hostname: str, enabled: bool = True) -> None:
        self.enabled = enabled
        self.hostname = hostname
        self._app = app
        self._conn: Any = None
        self._dispatcher: Any = None
        self._pending = 0

    def _get(self) -> Any:
        if self._dispatcher is None:
            self._conn = self._app.connection_for_write()
            self._dispatcher = self._app.events.Dispatcher(
                self._conn, hostname=self.hostname, buffer_group=["task"], buffer_limit=100_000
            )
        return self._dispatcher

    def _send(self, type_: str, **fields: Any) -> None:
        if not self.enabled:
            return
        try:
            self._get().send(type_, **fields)
            self._pending += 1
        except Exception as exc:  # telemetry must never stop serving
            log.debug("could not buffer event %s: %s", type_, exc)

    def received(self, task_id: str, argsrepr: str, kwargsrepr: str = "{}") -> None:
        self._send(
            "task-received",
            uuid=task_id,
            name=TASK_NAME,
            args=argsrepr,
            kwargs=kwargsrepr,
            retries=0,
            eta=None,
            expires=None,
            root_id=task_id,
            parent_id=None,
        )

    def started(self, task_ids: Iterable[str]) -> None:
        for task_id in task_ids:
            self._send("task-started", uuid=task_id)

    def succeeded(self, task_id: str, result: Any, runtime_s: float) -> None:
        self._send("task-succeeded", uuid=task_id, result=saferepr(result, REPR_LIMIT), runtime=runtime_s)

    def failed(self, task_id: str, exc: BaseException, runtime_s: float | None = None) -> None:
        self._send(
            "task-failed",
            uuid=task_id,
            exception=saferepr(exc, REPR_LIMIT),
            traceback=None,
            runtime=runtime_s,
        )

    def flush(self) -> None:
        if not self._pending or self._dispatcher is None:
            return
        self._pending = 0
        try:
            self._dispatcher.flush()
        except Exception as exc:
            log.warning("could not publish task events (Flower will miss them): %s", exc)
            self.close()

    def close(self) -> None:
        if self._dispatcher is not None:
            try:
                self._dispatcher.close()
                self._conn.release()
            except Exception:  # already broken; we are letting go of it
                pass
        self._dispatcher = None
        self._conn = None
