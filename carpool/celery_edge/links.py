"""What Celery's tracer does after a task, done for carpool requests: callbacks, chains, error callbacks.

A carpool request is answered by a batch worker (or refused by the coordinator), never by Celery's
tracer, so its message's ``link`` / ``link_error`` / ``chain`` would otherwise be dropped. After the
request's result is stored, the process that stored it applies them as ``celery/app/trace.py`` and
``backend.mark_as_failure`` do:

- success: each callback gets ``apply_async((result,), parent_id=<request id>, root_id=...)`` (several
  as one group), then the chain's next step (its last element) gets the result and the rest of the chain;
- failure: the failure is stored under every remaining chain step's id too (so a chain's ``.get()``
  raises instead of waiting forever), and the error callbacks are called through the backend, which
  runs new-style ``(request, exc, traceback)`` ones in this process and sends the others as tasks.

Links are applied after the results are stored, outside the script that stores them: a process that
dies in between loses them (at most once). Only the run whose result was stored applies them, so a
request run twice (a rerun after recovery) does not apply them twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import Celery, group
from celery.app.task import Context
from celery.canvas import maybe_signature

from carpool.celery_edge import compat
from carpool.celery_edge.app import settings_of
from carpool.celery_edge.results import FAILURE
from carpool.errors import UnroutableLink
from carpool.wire import Links

log = logging.getLogger(__name__)

Entry = tuple[str, str, Any]  # (task id, state, result or exception), as the backend stores them


def chain_failures(links: Links | None, exc: BaseException) -> list[Entry]:
    """The failure entries Celery's ``mark_as_failure`` stores for the rest of a failed request's chain."""
    if not links:
        return []
    return _steps_failed(links.get("chain") or (), exc)


def _steps_failed(steps: Sequence[Any], exc: BaseException) -> list[Entry]:
    out: list[Entry] = []
    for step in steps:
        options = step.get("options") if isinstance(step, dict) else None
        task_id = options.get("task_id") if isinstance(options, dict) else None
        if isinstance(task_id, str) and task_id:
            out.append((task_id, FAILURE, exc))
    return out


def on_success(app: Celery, request_id: str, links: Links, result: Any) -> list[Entry]:
    """Apply ``links``' callbacks and the chain's next step with ``result``, as the tracer does.

    Returns failure entries for the chain's steps when its next step cannot be sent (a carpool step
    that refuses the result as its input, say): the caller stores them, so the chain's result says
    why instead of never coming.
    """
    root_id = links.get("root_id") or request_id
    callbacks = links.get("callbacks")
    if callbacks:
        try:
            _apply_callbacks(app, callbacks, result, request_id, root_id)
        except Exception:
            log.exception("request %s: applying its callbacks failed; they are lost", request_id)
    chain = links.get("chain")
    if not chain:
        return []
    try:
        step = _routed(app, maybe_signature(chain[-1], app=app))
        step.apply_async(
            (result,), chain=chain[:-1], parent_id=request_id, root_id=root_id, add_to_parent=False
        )
    except Exception as exc:
        log.warning("request %s: the chain's next step could not be sent: %s", request_id, exc)
        return _steps_failed(chain, exc)
    return []


def _apply_callbacks(app: Celery, callbacks: list[Any], result: Any, parent_id: str, root_id: str) -> None:
    options: dict[str, Any] = {"parent_id": parent_id, "root_id": root_id, "add_to_parent": False}
    signatures = [_routed(app, maybe_signature(sig, app=app)) for sig in callbacks]
    if len(signatures) == 1:
        signatures[0].apply_async((result,), **options)
        return
    # As the tracer: each group callback on its own, the other callbacks together as one group.
    for sig in signatures:
        if isinstance(sig, group):
            sig.apply_async((result,), **options)
    plain = [sig for sig in signatures if not isinstance(sig, group)]
    if plain:
        group(plain, app=app).apply_async((result,), **options)


def _routed(app: Celery, sig: Any) -> Any:
    """``sig``, or raise :class:`UnroutableLink` when it would go to the batch queue.

    The carpool app's default queue is the batch queue, so a task this process does not know (a plain
    Celery task whose module it does not import), sent without a queue of its own, would land where
    batch workers reject it as unregistered, and its caller would wait forever.
    """
    if isinstance(sig, group) or sig.task in app.tasks:
        return sig
    queue = app.amqp.router.route(dict(sig.options), sig.task, (), {})["queue"]
    if queue.name == settings_of(app).batch_queue:
        raise UnroutableLink(
            f"{sig.task!r} is not a task this process knows and the signature names no queue, so it "
            f"would go to the batch queue {queue.name!r}; give it its queue (sig.set(queue=...)) or "
            "import its module here (CARPOOL_IMPORTS)"
        )
    return sig


def on_failure(app: Celery, request_id: str, task_name: str | None, links: Links, exc: BaseException) -> None:
    """Call ``links``' error callbacks for the failed request ``request_id``, as the backend does."""
    errbacks = []
    for errback in links.get("errbacks") or ():
        try:
            _routed(app, maybe_signature(errback, app=app))
        except UnroutableLink as why:
            log.error("request %s: error callback not sent: %s", request_id, why)
            continue
        errbacks.append(errback)
    if not errbacks:
        return
    request = Context(
        id=request_id,
        task=task_name,
        errbacks=errbacks,
        root_id=links.get("root_id"),
        parent_id=links.get("parent_id"),
        delivery_info={},
    )
    try:
        compat.call_errbacks(app.backend, request, exc)
    except Exception:
        log.exception("request %s: calling its error callbacks failed", request_id)
