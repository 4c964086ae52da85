"""Bulk producer API: many requests in one Redis round trip, many results in one read.

    from carpool.producer.client import gather, submit_many

    results = submit_many(texts)              # validated like infer.delay(); one pipelined publish
    vectors = gather(results, timeout=60)     # one MGET, then pub/sub for whatever is still running

    vectors = await gather_async(submit_many(texts, subscribe=False), timeout=60)   # asyncio

Why. ``infer.delay()`` pays, per request, a Redis round trip for the message, a PUBLISH for the
``task-sent`` event, a SUBSCRIBE for the result and Celery's routing and signal machinery: about
0.8 ms on the 2-core machine of docs/PERFORMANCE.md, so one producer tops out near 1,300 requests/s,
and a burst trickles into the coordinator instead of arriving as one. ``submit_many`` builds the very
same Celery protocol-2 messages and publishes them all at once.

How a message is built (checked against celery 5.6 / kombu 5.7, and by tests/integration/test_client.py,
which compares a ``submit_many`` message with an ``infer.delay()`` one field by field):

- headers, properties and body come from ``app.amqp.create_task_message`` (``as_task_v2``), exactly
  as ``app.send_task`` builds them, with the ``carpool_sent_at`` header that ``InferTask`` stamps;
- the body is serialised with ``kombu.serialization.dumps`` (the app's task serializer, JSON), the
  envelope made with the Redis channel's ``prepare_message`` and finished as kombu's
  ``basic_publish`` finishes it (base64 body, delivery tag, delivery info);
- the envelope is JSON-encoded and LPUSHed to the list ``Channel._put`` would pick for its priority
  (``carpool.requests`` or ``carpool.requests\\x06\\x16<step>``);
- when ``task_send_sent_event`` is on (carpool turns it on, for flower), the ``task-sent`` events,
  with the fields Celery's event dispatcher gives them, are PUBLISHed to the event fanout topic as
  ``task.multi`` lists of up to 1,000 (what Celery's buffered dispatcher sends; Flower and ``celery
  events`` unpack them), one PUBLISH per chunk instead of one per request.

Every LPUSH and PUBLISH of one call goes in ONE ``MULTI``/``EXEC`` pipeline: one round trip, and the
coordinator sees all of the messages or none of them. Every request is validated before anything is
sent, so a bad payload raises :class:`~carpool.errors.InvalidInput` in the caller and publishes
nothing. Two things ``.delay()`` does are skipped on purpose: kombu's queue declaration (a SADD of the
binding set, needed only by consumers, which declare their queues themselves) and the publish retry
policy (a failed pipeline raises; with MULTI/EXEC nothing of it was applied, unless the connection broke
after EXEC was sent, when delivery is uncertain, as with any publish).

Results. ``submit_many`` subscribes the result keys on Celery's result consumer in one SUBSCRIBE
(``backend.on_task_call`` sends one per request), so ``.get()`` on each result works as usual.
``gather`` reads every result already stored with one MGET, then waits on that same pub/sub
connection for the rest; Celery's own bulk read (``ResultSet.join`` / ``backend.get_many``) polls
with MGET every half second instead. ``gather_async`` uses its own ``redis.asyncio`` connection:
see its docstring for why it does not wrap ``gather`` in ``run_in_executor``.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import re
import time
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.utils.saferepr import saferepr

from carpool.codec import dumps_plain, flat_plain
from carpool.names import INFER_TASK, SENT_AT_HEADER
from carpool.validation import bind_infer_args, validate_infer

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

SUPPORTED_OPTIONS = frozenset({"priority", "expires", "headers", "queue"})
_MGET_CHUNK = 5000
_SUBSCRIBE_CHUNK = 5000
_LPUSH_CHUNK = 10_000
_EVENTS_CHUNK = 1000  # task-sent events per task.multi message
_MESSAGE_READ_S = 1.0  # time allowed for the rest of a result message that has started to arrive


def _default_app() -> Celery:
    from carpool.celery_edge.app import app

    return app


# --- submitting --------------------------------------------------------------------------------


def submit_many(
    payloads: Iterable[str | Mapping[str, Any]],
    model: str | None = None,
    *,
    app: Celery | None = None,
    subscribe: bool = True,
    chunk_size: int | None = None,
    **options: Any,
) -> list[AsyncResult]:
    """Send one ``carpool.infer`` request per payload in one Redis round trip; one AsyncResult each.

    ``payloads``: texts, or mappings of ``infer``'s keyword arguments (``{"text": ..., "model": ...}``).
    ``model`` applies to every text payload (and to mappings without one), as
    ``infer.delay(text, model)`` would. ``options``: ``priority``, ``expires`` (seconds, datetime or ISO
    string), ``headers``, ``queue`` -- the same meaning as in ``infer.apply_async``; anything else raises
    TypeError rather than being silently dropped. ``subscribe=False`` skips the result subscription
    (use it with :func:`gather_async`, which subscribes on its own connection; ``gather`` and ``.get()``
    still work, subscribing when called).

    Raises :class:`~carpool.errors.InvalidInput` (naming the payload's index) before anything is sent
    if any payload is not a valid request.

    All or nothing by default: every message goes out in one MULTI/EXEC, so the coordinator sees none
    of them until the last is built (about 40 us each). ``chunk_size=N`` streams instead: each N
    messages are published (one MULTI/EXEC each) as soon as they are built, and the coordinator and
    workers start on the first while the rest are built; a burst of 5,000 completed about 20% sooner
    with N=500 (docs/PERFORMANCE.md). Every payload is still validated before anything is sent, but
    if Redis fails part-way, :class:`~carpool.errors.SubmitInterrupted` carries the AsyncResults of
    the requests already sent (they will run) and the rest were not sent.
    """
    unknown = set(options) - SUPPORTED_OPTIONS
    if unknown:
        raise TypeError(
            f"submit_many() does not support {', '.join(sorted(unknown))}; "
            f"supported options: {', '.join(sorted(SUPPORTED_OPTIONS))}"
        )
    app = app or _default_app()
    settings = app.carpool_settings
    calls: list[tuple[list[Any], dict[str, Any]]] = []
    for index, payload in enumerate(payloads):
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
    headers = dict(options.pop("headers", None) or {})
    headers.setdefault(SENT_AT_HEADER, time.time())
    return publish_tasks(
        INFER_TASK, calls, app=app, headers=headers, subscribe=subscribe, chunk_size=chunk_size, **options
    )


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
) -> list[AsyncResult]:
    """Publish ``(args, kwargs)`` calls of task ``name`` in one MULTI/EXEC pipeline; no validation.

    The building block of :func:`submit_many`, usable for any task routed to a Redis queue through a
    direct exchange (``carpool bench`` sends its baselines with it). ``queue`` overrides the task's
    route; ``sent_events`` defaults to the app's ``task_send_sent_event``. ``chunk_size``: see
    :func:`submit_many`.
    """
    app = app or _default_app()
    if not calls:
        return []
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of messages, not {chunk_size!r}")
    builder = TaskMessageBuilder(  # expires in seconds: one instant for every chunk
        name,
        app=app,
        queue=queue,
        priority=priority,
        expires=expires,
        headers=headers,
        sent_events=sent_events,
    )
    backend = app.backend
    step = chunk_size or len(calls)
    results: list[AsyncResult] = []
    for start in range(0, len(calls), step):
        built = builder.build(calls[start : start + step])
        if subscribe:
            subscribe_results(backend, built.ids)
        try:
            with _publisher(app).pipeline(transaction=True) as pipe:
                # LPUSH k a b c == LPUSH k a; LPUSH k b; LPUSH k c: same order, one command per list.
                for key, raws in built.pushes.items():
                    for first in range(0, len(raws), _LPUSH_CHUNK):
                        pipe.lpush(key, *raws[first : first + _LPUSH_CHUNK])
                for topic, raw in built.events:
                    pipe.publish(topic, raw)
                pipe.execute()
        except BaseException as exc:
            if subscribe:
                unsubscribe_results(backend, built.ids)
            if results and isinstance(exc, Exception):
                from carpool.errors import SubmitInterrupted

                interrupted = SubmitInterrupted(
                    f"publishing stopped after {len(results)} of {len(calls)} messages ({exc}); the "
                    "first ones were sent and will run (their AsyncResults are in .results), the rest "
                    "were not: resend calls[len(.results):]"
                )
                interrupted.results = results
                raise interrupted from exc
            raise
        built.published()
        # The backend passed in: looked up per result (a thread-local property) it was most of the
        # ~10 us each AsyncResult cost.
        results.extend(app.AsyncResult(task_id, backend=backend) for task_id in built.ids)
    return results


@dataclass
class TaskMessages:
    """Celery task messages built for a Redis queue, ready to be pushed by whoever sends them."""

    name: str
    queue: str
    ids: list[str]
    pushes: dict[str, list[str]]  # request list (one per priority step) -> envelopes, in send order
    events: list[tuple[str, str]]  # (topic, raw) of the task-sent events
    _after: list[tuple[Any, dict[str, Any]]]

    def published(self) -> None:
        """Send Celery's ``after_task_publish`` signal for each message (call once they are sent)."""
        from celery import signals

        for body, task_headers in self._after:
            signals.after_task_publish.send(
                sender=self.name, body=body, headers=task_headers, exchange="", routing_key=self.queue
            )


class TaskMessageBuilder:
    """Builds the messages ``app.send_task(name, ..., **options)`` would publish, options fixed.

    Cost: Celery's ``create_task_message`` and kombu's ``prepare_message`` take about a millisecond
    per message. The builder has Celery build the first message and keeps it as a template; when
    Celery's build of a later message equals what the template renders for it (checked field by
    field, once), every message after that is rendered from the template (the id, reprs, body and
    delivery tag substituted into pre-serialised JSON): about a fifth of the CPU of the first build,
    or less. The template lives as long as the builder, so a coordinator cutting one batch at a time
    pays for Celery's build twice in its lifetime, not twice per step. With publish signal receivers,
    compression or a mismatch, every message is built by Celery. ``expires`` in seconds is turned into
    one instant when the builder is made. ``ignore_result`` goes into the headers, where it overrides
    the task's own setting on the worker (as ``send_task(..., ignore_result=True)`` does). Celery's
    ``before_task_publish`` receivers run in :meth:`build`, ``after_task_publish`` ones on
    :meth:`TaskMessages.published`; ``build``'s ``task_ids`` and ``argsreprs`` (one per call) replace
    the generated id and the computed repr.
    """

    def __init__(
        self,
        name: str,
        *,
        app: Celery,
        queue: str | None = None,
        priority: int | None = None,
        expires: Any = None,
        headers: Mapping[str, Any] | None = None,
        sent_events: bool | None = None,
        ignore_result: bool = False,
    ) -> None:
        from kombu.entity import maybe_delivery_mode

        conf = app.conf
        route = app.amqp.router.route({"queue": queue} if queue else {}, name, (), {})
        target = route["queue"]
        exchange = getattr(target, "exchange", None)
        if route.get("exchange") or (exchange is not None and exchange.type not in (None, "direct")):
            raise ValueError(
                f"{name} is routed through exchange {exchange!r}; publish_tasks sends to direct queues only"
            )
        self.app = app
        self.name = name
        self.target = target
        self.qname: str = target.name
        self.priority = priority
        self.delivery_mode = maybe_delivery_mode(
            (exchange.delivery_mode if exchange is not None else None) or conf.task_default_delivery_mode
        )
        self.serializer = conf.task_serializer
        self.compression = conf.task_compression
        self.sent_events = bool(conf.task_send_sent_event) if sent_events is None else sent_events
        if isinstance(expires, int | float) and not isinstance(expires, bool):
            # Seconds from now become one instant, fixed here for every message the builder makes
            # (Celery would add them per message).
            from datetime import timedelta

            expires = app.now() + timedelta(seconds=expires)
        self.expires = expires
        self.extra_headers = dict(headers or {})
        self.ignore_result = ignore_result
        self.reply_to = app.thread_oid
        self._template: _MessageTemplate | None = None
        self._trusted = False  # the template rendered one of Celery's own builds exactly
        self._untrusted = False  # ... or failed to: Celery builds every message from then on

    def build(
        self,
        calls: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        task_ids: Sequence[str] | None = None,
        argsreprs: Sequence[str] | None = None,
    ) -> TaskMessages:
        from celery import signals
        from kombu.serialization import dumps as serialize
        from kombu.utils.json import dumps as envelope_dumps
        from kombu.utils.uuid import uuid

        app, name, qname = self.app, self.name, self.qname
        expires = self.expires
        evd = _event_dispatcher(app) if self.sent_events else None
        before = signals.before_task_publish.receivers
        after = signals.after_task_publish.receivers
        templating = not (before or after or self.compression or self._untrusted)
        built = TaskMessages(name=name, queue=qname, ids=[], pushes={}, events=[], _after=[])
        argsrepr_max = app.amqp.argsrepr_maxsize
        channel = _channel(app)
        sent: list[dict[str, Any]] = []
        utc_offset = _utcoffset() if evd is not None else 0

        def celery_built(
            task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any], argsrepr: str | None
        ) -> Any:
            task_headers, properties, body, sent_event = app.amqp.create_task_message(
                task_id,
                name,
                args,
                kwargs,
                expires=expires,
                reply_to=self.reply_to,
                create_sent_event=self.sent_events,
                argsrepr=argsrepr,
                kwargsrepr="{}" if not kwargs else None,
                ignore_result=self.ignore_result,
            )
            task_headers.update(self.extra_headers)
            if before:
                signals.before_task_publish.send(
                    sender=name,
                    body=body,
                    exchange="",
                    routing_key=qname,
                    declare=[self.target],
                    headers=task_headers,
                    properties=properties,
                    retry_policy=None,
                )
            content_type, content_encoding, data = serialize(body, serializer=self.serializer)
            if self.compression:
                from kombu.compression import compress

                data, task_headers["compression"] = compress(data, self.compression)
            properties["delivery_mode"] = self.delivery_mode
            message = channel.prepare_message(
                data, self.priority, content_type, content_encoding, task_headers, properties
            )
            channel._inplace_augment_message(message, "", qname)
            return message, body, task_headers, sent_event

        for index, (call_args, call_kwargs) in enumerate(calls):
            task_id = task_ids[index] if task_ids is not None else uuid()
            args = tuple(call_args)  # as Task.delay passes them (argsrepr shows a tuple)
            kwargs = dict(call_kwargs)
            argsrepr = argsreprs[index] if argsreprs is not None else _fast_repr(args, argsrepr_max)
            template = self._template if templating and self._trusted else None
            if template is not None:
                if argsrepr is None:
                    argsrepr = saferepr(args, argsrepr_max)
                kwargsrepr = "{}" if not kwargs else saferepr(kwargs, argsrepr_max)
                raw = template.render(task_id, args, kwargs, argsrepr, kwargsrepr, uuid())
                sent_event = template.sent_event(task_id, argsrepr, kwargsrepr) if evd is not None else None
                key = template.key
            else:
                message, body, task_headers, sent_event = celery_built(task_id, args, kwargs, argsrepr)
                key = channel._q_for_pri(qname, channel._get_message_priority(message, reverse=False))
                raw = envelope_dumps(message)
                if after:
                    built._after.append((body, task_headers))
                if templating:
                    self._learn(message, body, sent_event, raw, key, task_id, args, kwargs, evd is not None)
            built.pushes.setdefault(key, []).append(raw)
            if evd is not None and sent_event is not None:
                sent_event.update(queue=qname, exchange="", routing_key=qname)
                sent.append(_sent_event_fields(evd, sent_event, utc_offset))
            built.ids.append(task_id)
        if sent:
            # One task.multi list message per chunk, as Celery's buffered event dispatcher sends them
            # (Flower and `celery events` unpack lists), instead of one PUBLISH per request.
            from carpool.celery_edge.fanout import FanoutEncoder

            assert evd is not None  # events are only collected with a dispatcher
            encoder = FanoutEncoder(channel, evd.exchange.name, "task.multi", dict(evd.headers))
            for start in range(0, len(sent), _EVENTS_CHUNK):
                built.events.append(
                    (encoder.topic, encoder.encode(sent[start : start + _EVENTS_CHUNK]).decode())
                )
        return built

    def _learn(
        self,
        message: dict[str, Any],
        body: Any,
        sent_event: Any,
        raw: str,
        key: str,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        with_events: bool,
    ) -> None:
        """Make a template from Celery's first message; trust it once it renders Celery's second."""
        template = self._template
        if template is None:
            self._template = _MessageTemplate.maybe(message, body, sent_event, key)
            if self._template is None:
                self._untrusted = True
            return
        headers = message["headers"]
        again = template.render(
            task_id,
            args,
            kwargs,
            headers["argsrepr"],
            headers["kwargsrepr"],
            message["properties"]["delivery_tag"],
        )
        if (
            key != template.key
            or _decoded(again) != _decoded(raw)
            or (
                with_events
                and template.sent_event(task_id, headers["argsrepr"], headers["kwargsrepr"]) != sent_event
            )
        ):
            log.debug("message template for %s does not match Celery's message; not used", self.name)
            self._template, self._untrusted = None, True
        else:
            self._trusted = True


