"""Around a batch's finish: what it writes besides the results, how it is handed over, what follows it.

The runtime stores a batch's outcomes in one finish
(:meth:`~carpool.gpu_worker.runtime.WorkerRuntime._finish`: results write-once, acknowledgements,
report and task events). Around it: a failed request's failure goes to the rest of its chain in that
same finish (:func:`batch_chain_failures`, as Celery does); the finish is retried while Redis restarts,
since the results are computed (:func:`~carpool.redis_edge.retry.retrying`); the results it refused,
answered meanwhile by an earlier run, are counted (:func:`count_rejected`); and after it, the
callbacks, chains' next steps and error callbacks of the requests whose results it stored are
applied (:func:`apply_links`, :mod:`carpool.celery_edge.links`); the finish filed them in the links
outbox (:func:`filed_links`), so a worker that dies between the two leaves them to a coordinator.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import redis
from celery import Celery

from carpool.celery_edge import links
from carpool.celery_edge.results import FAILURE, SUCCESS
from carpool.codec import stored_form
from carpool.errors import DeadlineExceeded, described
from carpool.redis_edge.keys import REJECTED_WRITES
from carpool.redis_edge.retry import Retries
from carpool.wire import Links

log = logging.getLogger(__name__)

T = TypeVar("T")


def batch_chain_failures(
    entries: list[tuple[str, str, Any]], linked: dict[str, Links]
) -> list[tuple[str, str, Any]]:
    """The failures to store under the chain steps after each failed request (as Celery does)."""
    out: list[tuple[str, str, Any]] = []
    for task_id, state, value in entries:
        if state == FAILURE and task_id in linked:
            out += links.chain_failures(linked[task_id], value)
    return out


#: Failures a batch logs one by one (with their tracebacks); past this, one line counts the rest.
LOGGED_FAILURES = 5


def log_failures(task: str, batch_id: str, entries: list[tuple[str, str, Any]]) -> None:
    """Log the requests of a batch that failed, as a Celery worker logs a task that raised: at ERROR
    with the traceback, the task's name and the request's id (a deadline passed: at WARNING, no
    traceback); the first :data:`LOGGED_FAILURES`, then one line for the rest, so a batch of bad
    inputs does not flood the log."""
    failed = [(task_id, value) for task_id, state, value in entries if state == FAILURE]
    for task_id, exc in failed[:LOGGED_FAILURES]:
        if isinstance(exc, DeadlineExceeded):
            log.warning("Task %s[%s] failed: %s", task, task_id, described(exc))
        else:
            log.error("Task %s[%s] raised: %s", task, task_id, described(exc), exc_info=exc)
    if len(failed) > LOGGED_FAILURES:
        log.error(
            "batch %s: %d more requests of %s failed (%s)",
            batch_id,
            len(failed) - LOGGED_FAILURES,
            task,
            ", ".join(sorted({type(exc).__name__ for _, exc in failed[LOGGED_FAILURES:]})),
        )


def count_rejected(
    client: redis.Redis, stats_key: str, batch_id: str, writes: list[tuple[str, str, Any]], stored: list[int]
) -> None:
    """Count, in the stats hash, the results write-once refused: a second run of a request that
    was answered meanwhile. Only observability: the first answer stands either way."""
    kept = set(stored)
    refused = [w[0] for i, w in enumerate(writes, 1) if i not in kept]
    log.warning(
        "batch %s: %d result(s) not stored, answered already by an earlier run (first answer kept): %s",
        batch_id,
        len(refused),
        ", ".join(refused[:5]),
    )
    try:
        client.hincrby(stats_key, REJECTED_WRITES, len(refused))
    except redis.RedisError as exc:
        log.warning("could not count rejected writes: %s", exc)


def filed_links(
    task: str, entries: list[tuple[str, str, Any]], linked: dict[str, Links]
) -> list[tuple[int, str, bytes]]:
    """(1-based index, request id, outbox entry) of the requests :func:`apply_links` sends links for
    once their results are stored: what the links outbox keeps until they are sent. A request with
    only canvas ids (a chain's last step) sends nothing."""
    return [
        (i, task_id, links.outbox_entry(task, linked[task_id]))
        for i, (task_id, state, _) in enumerate(entries, 1)
        if task_id in linked and links.sends_on(linked[task_id], state)
    ]


def apply_links(
    app: Celery,
    backend: Any,
    task: str,
    entries: list[tuple[str, str, Any]],
    stored: list[int],
    linked: dict[str, Links],
    hostname: str | None = None,
) -> None:
    """Apply the callbacks, chains and error callbacks of the requests whose results this run
    stored (see :mod:`carpool.celery_edge.links`: after the results, which filed them in the links
    outbox), each send retried while Redis is unreachable, within one window for the batch."""
    send = Retries()
    unsent: list[tuple[str, str, Any]] = []
    for i in stored:
        if i > len(entries):  # a chain step's propagated failure
            continue
        task_id, state, value = entries[i - 1]
        request_links = linked.get(task_id)
        if request_links is None:
            continue
        try:  # one request's links do not stop the others'
            if state == SUCCESS:  # the next steps get the result as .get() returns it
                result = stored_form(value, backend.serializer)
                unsent += links.on_success(app, task_id, request_links, result, send)
            elif state == FAILURE:
                links.on_failure(app, task_id, task, request_links, value, hostname, send)
        except Exception:
            log.exception("request %s: applying its callbacks or error callbacks failed", task_id)
    if unsent:
        try:  # the results are stored: a failure here is the links' alone
            send(lambda: backend.store_many(unsent))
        except Exception:
            log.exception("storing the failures of %d links that could not be sent failed", len(unsent))
