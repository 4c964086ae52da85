"""Submitting in bulk: many ``carpool.infer`` requests in one Redis round trip.

    from carpool import gather, submit_many

    results = submit_many(texts)              # validated like infer.delay(); one pipelined publish
    vectors = gather(results, timeout=60)     # see carpool.producer.gather

Why. ``infer.delay()`` pays, per request, a Redis round trip for the message, a PUBLISH for the
``task-sent`` event, a SUBSCRIBE for the result and Celery's routing and signal machinery, so one
producer's rate is capped and a burst trickles into the coordinator instead of arriving as one.
``submit_many`` builds the very same Celery messages
(:mod:`carpool.celery_edge.task_messages`) and publishes them all at once.

The LPUSHes and PUBLISHes of each chunk of messages (500 by default, or the whole call with
``chunk_size=None``) go in ONE ``MULTI``/``EXEC`` pipeline: one round trip, and the coordinator sees
all of a chunk's messages or none of them. Every request is validated before anything is sent, so a
bad payload raises :class:`~carpool.errors.InvalidInput` in the caller and publishes
nothing. Two things ``.delay()`` does are skipped on purpose: kombu's queue declaration (a SADD of the
binding set, needed only by consumers, which declare their queues themselves) and the publish retry
policy (a failed pipeline raises; with MULTI/EXEC nothing of it was applied, unless the connection
broke after EXEC was sent, when delivery is uncertain, as with any publish).

Nothing is subscribed per request (``backend.on_task_call`` sends a SUBSCRIBE per request): each
message names this process's result inbox (:mod:`carpool.celery_edge.inbox`), one channel where
every result of this process is published too, which ``gather`` subscribes while it waits;
``.get()`` on a result subscribes to its own channel, as for any AsyncResult. With
``CARPOOL_RESULT_INBOX=false`` the result keys are subscribed instead, on Celery's result consumer
in one SUBSCRIBE.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from carpool import collector
from carpool.celery_edge.app import settings_of, state_of
from carpool.celery_edge.events import EventsMode
from carpool.celery_edge.inbox import inbox_channel, mark
from carpool.celery_edge.options import check_send_settings, with_task_options
from carpool.celery_edge.result_consumer import subscribe_results, unsubscribe_results
from carpool.celery_edge.task_messages import TaskMessageBuilder, TaskMessages
from carpool.errors import InvalidInput, SubmitInterrupted, UnsupportedOption
from carpool.names import INBOX_HEADER, INFER_TASK, SENT_AT_HEADER
from carpool.redis_edge.replication import not_replicated, transaction_then_wait
from carpool.validation import bind_infer_args, validate_infer

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

    from carpool.config import Settings
    from carpool.registry import TaskSpec

SUPPORTED_OPTIONS = frozenset({"priority", "expires", "headers", "queue"})
#: submit_many's default ``chunk_size``: a larger call streams, so serving starts while it builds.
STREAM_CHUNK = 500
# A streamed call's first chunk, doubled chunk by chunk up to ``chunk_size``: the coordinator starts
# on a small first chunk while the larger ones are built.
FIRST_CHUNK = 64
_LPUSH_CHUNK = 10_000  # values per LPUSH command


def _default_app() -> Celery:
    from carpool.celery_edge.app import app

    return app


def submit_many(
    payloads: Iterable[Any],
    model: str | None = None,
    *,
    task: Any = None,
    app: Celery | None = None,
    subscribe: bool = True,
    chunk_size: int | None = STREAM_CHUNK,
    **options: Any,
) -> list[AsyncResult]:
    """Send one ``carpool.infer`` request per payload in one Redis round trip; one AsyncResult each.

    ``payloads``: texts, or mappings of ``infer``'s keyword arguments (``{"text": ..., "model": ...}``).
    ``model`` applies to every text payload (and to mappings without one), as
    ``infer.delay(text, model)`` would. ``options``: ``priority``, ``expires`` (seconds, datetime or ISO
    string), ``headers``, ``queue`` -- the same meaning as in ``infer.apply_async``; anything else raises
    TypeError rather than being silently dropped. The results come back through this process's
    result inbox (one channel for them all, read by :func:`~carpool.producer.gather.gather`), or with
    ``CARPOOL_RESULT_INBOX=false`` through a subscription per result made here. ``subscribe=False``
    does neither (use it with :func:`~carpool.producer.gather.gather_async`, which subscribes on its
    own connection; ``gather`` and ``.get()`` still work, subscribing per result when called).

    ``task``: a ``@batched`` task instead of ``carpool.infer``; each payload is then one item, passed
    exactly as ``task.delay(item)`` would pass it (a list is not unpacked, a dict is not keyword
    arguments), and ``model`` does not apply.

    Raises :class:`~carpool.errors.InvalidInput` (naming the payload's index) before anything is sent
    if any payload is not a valid request.

    Streamed in chunks of up to ``chunk_size`` messages (default :data:`STREAM_CHUNK`): each chunk is
    published (one MULTI/EXEC) as soon as it is built, so the coordinator and workers start on the
    first while the rest are built (a longer call's first chunk is :data:`FIRST_CHUNK` messages,
    the next ones twice the one before, up to ``chunk_size``); a call of at most ``chunk_size``
    messages is one chunk, all or nothing. Every payload is
    validated before anything is sent, but if Redis fails part-way,
    :class:`~carpool.errors.SubmitInterrupted` carries the AsyncResults of the requests already sent
    (they will run) and the rest were not sent. ``chunk_size=None`` sends every message in one
    MULTI/EXEC: the coordinator sees none of them until the last is built, and a failure sends none.

    Inside a Celery task (a worker's), each request is sent as its ``.delay()`` there would be, one
    publish each, through Celery's own send: a child of that task, as Celery links one.

    With Celery's ``task_always_eager`` (eager mode, as in a test suite) nothing is sent: after the
    same validation, each request runs here, in order, exactly as its ``.delay()`` would run it, and
    an EagerResult comes back for each (``gather`` returns their values without Redis).
    ``subscribe`` and ``chunk_size`` do not apply; with ``task_eager_propagates``, a request that
    fails raises, the ones before it having run.
    """
    unknown = set(options) - SUPPORTED_OPTIONS
    if unknown:
        raise TypeError(
            f"submit_many() does not support {', '.join(sorted(unknown))}; "
            f"supported options: {', '.join(sorted(SUPPORTED_OPTIONS))}"
        )
    if isinstance(payloads, str | bytes | bytearray | Mapping):
        raise InvalidInput(
            f"submit_many() takes a list of payloads, one request each, not a {type(payloads).__name__}"
            " (a string is never split into characters, a dict into its keys); for one request,"
            " pass [payload]"
        )
    app = app or getattr(task, "app", None) or _default_app()  # task may be a task's name
    settings = settings_of(app)
    name = INFER_TASK
    spec = None
    if task is not None and getattr(task, "name", task) != INFER_TASK:
        spec = _batched_spec(task, model)
        name = spec.name
    # The task itself, where Celery keeps what it copies onto each call (rate_limit, priority...).
    task_object = task if hasattr(task, "name") else app.tasks.get(name)
    check_send_settings(name, app, task_object)  # its serializer, compression and time limits too
    # The task's own queue and expires apply to each request, as Celery merges them into .delay().
    # What else the task sets (routing_key, exchange...) only Celery's own send carries out.
    options = with_task_options(task_object, options)
    for key, value in options.items():
        if key not in SUPPORTED_OPTIONS and value:
            raise UnsupportedOption(
                f"submit_many(): {name}'s own {key}={value!r} (its class or task_annotations) is not"
                " supported by submit_many; send those requests with .delay(), which sends it as Celery"
                " does, or unset it"
            )
    options = {key: value for key, value in options.items() if key in SUPPORTED_OPTIONS}
    if options.get("priority") is None:  # task_default_priority, as .delay() adds it
        options["priority"] = getattr(task_object, "priority", None) or app.conf.task_default_priority
    with collector.paused():  # thousands of small objects that all live on
        calls = _item_calls(payloads, spec, settings) if spec else _infer_calls(payloads, model, settings)
    headers = dict(options.pop("headers", None) or {})
    headers.setdefault(SENT_AT_HEADER, time.time())
    if "queue" not in options:  # routed by name, as Celery routes each call (a router's args: the first)
        first = calls[0] if calls else ((), {})
        options["queue"] = state_of(app).request_queue(name, *first)
    if app.conf.task_always_eager:
        return _run_eagerly(app, name, calls, headers, options)
    if app.current_worker_task is not None and task_object is not None:
        # Inside a Celery task each goes as its .delay() there goes, through Celery's own send, which
        # makes it a child of that task (parent_id, root_id, its children, task_inherit_parent_priority).
        sent = {key: value for key, value in options.items() if value is not None}
        send = task_object.apply_async
        return [send(args, kwargs, headers=dict(headers), **sent) for args, kwargs in calls]
    inbox = inbox_channel(app) if subscribe else None
    return publish_tasks(
        name,
        calls,
        app=app,
        headers=headers,
        subscribe=subscribe and inbox is None,
        inbox=inbox,
        chunk_size=chunk_size,
        **options,
    )


_Call = tuple[list[Any], dict[str, Any]]


def _item_calls(payloads: Iterable[Any], spec: TaskSpec, settings: Settings) -> list[_Call]:
    """One call per item of a ``@batched`` task, each accepted as ``task.delay(item)`` would be."""
    calls: list[_Call] = []
    for index, item in enumerate(payloads):
        one = [item]
        try:
            spec.accept(one, {}, settings)
        except Exception as exc:
            exc.add_note(f"(in submit_many: payloads[{index}]; nothing was sent)")
            raise
        calls.append((one, {}))
    return calls


def _infer_calls(payloads: Iterable[Any], model: str | None, settings: Settings) -> list[_Call]:
    """One ``carpool.infer`` call per payload, each checked as ``infer.delay`` would check it."""
    calls: list[_Call] = []
    # The common payload, an ASCII text no longer than the byte limit (one byte per character, and no
    # lone surrogate) for a served model, is valid without the general checks: a burst of thousands
    # is sent only once all are checked, so each payload's check delays the first message.
    fast_model = model is None or (type(model) is str and model in settings.served_models)
    fast_limit = settings.max_input_bytes if fast_model else -1
    for index, payload in enumerate(payloads):
        if type(payload) is str and len(payload) <= fast_limit and payload.isascii():
            calls.append(([payload] if model is None else [payload, model], {}))
            continue
        if isinstance(payload, Mapping):
            kwargs = dict(payload)
            if model is not None:
                kwargs.setdefault("model", model)
            args: list[Any] = []
        else:
            args = [payload] if model is None else [payload, model]
            kwargs = {}
        try:
            text, chosen = bind_infer_args(args, kwargs)
            validate_infer(text, chosen, settings)
        except Exception as exc:
            exc.add_note(f"(in submit_many: payloads[{index}]; nothing was sent)")
            raise
        calls.append((args, kwargs))
    return calls


def _run_eagerly(
    app: Celery, name: str, calls: list[_Call], headers: dict[str, Any], options: dict[str, Any]
) -> list[AsyncResult]:
    """Each call run here, one after another, as ``.delay()`` runs it under ``task_always_eager``:
    Celery's eager path (its serializer round trip, ``task_eager_propagates``), an EagerResult each.
    Nothing is sent: eager mode is for test suites without a broker or workers."""
    if name == INFER_TASK:
        import carpool.tasks  # noqa: F401  # defines carpool.infer, which submitting needs no import of
    task = app.tasks.get(name)
    if task is None:
        raise TypeError(
            f"submit_many() under task_always_eager runs each request here as {name}.delay() "
            f"would, but {app!r} has no task {name}"
        )
    results: list[AsyncResult] = []
    for index, (args, kwargs) in enumerate(calls):
        try:
            results.append(task.apply_async(args, kwargs, headers=dict(headers), **options))
        except Exception as exc:
            exc.add_note(f"(in submit_many, run eagerly: payloads[{index}]; payloads[:{index}] ran)")
            raise
    return results


def _batched_spec(task: Any, model: str | None) -> TaskSpec:
    from carpool.registry import spec_for

    name = getattr(task, "name", task)
    spec = spec_for(name) if isinstance(name, str) else None
    if spec is None:
        raise TypeError(f"submit_many(task=...) takes a @batched task, not {task!r}")
    if model is not None:
        raise TypeError(
            "submit_many(task=...) sends items to that task; model= applies to carpool.infer only"
        )
    return spec


def publish_tasks(
    name: str,
    calls: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
    *,
    app: Celery | None = None,
    queue: str | None = None,
    priority: int | None = None,
    expires: Any = None,
    headers: Mapping[str, Any] | None = None,
    subscribe: bool = True,
    sent_events: bool | None = None,
    chunk_size: int | None = None,
    inbox: str | None = None,
) -> list[AsyncResult]:
    """Publish ``(args, kwargs)`` calls of task ``name`` in one MULTI/EXEC pipeline; no validation.

    The building block of :func:`submit_many`, usable for any task routed to a Redis queue through a
    direct exchange (``carpool bench`` sends its baselines with it). ``queue`` overrides the task's
    route; ``sent_events`` defaults to the app's ``task_send_sent_event``, sent as ``CARPOOL_EVENTS``
    says (``auto``: while the last events published reached a receiver, and again a tenth of a
    second after one reached none; given, it holds as given). ``chunk_size``: see
    :func:`submit_many`. ``inbox``: a result inbox channel the messages name and the results are
    marked with (:mod:`carpool.celery_edge.inbox`; only carpool's coordinators deliver there).
    """
    app = app or _default_app()
    if not calls:
        return []
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of messages, not {chunk_size!r}")
    builder, header_values = _builder(app, name, queue, priority, expires, headers, sent_events, inbox)
    state = state_of(app)
    publisher, slots = state.publisher(), state.publishing()
    settings = settings_of(app)
    events_when = _events_when(builder.sent_events, sent_events is not None, settings.events)
    replicas, wait_s = settings.wait_replicas, settings.wait_timeout_s
    backend = app.backend
    results: list[AsyncResult] = []
    make_result = app.AsyncResult  # a property: looked up once
    for start, end in _chunk_bounds(len(calls), chunk_size):
        events = state.sent_heard.wanted() if events_when is None else events_when
        with collector.paused():
            built = builder.build(calls[start:end], header_values=header_values, events=events)
        if subscribe:
            subscribe_results(backend, built.ids)
        acked = replicas
        try:
            with slots:
                if replicas:
                    replies, acked = transaction_then_wait(
                        publisher, partial(_queue, built), replicas, wait_s
                    )
                else:
                    with publisher.pipeline(transaction=True) as pipe:
                        _queue(built, pipe)
                        replies = pipe.execute()
        except BaseException as exc:
            if subscribe:
                unsubscribe_results(backend, built.ids)
            if results and isinstance(exc, Exception):
                raise _interrupted(results, len(calls), exc) from exc
            raise
        built.published()
        if built.events:  # the PUBLISHes come last: how many receivers got the events
            state.sent_heard.heard(max(replies[-len(built.events) :]))
        # The backend is passed in: looked up per result it is a thread-local property.
        with collector.paused():
            made = [make_result(task_id, backend=backend) for task_id in built.ids]
        if inbox is not None:
            mark(made, inbox)
        results.extend(made)
        if acked < replicas:
            error = not_replicated(f"{len(results)} of {len(calls)} messages", acked, replicas, wait_s)
            error.results = results  # sent: they will run unless the master fails first
            raise error
    return results


def _chunk_bounds(n: int, chunk_size: int | None) -> Iterator[tuple[int, int]]:
    """(start, end) of each chunk of ``n`` messages: all in one when they fit in ``chunk_size`` (or it
    is None), else chunks from ``FIRST_CHUNK`` doubling up to ``chunk_size``."""
    if chunk_size is None or n <= chunk_size:
        yield 0, n
        return
    start, size = 0, min(chunk_size, FIRST_CHUNK)
    while start < n:
        yield start, min(n, start + size)
        start += size
        size = min(chunk_size, size * 2)


MAX_KEPT_BUILDERS = 256  # (thread, task, options) combinations; past this the kept ones start over


def _builder(
    app: Celery,
    name: str,
    queue: str | None,
    priority: int | None,
    expires: Any,
    headers: Mapping[str, Any] | None,
    sent_events: bool | None,
    inbox: str | None = None,
) -> tuple[TaskMessageBuilder, dict[str, Any] | None]:
    """A message builder for these options, and the header values its build calls give.

    A builder learns its message template from Celery's first two builds; kept between calls, a
    ``.delay()`` after the first two renders its message from the template instead of having Celery
    build it. Kept only when the options are all it bakes in: no ``expires`` (an instant fixed when
    the builder is made) and no headers but the sent-at time, which each build gives, and the result
    inbox, the same in every message of the process. Per process and thread (its Celery ``thread_oid``),
    because a message carries its process in ``origin`` and its thread's ``reply_to``.
    """
    fixed = {INBOX_HEADER: inbox} if inbox is not None else None
    if expires is not None or (headers and set(headers) != {SENT_AT_HEADER}):
        fresh = TaskMessageBuilder(  # expires in seconds: one instant for every chunk
            name,
            app=app,
            queue=queue,
            priority=priority,
            expires=expires,
            headers={**(headers or {}), **(fixed or {})},
            sent_events=sent_events,
        )
        return fresh, None
    per_build = (SENT_AT_HEADER,) if headers else ()
    kept = state_of(app).builders
    # The pid too: a template's origin header names its process (gen<pid>@host), and a forked
    # child must not send its parent's.
    key = (os.getpid(), app.thread_oid, name, queue, priority, sent_events, per_build, inbox)
    builder = kept.get(key)
    if builder is None:
        if len(kept) >= MAX_KEPT_BUILDERS:
            kept.clear()
        builder = TaskMessageBuilder(
            name,
            app=app,
            queue=queue,
            priority=priority,
            headers=fixed,
            sent_events=sent_events,
            per_build_headers=per_build,
        )
        kept[key] = builder
    return builder, dict(headers) if headers else None


def _events_when(sends: bool, asked: bool, mode: EventsMode) -> bool | None:
    """Whether a publish sends task-sent events: True always, False never, None while someone
    receives them. ``sends``: the builder's (the call's ``sent_events``, else Celery's
    ``task_send_sent_event``); ``asked``: the call gave ``sent_events``, which holds as given;
    ``mode``: ``CARPOOL_EVENTS``."""
    if not sends:
        return False
    if asked or mode is True:
        return True
    return None if mode == "auto" else False


def _queue(built: TaskMessages, pipe: Any) -> None:
    """Queue the pushes and task-sent events of ``built`` on ``pipe``."""
    # LPUSH k a b c == LPUSH k a; LPUSH k b; LPUSH k c: same order, one command per list.
    for key, raws in built.pushes.items():
        for first in range(0, len(raws), _LPUSH_CHUNK):
            pipe.lpush(key, *raws[first : first + _LPUSH_CHUNK])
    for topic, raw in built.events:
        pipe.publish(topic, raw)


def _interrupted(sent: list[AsyncResult], total: int, cause: Exception) -> SubmitInterrupted:
    error = SubmitInterrupted(
        f"publishing stopped after {len(sent)} of {total} messages ({cause}); the first ones were "
        "sent and will run (their AsyncResults are in .results), the rest were not: resend "
        "calls[len(.results):]"
    )
    error.results = sent
    return error