def _decoded(raw: str) -> dict[str, Any]:
    """An envelope with its body decoded: the rendered body is compact JSON (orjson), Celery's has
    spaces after separators; consumers see the same values."""
    message: dict[str, Any] = json.loads(raw)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return message


def _json_str(value: str) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # a lone surrogate: orjson refuses, json escapes it
        return json.dumps(value)


class _MessageTemplate:
    """A Celery-built envelope serialised once, with its per-message fields left as slots."""

    _SLOT = re.compile(r'"@@carpool-slot:(\w+)@@"')

    def __init__(
        self, message: dict[str, Any], body: Any, sent_event: dict[str, Any] | None, key: str
    ) -> None:
        from kombu.utils.json import dumps as envelope_dumps

        self.key = key  # the Redis list the messages go to (one per priority step)

        task_id = message["headers"]["id"]
        msg = copy.deepcopy(message)
        slot = "@@carpool-slot:{}@@".format
        msg["body"] = slot("body")
        headers, props = msg["headers"], msg["properties"]
        headers["id"] = slot("id")
        if headers.get("root_id") == task_id:
            headers["root_id"] = slot("id")
        if props.get("correlation_id") == task_id:
            props["correlation_id"] = slot("id")
        headers["argsrepr"] = slot("argsrepr")
        headers["kwargsrepr"] = slot("kwargsrepr")
        props["delivery_tag"] = slot("tag")
        parts = self._SLOT.split(envelope_dumps(msg))
        self._literals = parts[0::2]
        self._slots = parts[1::2]
        self._embed = body[2]
        self._sent = dict(sent_event) if sent_event is not None else None
        self._root_is_id = sent_event is not None and sent_event.get("root_id") == task_id

    @classmethod
    def maybe(cls, message: dict[str, Any], body: Any, sent_event: Any, key: str) -> _MessageTemplate | None:
        props = message.get("properties", {})
        if props.get("body_encoding") != "base64" or message.get("content-type") != "application/json":
            return None
        if not (isinstance(body, tuple | list) and len(body) == 3):
            return None
        return cls(message, body, sent_event, key)

    def render(
        self,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        argsrepr: str,
        kwargsrepr: str,
        tag: str,
    ) -> str:
        # Plain arguments (texts, a model name) are encoded by orjson: the same JSON values as
        # kombu's encoder, which is kept for anything it would tag (datetime, UUID, ...).
        data = dumps_plain((args, kwargs, self._embed)) if flat_plain(args, kwargs) else None
        if data is None:
            from kombu.utils.json import dumps

            data = dumps((args, kwargs, self._embed)).encode("utf-8")
        values = {
            "id": task_id,
            "body": base64.b64encode(data).decode("ascii"),
            "argsrepr": argsrepr,
            "kwargsrepr": kwargsrepr,
            "tag": tag,
        }
        out = [self._literals[0]]
        for slot, literal in zip(self._slots, self._literals[1:], strict=True):
            out.append(_json_str(values[slot]))
            out.append(literal)
        return "".join(out)

    def sent_event(self, task_id: str, argsrepr: str, kwargsrepr: str) -> dict[str, Any] | None:
        if self._sent is None:
            return None
        event = dict(self._sent, uuid=task_id, args=argsrepr, kwargs=kwargsrepr)
        if self._root_is_id:
            event["root_id"] = task_id
        return event


