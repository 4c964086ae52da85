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

A callback, error callback or chain step that cannot be sent (a carpool task refusing its arguments)
has its failure stored under its own id, and a chain's
under the ids its result waits on, so whoever waits on it gets the error instead of waiting forever.

Links are applied after the results are stored, outside the script that stores them. A worker files
each linked request in the links outbox in that script (:func:`outbox_entry`) and empties the entry
once it sent the links; a worker that dies in between leaves the entry, and a coordinator sends those
links a lease later (:mod:`carpool.coordinator.outbox`): at least once, where a crash in between once
lost them. Only the run whose result was stored applies them, so a request run twice (a rerun after
recovery) does not apply them twice. A worker retries each send while Redis is unreachable (``send``),
within one window per batch: a send whose reply was lost may then be sent twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from celery import Celery, group
from celery.app.task import Context
from celery.canvas import maybe_signature
from kombu.utils import json as kombu_json

from carpool.celery_edge import compat
from carpool.celery_edge.app import settings_of
from carpool.celery_edge.options import CHORD_TASK, check_options, check_send_settings, check_step
from carpool.celery_edge.results import FAILURE, SUCCESS
from carpool.codec import loads_tagged
from carpool.errors import InvalidInput, UnsupportedOption, described
from carpool.redis_edge.connect import UNREACHABLE
from carpool.registry import spec_for
from carpool.wire import Links

log = logging.getLogger(__name__)

Entry = tuple[str, str, Any]  # (task id, state, result or exception), as the backend stores them
T = TypeVar("T")


def _once(call: Callable[[], T]) -> T:
    return call()


def sends_on(links: Links, state: str) -> bool:
    """Whether a request answered ``state`` has links to send: callbacks or a chain's next step on
    success, error callbacks on failure."""
    if state == SUCCESS:
        return bool(links.get("callbacks") or links.get("chain"))
    return state == FAILURE and bool(links.get("errbacks"))


def outbox_entry(task: str | None, links: Links) -> bytes:
    """What the links outbox keeps of a request: its task and links, as kombu's JSON writes them (a
    value it tags, a datetime or UUID in a link's arguments, reads back as itself)."""
    text: str = kombu_json.dumps({"task": task, "links": links})  # type: ignore[no-untyped-call]  # untyped
    return text.encode()


def read_outbox_entry(entry: bytes | str) -> tuple[str | None, Links]:
    """The task and links :func:`outbox_entry` wrote."""
    value = loads_tagged(entry)
    return value["task"], value["links"]


def chain_failures(links: Links | None, exc: BaseException) -> list[Entry]:
    """The failure entries Celery's ``mark_as_failure`` stores for the rest of a failed request's chain."""
    if not links:
        return []
    return _steps_failed(links.get("chain") or (), exc)


def _steps_failed(steps: Sequence[Any], exc: BaseException) -> list[Entry]:
    """``exc`` as the failure of each step and of every id a result of the step waits on."""
    ids: dict[str, None] = {}  # ordered, without repeats
    for step in steps:
        _result_ids(step, ids)
    return [(task_id, FAILURE, exc) for task_id in ids]


def _result_ids(step: Any, into: dict[str, None]) -> None:
    """Add the step's own id and, for a canvas, the ids its result waits on: a group's members', a
    chain's steps', a chord's header and body (a chain's result holding a chord waits on the body's)."""
    if isinstance(step, list | tuple):  # a chord's header before it is frozen into a group
        for member in step:
            _result_ids(member, into)
        return
    if not isinstance(step, Mapping):
        return
    options = step.get("options")
    task_id = options.get("task_id") if isinstance(options, Mapping) else None
    if isinstance(task_id, str) and task_id:
        into[task_id] = None
    kwargs = step.get("kwargs")
    if not isinstance(kwargs, Mapping):
        return
    task = step.get("task")
    if task == CHORD_TASK:
        _result_ids(kwargs.get("header"), into)
        _result_ids(kwargs.get("body"), into)
    elif task in ("celery.group", "celery.chain"):
        _result_ids(kwargs.get("tasks"), into)  # a list of members (anything else holds no id)


def on_success(
    app: Celery, request_id: str, links: Links, result: Any, send: Callable[[Callable[[], Any]], Any] = _once
) -> list[Entry]:
    """Apply ``links``' callbacks and the chain's next step with ``result``, as the tracer does;
    ``send(call)`` makes each sending call (retrying it while Redis is unreachable, on a worker).

    Returns failure entries for the callbacks that cannot be sent, and for the chain's steps when its
    next step cannot be (a carpool task that refuses the result as its input, say): the caller stores
    them, so the callback's or the chain's result says why instead of never coming; so do those that
    Redis did not take while ``send`` retried (stored if a server takes them: the results' own, say).
    """
    root_id = links.get("root_id") or request_id
    # task_inherit_parent_priority: the tracer sends the next steps at the request's own priority.
    inherited: dict[str, Any] = {}
    if app.conf.task_inherit_parent_priority and "priority" in links:
        inherited["priority"] = links["priority"]
    failed: list[Entry] = []
    callbacks = links.get("callbacks")
    if callbacks:
        signatures, failed = _sendable(app, request_id, "callback", callbacks, (result,))
        try:
            send(lambda: _apply_callbacks(app, signatures, result, request_id, root_id, inherited))
        except UNREACHABLE as exc:
            log.error("request %s: its callbacks could not be sent, Redis unreachable (%s)", request_id, exc)
            failed += _steps_failed(signatures, exc)
        except Exception:
            log.exception("request %s: applying its callbacks failed; they are lost", request_id)
    chain = links.get("chain")
    if not chain:
        return failed
    try:
        step = maybe_signature(chain[-1], app=app)
        # carpool.run_batch, as the step or in what it would send in turn (its own links), refused
        check_step(app, f"the chain's step {step.task}", dict(step))
        send(
            lambda: step.apply_async(
                (result,),
                chain=chain[:-1],
                parent_id=request_id,
                root_id=root_id,
                add_to_parent=False,
                **inherited,
            )
        )
    except UNREACHABLE as exc:
        log.error(
            "request %s: the chain's next step could not be sent, Redis unreachable (%s)", request_id, exc
        )
        return failed + _steps_failed(chain, exc)
    except Exception as exc:
        log.warning("request %s: the chain's next step could not be sent: %s", request_id, exc)
        return failed + _steps_failed(chain, exc)
    return failed


