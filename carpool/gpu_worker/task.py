"""``carpool.run_batch``, the Celery task a GPU worker runs per micro-batch, and the worker's signals.

The work is :class:`~carpool.gpu_worker.runtime.WorkerRuntime`'s; this module registers it with
Celery (``carpool worker`` imports it) and starts and stops the runtime with the worker process.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals
from celery.platforms import EX_FAILURE
from celery.worker import state as worker_state

from carpool.celery_edge.app import app
from carpool.errors import CONFIG_ERROR_EXIT, ConfigError
from carpool.gpu_worker import control  # noqa: F401  (carpool's answers to rate_limit and time_limit)
from carpool.gpu_worker.runtime import WorkerRuntime
from carpool.names import RUN_BATCH_TASK

log = logging.getLogger(__name__)

_runtime: WorkerRuntime | None = None


def runtime() -> WorkerRuntime:
    """This process's runtime, built on first use (after the worker forked, if it does)."""
    global _runtime
    if _runtime is None:
        _runtime = WorkerRuntime(app)
    return _runtime


@app.task(name=RUN_BATCH_TASK, bind=True, ignore_result=True, acks_late=False, send_events=False)  # type: ignore[untyped-decorator]
def run_batch(self: Any, batch: Any) -> str:
    # Celery's own events for this task are off because its dispatcher publishes each one on its own;
    # the runtime sends the same ones inside the single publish that carries its requests' events.
    # The report goes back as text: Celery's saferepr of a returned dict, for its log line, is slow.
    # A batch handed to the device stage has no report yet: its task-succeeded event carries it later.
    # Batches that its claims took off the batch queue ran in this task too: said in its log line.
    worker = runtime()
    taken_before = worker.batches_taken
    report = worker.run(batch, self.request)
    outcome = "handed to the device stage" if report is None else repr(report)
    taken = worker.batches_taken - taken_before
    return f"{outcome}; batches its claims took: {taken}" if taken else outcome


class _NotReadyWhenStopping(logging.Filter):
    """Drops the "<hostname> ready." line Celery logs right after ``worker_ready``'s handlers when
    one of them failed to start the runtime: that worker is stopping, and an operator reading its
    log should not see it announce itself ready after its CRITICAL line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (worker_state.should_stop is not None and record.msg == "%s ready.")


logging.getLogger("celery.apps.worker").addFilter(_NotReadyWhenStopping())


@signals.worker_ready.connect  # type: ignore[untyped-decorator]
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    # Celery logs a signal handler's exception and goes on: a worker whose models failed to load
    # would stay up serving nothing, never heartbeating, and no supervisor would restart it.
    try:
        runtime().start(sender)  # the sender is Celery's consumer
    except ConfigError as exc:  # a deployment error, said in a line: its traceback is carpool's own
        log.critical(
            "this worker could not start serving: %s; it stops (exit status %d)", exc, CONFIG_ERROR_EXIT
        )
        worker_state.should_stop = CONFIG_ERROR_EXIT
    except Exception:
        log.critical(
            "this worker could not start serving; it stops (exit status %d)", EX_FAILURE, exc_info=True
        )
        worker_state.should_stop = EX_FAILURE


@signals.worker_shutting_down.connect  # type: ignore[untyped-decorator]
def _on_worker_shutting_down(**_: Any) -> None:
    # Sent from the signal handler, on the thread that may be running batches taken by claims.
    if _runtime is not None:
        _runtime.shutting_down()


@signals.worker_shutdown.connect  # type: ignore[untyped-decorator]
def _on_worker_shutdown(**_: Any) -> None:
    if _runtime is not None:
        _runtime.stop()