def _channel(app: Celery) -> Any:
    """A kombu Redis channel of ``app``'s broker, kept per app: only its message-building methods are
    used here (no I/O), and opening one costs a connection and a PING."""
    channel = getattr(app, "_carpool_build_channel", None)
    if channel is None:
        channel = app.connection_for_write().default_channel
        app._carpool_build_channel = channel
    return channel


def _publisher(app: Celery) -> Any:
    """A ``redis.Redis`` on the channel's connection pool, kept per app.

    kombu builds a new ``redis.Redis`` for every publish (``Channel.conn_or_acquire``); with redis-py 8
    that object alone cost about a quarter of a millisecond, twice per ``infer.delay()``. The pool
    (kombu's, with the broker URL's settings) reconnects on its own after a broker restart.
    """
    client = getattr(app, "_carpool_publisher", None)
    if client is None:
        client = _channel(app)._create_client()
        app._carpool_publisher = client
    return client


def _fast_repr(args: tuple[Any, ...], limit: int) -> str | None:
    """``saferepr(args)`` for the common case (short plain strings), where the two agree; else None."""
    if all(type(a) is str for a in args):
        text = repr(args)
        if len(text) <= limit and "\\" not in text and '"' not in text:
            return text
    return None  # Celery computes saferepr


def _event_dispatcher(app: Celery) -> Any:
    """The dispatcher ``send_task`` uses for task-sent events (hostname, clock, exchange, serializer)."""
    evd = getattr(app.amqp, "_event_dispatcher", None)
    return evd if evd is not None else app.events.Dispatcher(enabled=False)