def _sendable(
    app: Celery, request_id: str, kind: str, signatures: Sequence[Any], args: tuple[Any, ...]
) -> tuple[list[Any], list[Entry]]:
    """The signatures that can be sent with ``args``, and failure entries for the others.

    Sending one that is refused would raise part-way through the group the others go in, so each is
    checked first (as :class:`~carpool.tasks.BatchedTask` checks a carpool task's call), and one that
    fails has its failure stored under its ids, as a chain step's is.
    """
    kept: list[Any] = []
    failed: list[Entry] = []
    for raw in signatures:
        try:
            sig = maybe_signature(raw, app=app)
            why = _refusal(app, sig, args)
        except Exception as exc:  # a signature Celery cannot rebuild (an unknown subtask_type, say)
            sig, why = raw, InvalidInput(f"the {kind} could not be read as a signature: {described(exc)}")
        if why is None:
            kept.append(sig)
            continue
        task = sig.get("task") if isinstance(sig, Mapping) else None
        log.warning("request %s: %s %s not sent: %s", request_id, kind, task, why)
        failed += _steps_failed([sig], why)
    return kept, failed


def _refusal(app: Celery, sig: Any, args: tuple[Any, ...]) -> Exception | None:
    """Why ``sig`` applied with ``args`` would not be sent, or None (the checks sending it makes)."""
    if isinstance(sig, group):
        for member in sig.tasks:
            why = _refusal(app, maybe_signature(member, app=app), args)
            if why is not None:
                return why
        return None
    try:  # carpool.run_batch, as the link or in what it would send in turn (its own links)
        check_step(app, f"the link {sig.task}", dict(sig))
    except UnsupportedOption as exc:
        return exc
    spec = spec_for(sig.task)
    if spec is None:  # a plain Celery task's, or one the coordinators batch (their CARPOOL_IMPORTS)
        return None
    try:
        merged_args, merged_kwargs, options = sig._merge(args, None, None)
        check_options(sig.task, options, app)
        check_send_settings(sig.task, app, app.tasks.get(sig.task))  # what its apply_async checks
        spec.accept(merged_args, merged_kwargs, settings_of(app))
    except Exception as exc:
        return exc
    return None


def _apply_callbacks(
    app: Celery,
    signatures: list[Any],
    result: Any,
    parent_id: str,
    root_id: str,
    inherited: Mapping[str, Any],
) -> None:
    options: dict[str, Any] = {"parent_id": parent_id, "root_id": root_id, "add_to_parent": False}
    options.update(inherited)
    if not signatures:
        return
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


def on_failure(
    app: Celery,
    request_id: str,
    task_name: str | None,
    links: Links,
    exc: BaseException,
    hostname: str | None = None,
    send: Callable[[Callable[[], Any]], Any] = _once,
    traceback: str | None = None,
    keep_on_outage: bool = False,
) -> None:
    """Call ``links``' error callbacks for the failed request ``request_id``, as the backend does;
    ``hostname``: the process calling them, as its task events name it (a Celery worker's request
    holds its node name); ``send``: as for :func:`on_success` (a retry after a lost reply may call
    an error callback twice); ``traceback``: the one stored with the failure, where ``exc`` was
    rebuilt from it (else ``exc``'s own). ``keep_on_outage``: Redis unreachable (or refusing
    writes) while they are called raises instead of being logged as their loss, for a caller that
    keeps them in the links outbox to send again.

    An error callback that cannot be sent has its failure stored here under its own id (write-once:
    a result stored already stays), since the callers store only the request's own outcome.
    """
    # Each is checked with the argument an old-style error callback is sent: the failed request's id.
    errbacks, failed = _sendable(
        app, request_id, "error callback", links.get("errbacks") or (), (request_id,)
    )
    if failed:
        try:
            send(lambda: app.backend.store_many(failed))
        except Exception:
            log.exception("request %s: storing its error callbacks' failures failed", request_id)
    if not errbacks:
        return
    request = Context(
        id=request_id,
        task=task_name,
        args=links.get("args"),
        kwargs=links.get("kwargs"),
        hostname=hostname,
        errbacks=errbacks,
        root_id=links.get("root_id"),
        parent_id=links.get("parent_id"),
        delivery_info={},
    )
    try:
        text = traceback if traceback is not None else compat.traceback_of(exc)
        send(lambda: compat.call_errbacks(app.backend, request, exc, text))
    except UNREACHABLE as error:
        if keep_on_outage:
            raise
        log.error(
            "request %s: its error callbacks could not be called, Redis unreachable (%s); they are lost",
            request_id,
            error,
        )
    except Exception:
        log.exception("request %s: calling its error callbacks failed", request_id)