def _utcoffset() -> int:
    from celery.utils.time import utcoffset

    return int(utcoffset())


def _sent_event_fields(evd: Any, fields: dict[str, Any], utc_offset: int) -> dict[str, Any]:
    """A task-sent event as ``celery.events.Event`` makes it in ``EventDispatcher.publish``."""
    fields.update(
        type="task-sent",
        hostname=evd.hostname,
        utcoffset=utc_offset,
        pid=evd.pid,
        clock=evd.clock.forward(),
        timestamp=time.time(),
    )
    return fields


# --- result subscriptions ----------------------------------------------------------------------


def _consumer(backend: Any) -> Any:
    return getattr(backend, "result_consumer", None)


def subscribe_results(backend: Any, task_ids: Sequence[str]) -> list[str]:
    """Subscribe Celery's result consumer to ``task_ids`` in one SUBSCRIBE; returns the ids newly added.

    What ``backend.on_task_call`` does per request, for many. Inside a worker (where joining a task
    would block) it does nothing, as Celery does.
    """
    from celery._state import task_join_will_block

    consumer = _consumer(backend)
    if consumer is None or task_join_will_block() or not task_ids:
        return []
    fresh = [t for t in dict.fromkeys(task_ids) if backend.get_key_for_task(t) not in consumer.subscribed_to]
    if not fresh:
        return []
    if consumer._pubsub is None:
        consumer.start(fresh[0])  # creates the pub/sub connection, subscribed to the first
    keys = [backend.get_key_for_task(t) for t in fresh]
    keys = [k for k in keys if k not in consumer.subscribed_to]
    consumer.subscribed_to.update(keys)
    with consumer.reconnect_on_error():
        for start in range(0, len(keys), _SUBSCRIBE_CHUNK):
            consumer._pubsub.subscribe(*keys[start : start + _SUBSCRIBE_CHUNK])
    return fresh


def unsubscribe_results(backend: Any, task_ids: Sequence[str]) -> None:
    """Cancel result subscriptions of ``task_ids`` in one UNSUBSCRIBE."""
    consumer = _consumer(backend)
    if consumer is None:
        return
    keys = [
        k
        for k in (backend.get_key_for_task(t) for t in dict.fromkeys(task_ids))
        if k in consumer.subscribed_to
    ]
    if not keys:
        return
    consumer.subscribed_to.difference_update(keys)
    if consumer._pubsub is not None:
        with consumer.reconnect_on_error():
            for start in range(0, len(keys), _SUBSCRIBE_CHUNK):
                consumer._pubsub.unsubscribe(*keys[start : start + _SUBSCRIBE_CHUNK])


@contextmanager
def _bulk_cancel(backend: Any) -> Iterator[None]:
    """Collect the per-result UNSUBSCRIBEs Celery sends as results resolve; send them as one at the end."""
    consumer = _consumer(backend)
    if consumer is None:
        yield
        return
    cancelled: list[str] = []
    shadowed = consumer.__dict__.get("cancel_for")
    consumer.cancel_for = cancelled.append
    try:
        yield
    finally:
        if shadowed is None:
            del consumer.cancel_for
        else:
            consumer.cancel_for = shadowed
        unsubscribe_results(backend, cancelled)


# --- gathering -----------------------------------------------------------------------------------


def _same_backend(results: Sequence[AsyncResult]) -> Any:
    backend = results[0].backend
    if any(r.backend is not backend for r in results):
        raise ValueError("gather needs results of one app (one result backend)")
    return backend


def _unresolved(results: Sequence[AsyncResult]) -> dict[str, list[AsyncResult]]:
    waiting: dict[str, list[AsyncResult]] = {}
    for r in results:
        if r._cache is None:
            waiting.setdefault(r.id, []).append(r)
    return waiting


def _settle(
    waiting: dict[str, list[AsyncResult]], meta: Mapping[str, Any] | None, ready: set[str]
) -> str | None:
    """Give ``meta`` to the waiting results of its task if it is final; returns the task id settled."""
    from celery import states

    if not meta or meta.get("status") not in states.READY_STATES:
        return None
    task_id = meta.get("task_id")
    for r in waiting.pop(task_id, ()):  # type: ignore[arg-type]
        r._maybe_set_cache(dict(meta))
        ready.add(r.id)
    return task_id


def _raise_first_failure(
    results: Sequence[AsyncResult], newly: set[str], index: Mapping[str, list[AsyncResult]] | None = None
) -> None:
    """Raise the stored exception of the earliest result in ``results`` that ``newly`` failed.

    ``index`` (task id -> its results) lets the common case, nothing failed, cost what was just
    learnt instead of a scan of every result: gathering thousands, that scan ran once per message.
    """
    from celery import states

    if not newly:
        return
    if index is not None and not any(
        r._cache is not None and r._cache["status"] in states.PROPAGATE_STATES
        for task_id in newly
        for r in index.get(task_id, ())
    ):
        return
    for r in results:
        if r.id in newly and r._cache is not None and r._cache["status"] in states.PROPAGATE_STATES:
            r.maybe_throw()


def _values(results: Sequence[AsyncResult], return_exceptions: bool) -> list[Any]:
    from celery import states

    out = []
    for r in results:
        if r._cache["status"] in states.PROPAGATE_STATES and not return_exceptions:
            r.maybe_throw()
        out.append(r._cache["result"])
    return out


def _read_stored(backend: Any, waiting: dict[str, list[AsyncResult]], ids: Sequence[str]) -> set[str]:
    ready: set[str] = set()
    for start in range(0, len(ids), _MGET_CHUNK):
        chunk = ids[start : start + _MGET_CHUNK]
        raw = backend.client.mget([backend.get_key_for_task(t) for t in chunk])
        for value in raw:
            if value is not None:
                _settle(waiting, backend.decode_result(value), ready)
    return ready


def gather(
    results: Iterable[AsyncResult], timeout: float | None = None, *, return_exceptions: bool = False
) -> list[Any]:
    """Every result's value, in order: one MGET for what is stored, then pub/sub for the rest.

    Like ``asyncio.gather``: with ``return_exceptions=False`` (default) the first failed request that
    gather learns of (the earliest in ``results`` among those learnt at the same moment) raises its
    stored exception, exactly as its ``.get()`` would (``InvalidInput``, ``DeadlineExceeded``,
    ``ModelError``...); the other requests keep running and stay collectable. With
    ``return_exceptions=True`` a failed request's exception instance takes its place in the list.
    ``timeout`` bounds the whole call and raises ``celery.exceptions.TimeoutError`` as ``.get()``
    does. Results arriving while gather waits are each delivered once, on the subscription made by
    ``submit_many`` (or made here for results from elsewhere); their unsubscriptions go out as one
    command at the end. Not thread-safe, like Celery's result consumer it uses.
    """
    results = list(results)
    if not results:
        return []
    deadline = None if timeout is None else time.monotonic() + timeout
    backend = _same_backend(results)
    consumer = _consumer(backend)
    waiting = _unresolved(results)
    index = dict(waiting)  # waiting loses entries as they settle; the index keeps them
    with _bulk_cancel(backend):
        ready = _read_stored(backend, waiting, list(waiting))
        if not return_exceptions:
            _raise_first_failure(results, ready, index)
        if waiting:
            if consumer is None:  # not an async (pub/sub) backend: Celery's own wait, per result
                for rs in list(waiting.values()):
                    for r in rs:
                        left = None if deadline is None else max(0.0, deadline - time.monotonic())
                        r.get(timeout=left, propagate=False)
                return _values(results, return_exceptions)
            fresh = subscribe_results(backend, list(waiting))
            if fresh:  # subscribed only now: what was stored in between is read, not missed
                ready = _read_stored(backend, waiting, fresh)
                if not return_exceptions:
                    _raise_first_failure(results, ready, index)
            _wait(backend, consumer, results, waiting, index, deadline, return_exceptions)
        _drain_delivered(backend, consumer, limit=2 * len(results) + 100, ignore={r.id for r in results})
    return _values(results, return_exceptions)


def _wait(
    backend: Any,
    consumer: Any,
    results: Sequence[AsyncResult],
    waiting: dict[str, list[AsyncResult]],
    index: Mapping[str, list[AsyncResult]],
    deadline: float | None,
    return_exceptions: bool,
) -> None:
    ready: set[str] = set()
    for task_id, rs in list(waiting.items()):
        for r in rs:
            # Registers r for the consumer; a result that arrived earlier for nobody waiting sits in
            # Celery's buffer and settles r right here.
            backend.add_pending_result(r, start_drainer=False)
        if all(r._cache is not None for r in rs):
            del waiting[task_id]
            ready.add(task_id)
    if not return_exceptions:
        _raise_first_failure(results, ready, index)
    ours = {r.id for r in results}  # a message for one of these no longer waited for: a duplicate
    while waiting:
        left = 1.0 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise CeleryTimeoutError("The operation timed out.")
        ready = set()
        if not _pump(backend, consumer, waiting, ready, timeout=min(left, 1.0), ignore=ours):
            # Celery replaced the connection after an error: what was published meanwhile is lost
            # to us, but stored; read it.
            ready |= _read_stored(backend, waiting, list(waiting))
        if not return_exceptions:
            _raise_first_failure(results, ready, index)


def _pump(
    backend: Any,
    consumer: Any,
    waiting: dict[str, list[AsyncResult]],
    ready: set[str],
    timeout: float,
    limit: int = 10_000,
    ignore: Container[str] = (),
) -> bool:
    """Read the result messages delivered to Celery's pub/sub connection: wait up to ``timeout`` for
    the first, then take whatever else is already there, up to ``limit``. Returns False when the
    connection had to be replaced (messages may have been lost: the caller re-reads stored results).

    Why not ``consumer.drain_events``: it handles one message per call and ends each with
    ``sleep(0)`` (celery/backends/asynchronous.py), about 0.1 ms per result on a busy 2-core machine;
    a burst of thousands spent most of its producer time there. Results this gather waits for are
    settled here (their unsubscriptions go out in bulk, see ``_bulk_cancel``); those in ``ignore``
    (settled already) are dropped undecoded; a message for anything else is handed to Celery's
    consumer as it would have been, so other waiters lose nothing.

    Reading the next message: ``get_message(timeout=0)`` must not be used. redis-py reads the rest of
    a message with the same timeout, so a ~7 KB embedding that had only partly arrived raised
    TimeoutError half-way and left the parser out of step, and the following results were never
    seen (measured: a gather of 300 MiniLM results waited forever for 31 already stored). Here a
    non-blocking ``can_read`` says whether anything is there, and the message is then read with a
    timeout that lets its remainder arrive.
    """
    pubsub = consumer._pubsub
    if pubsub is None:
        return True
    prefix = backend.task_keyprefix
    prefix = prefix.encode() if isinstance(prefix, str) else prefix
    count = 0
    wait = timeout
    with consumer.reconnect_on_error():  # on a connection error: new connection, resubscribed
        while count < limit:
            conn = pubsub.connection
            if conn is None or not conn.can_read(timeout=wait):  # only buffers bytes: safe to time out
                break
            wait = 0.0
            message = pubsub.get_message(timeout=_MESSAGE_READ_S)
            if message is None:  # a (un)subscribe confirmation: look for more
                continue
            count += 1
            if message.get("type") == "message":
                channel = message["channel"]
                channel = channel.encode() if isinstance(channel, str) else channel
                task_id = channel[len(prefix) :].decode() if channel.startswith(prefix) else ""
                if task_id in waiting:
                    settled = _settle(waiting, backend.decode_result(message["data"]), ready)
                    if settled is not None:
                        consumer.cancel_for(settled)
                elif task_id not in ignore:
                    consumer.on_state_change(backend.decode_result(message["data"]), message)
    return consumer._pubsub is pubsub


def _drain_delivered(backend: Any, consumer: Any, limit: int, ignore: Container[str]) -> None:
    """Read result messages already delivered to this process, so the subscriber socket never backs up.

    A result found by MGET may also have been published to us before its unsubscription; left unread,
    such messages pile up in Redis's output buffer for this client across many gathers.
    """
    import redis

    if getattr(consumer, "_pubsub", None) is None:
        return
    try:
        _pump(backend, consumer, {}, set(), timeout=0, limit=limit, ignore=ignore)
    except (redis.RedisError, OSError):
        return


def _async_client(backend: Any) -> Any:
    import redis.asyncio as aioredis

    protocol = backend.connparams.get("protocol", 2)  # RESP2: see CarpoolRedisBackend.__init__
    if getattr(backend, "url", None):
        return aioredis.Redis.from_url(backend.url, protocol=protocol)
    params = {
        k: v
        for k, v in backend.connparams.items()
        if k in ("host", "port", "db", "username", "password", "path") and v is not None
    }
    if "path" in params:
        params["unix_socket_path"] = params.pop("path")
    return aioredis.Redis(**params, protocol=protocol)


async def gather_async(
    results: Iterable[AsyncResult], timeout: float | None = None, *, return_exceptions: bool = False
) -> list[Any]:
    """``await`` every result, in order; same semantics as :func:`gather`.

    Implementation: ``redis.asyncio`` on a connection of its own (SUBSCRIBE to the pending results,
    then one MGET, then wait for messages), not ``gather`` in ``run_in_executor``. Celery's result
    consumer is one non-thread-safe pub/sub connection per process; running it in an executor thread
    while the event loop thread submits (which subscribes on it) or another coroutine gathers would
    race on that socket, and each awaiting coroutine would pin a thread. Here many gathers can await
    at once on one loop, and cancelling the awaiting task closes its connection. Results subscribed on
    Celery's consumer (``submit_many`` with ``subscribe=True``) are unsubscribed there first, so that
    connection does not back up with messages nobody reads; pass ``subscribe=False`` to
    ``submit_many`` to skip that step. Costs one connection per call, closed on return.
    """
    results = list(results)
    if not results:
        return []
    deadline = None if timeout is None else time.monotonic() + timeout
    backend = _same_backend(results)
    waiting = _unresolved(results)
    index = dict(waiting)
    if waiting:
        unsubscribe_results(backend, list(waiting))
        client = _async_client(backend)
        try:
            async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                keys = [backend.get_key_for_task(t) for t in waiting]
                for start in range(0, len(keys), _SUBSCRIBE_CHUNK):
                    await pubsub.subscribe(*keys[start : start + _SUBSCRIBE_CHUNK])
                ids = list(waiting)
                with _bulk_cancel(backend):
                    ready: set[str] = set()
                    for start in range(0, len(ids), _MGET_CHUNK):
                        chunk = keys[start : start + _MGET_CHUNK]
                        for value in await client.mget(chunk):
                            if value is not None:
                                _settle(waiting, backend.decode_result(value), ready)
                    if not return_exceptions:
                        _raise_first_failure(results, ready, index)
                    while waiting:
                        left = 1.0 if deadline is None else deadline - time.monotonic()
                        if left <= 0:
                            raise CeleryTimeoutError("The operation timed out.")
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=min(left, 1.0)
                        )
                        if not message or message.get("type") != "message":
                            continue
                        ready = set()
                        _settle(waiting, backend.decode_result(message["data"]), ready)
                        if not return_exceptions:
                            _raise_first_failure(results, ready, index)
        finally:
            await client.aclose()
    return _values(results, return_exceptions)


__all__ = [
    "gather",
    "gather_async",
    "publish_tasks",
    "submit_many",
    "subscribe_results",
    "unsubscribe_results",
]
