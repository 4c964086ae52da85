"""Celery protocol-2 task messages for a Redis queue: what ``app.send_task`` would publish, built fast.

How a message is built (tests/integration/test_client.py compares the result with Celery's own
messages field by field):

- headers, properties and body come from ``app.amqp.create_task_message`` (``as_task_v2``), exactly
  as ``app.send_task`` builds them;
- the body is serialised with ``kombu.serialization.dumps`` (the app's task serializer), the
  envelope made with the Redis channel's ``prepare_message`` and finished as kombu's
  ``basic_publish`` finishes it (base64 body, delivery tag, delivery info);
- the envelope is JSON-encoded for the list ``Channel._put`` would push it to for its priority
  (``<queue>`` or ``<queue>\\x06\\x16<step>``);
- with sent events on, each message's ``task-sent`` event gets the fields Celery's event dispatcher
  gives it, and the events go out as ``task.multi`` lists of up to 1,000 (what Celery's buffered
  dispatcher sends; Flower and ``celery events`` unpack them): one PUBLISH per list, not per request.

Past the first two messages a builder renders from a template of Celery's own envelope (see
:class:`TaskMessageBuilder`). Sending is the caller's: :func:`carpool.producer.submit.publish_tasks`
for producers, the coordinator's dispatch script for batches.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import orjson
from celery import signals
from celery.utils.saferepr import saferepr
from celery.utils.time import utcoffset
from kombu.entity import maybe_delivery_mode
from kombu.serialization import dumps as serialize
from kombu.utils.json import dumps as envelope_dumps

from carpool.celery_edge import compat
from carpool.celery_edge.app import state_of
from carpool.celery_edge.fanout import FanoutEncoder
from carpool.codec import dumps_plain, flat_plain

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

EVENTS_PER_MESSAGE = 1000  # task-sent events per task.multi message


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
        for body, task_headers in self._after:
            signals.after_task_publish.send(
                sender=self.name, body=body, headers=task_headers, exchange="", routing_key=self.queue
            )


class TaskMessageBuilder:
    """Builds the messages ``app.send_task(name, ..., **options)`` would publish, options fixed.

    Celery's ``create_task_message`` and kombu's ``prepare_message`` are most of a message's cost, so
    the builder has Celery build the first message and keeps it as a template; when Celery's build
    of a later message equals what the template renders for it (checked field by field, once), every
    message after that is rendered from the template (the id, reprs, body and delivery tag
    substituted into pre-serialised JSON). The template lives as long as the builder, so a
    coordinator cutting one batch at a time pays for Celery's build twice in its lifetime, not twice
    per step. With publish signal receivers, compression or a mismatch, every message is built by
    Celery.

    ``expires`` in seconds is turned into one instant when the builder is made. ``ignore_result``
    goes into the headers, where it overrides the task's own setting on the worker (as
    ``send_task(..., ignore_result=True)`` does). Celery's ``before_task_publish`` receivers run in
    :meth:`build`, ``after_task_publish`` ones on :meth:`TaskMessages.published`; ``build``'s
    ``task_ids`` and ``argsreprs`` (one per call) replace the generated id and the computed repr.
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
        per_build_headers: Sequence[str] = (),
    ) -> None:
        conf = app.conf
        route = app.amqp.router.route({"queue": queue} if queue else {}, name, (), {})
        target = route["queue"]
        exchange = getattr(target, "exchange", None)
        if route.get("exchange") or (exchange is not None and exchange.type not in (None, "direct")):
            raise ValueError(
                f"{name} is routed through exchange {exchange!r}; publish_tasks sends to direct queues only"
            )
        self.app = app
        self._state = state_of(app)
        self.name = name
        self.target = target
        self.qname: str = target.name
        self.priority = priority
        self.delivery_mode = maybe_delivery_mode(  # type: ignore[no-untyped-call]
            (exchange.delivery_mode if exchange is not None else None) or conf.task_default_delivery_mode
        )
        self.serializer = conf.task_serializer
        self.compression = conf.task_compression
        self.sent_events = bool(conf.task_send_sent_event) if sent_events is None else sent_events
        if isinstance(expires, int | float) and not isinstance(expires, bool):
            # Seconds from now become one instant, fixed here for every message the builder makes
            # (Celery would add them per message).
            expires = app.now() + timedelta(seconds=expires)
        self.expires = expires
        self.extra_headers = dict(headers or {})
        # Headers whose values each build call gives (``build(header_values=...)``): slots in the
        # template, so one builder serves calls that differ only there (``.delay()``'s sent-at time).
        self.per_build_headers = tuple(per_build_headers)
        self.ignore_result = ignore_result
        self.reply_to = app.thread_oid
        self._template: _MessageTemplate | None = None
        self._trusted = False  # the template rendered one of Celery's own builds exactly
        self._untrusted = False  # ... or failed to: Celery builds every message from then on
        # The task-sent events' encoder, kept with the channel and dispatcher headers it was made
        # for: a lone .delay() is one build, and making an encoder costs as much as its message.
        self._sent_encoder: tuple[Any, dict[str, Any], FanoutEncoder] | None = None

    def build(
        self,
        calls: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        task_ids: Sequence[str] | None = None,
        argsreprs: Sequence[str] | None = None,
        header_values: Mapping[str, Any] | None = None,
        plain: bool = False,
        events: bool = True,
    ) -> TaskMessages:
        """The messages of ``calls`` (args, kwargs each). ``plain``: every argument is a value as JSON
        decodes it (dicts with string keys, lists, strings, numbers, booleans, None) and no float in
        it is inf or nan, so orjson writes the bodies as kombu would, nested values too, without the
        per-call type check that arbitrary ``.delay()`` arguments need. ``events``: False leaves the
        task-sent events out of this build even where the builder sends them."""
        app, name, qname = self.app, self.name, self.qname
        extra_headers = self.extra_headers
        per_build: tuple[Any, ...] = ()
        if self.per_build_headers:
            given = dict(header_values or {})
            unknown = set(given) - set(self.per_build_headers)
            if unknown or len(given) != len(self.per_build_headers):
                raise ValueError(f"give exactly the headers {self.per_build_headers}, not {sorted(given)}")
            extra_headers = {**extra_headers, **given}
            per_build = tuple(given[h] for h in self.per_build_headers)
        elif header_values:
            raise ValueError("this builder takes no per-build headers")
        # The per-build header values as JSON, encoded once for every message this call renders.
        per_build_json = tuple(envelope_dumps(v) for v in per_build)  # type: ignore[no-untyped-call]
        expires = self.expires
        evd = self._state.event_dispatcher() if self.sent_events and events else None
        before = signals.before_task_publish.receivers
        after = signals.after_task_publish.receivers
        templating = not (before or after or self.compression or self._untrusted)
        built = TaskMessages(name=name, queue=qname, ids=[], pushes={}, events=[], _after=[])
        argsrepr_max = app.amqp.argsrepr_maxsize
        channel = self._state.message_channel()
        sent: list[dict[str, Any]] = []
        utc_offset = int(utcoffset()) if evd is not None else 0

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
            task_headers.update(extra_headers)
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
            content_type, content_encoding, data = serialize(body, serializer=self.serializer)  # type: ignore[no-untyped-call]
            if self.compression:
                from kombu.compression import compress

                data, task_headers["compression"] = compress(data, self.compression)  # type: ignore[no-untyped-call]
            properties["delivery_mode"] = self.delivery_mode
            message = channel.prepare_message(
                data, self.priority, content_type, content_encoding, task_headers, properties
            )
            compat.augment_message(channel, message, "", qname)
            return message, body, task_headers, sent_event

        # Two random ids per message (its task id and delivery tag), drawn in one read.
        fresh = iter(uuid4_strings(len(calls) * (1 if task_ids is not None else 2)))
        for index, (call_args, call_kwargs) in enumerate(calls):
            task_id = task_ids[index] if task_ids is not None else next(fresh)
            args = tuple(call_args)  # as Task.delay passes them (argsrepr shows a tuple)
            kwargs = dict(call_kwargs)
            argsrepr = argsreprs[index] if argsreprs is not None else _fast_repr(args, argsrepr_max)
            template = self._template if templating and self._trusted else None
            if template is not None:
                if argsrepr is None:
                    argsrepr = saferepr(args, argsrepr_max)
                kwargsrepr = "{}" if not kwargs else saferepr(kwargs, argsrepr_max)
                raw = template.render(
                    task_id, args, kwargs, argsrepr, kwargsrepr, next(fresh), per_build_json, plain=plain
                )
                sent_event = template.sent_event(task_id, argsrepr, kwargsrepr) if evd is not None else None
                key = template.key
            else:
                message, body, task_headers, sent_event = celery_built(task_id, args, kwargs, argsrepr)
                key = compat.priority_list(channel, qname, message)
                raw = envelope_dumps(message)  # type: ignore[no-untyped-call]
                if after:
                    built._after.append((body, task_headers))
                if templating:
                    # Celery makes the sent event whenever the builder sends events, also for a build
                    # that leaves them out: the template is checked against it either way.
                    self._learn(
                        message,
                        body,
                        sent_event,
                        raw,
                        key,
                        task_id,
                        args,
                        kwargs,
                        sent_event is not None,
                        plain,
                    )
            built.pushes.setdefault(key, []).append(raw)
            if evd is not None and sent_event is not None:
                sent_event.update(queue=qname, exchange="", routing_key=qname)
                sent.append(_sent_event_fields(evd, sent_event, utc_offset))
            built.ids.append(task_id)
        if sent:
            # One task.multi list message per chunk, as Celery's buffered event dispatcher sends them
            # (Flower and `celery events` unpack lists), instead of one PUBLISH per request.
            assert evd is not None  # events are only collected with a dispatcher
            encoder = self._events_encoder(channel, evd)
            for start in range(0, len(sent), EVENTS_PER_MESSAGE):
                built.events.append(
                    (encoder.topic, encoder.encode(sent[start : start + EVENTS_PER_MESSAGE]).decode())
                )
        return built

    def _events_encoder(self, channel: Any, evd: Any) -> FanoutEncoder:
        """The encoder of task-sent events for ``channel`` and dispatcher ``evd``, made once per pair."""
        kept = self._sent_encoder
        headers = dict(evd.headers)
        if kept is not None and kept[0] is channel and kept[1] == headers:
            return kept[2]
        encoder = FanoutEncoder(channel, evd.exchange.name, "task.multi", headers)
        self._sent_encoder = (channel, headers, encoder)
        return encoder

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
        plain: bool,
    ) -> None:
        """Make a template from Celery's first message; trust it once it renders Celery's second."""
        template = self._template
        if template is None:
            self._template = _MessageTemplate.maybe(message, body, sent_event, key, self.per_build_headers)
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
            tuple(envelope_dumps(headers[h]) for h in self.per_build_headers),  # type: ignore[no-untyped-call]
            plain=plain,
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
        self,
        message: dict[str, Any],
        body: Any,
        sent_event: dict[str, Any] | None,
        key: str,
        per_build_headers: Sequence[str] = (),
    ) -> None:
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
        fields = {"id": 0, "body": 1, "argsrepr": 2, "kwargsrepr": 3, "tag": 4}
        for i, header in enumerate(per_build_headers):
            headers[header] = slot(f"h{i}")
            fields[f"h{i}"] = 5 + i
        parts = self._SLOT.split(envelope_dumps(msg))  # type: ignore[no-untyped-call]
        # One str.format call renders a message: literals with their braces doubled, each slot a
        # numbered field ({0} id, {1} body, {2} argsrepr, {3} kwargsrepr, {4} delivery tag, then the
        # per-build headers).
        pieces = [
            f"{{{fields[part]}}}" if i % 2 else part.replace("{", "{{").replace("}", "}}")
            for i, part in enumerate(parts)
        ]
        self._format = "".join(pieces).format
        self._embed = body[2]
        self._sent = dict(sent_event) if sent_event is not None else None
        self._root_is_id = sent_event is not None and sent_event.get("root_id") == task_id

    @classmethod
    def maybe(
        cls,
        message: dict[str, Any],
        body: Any,
        sent_event: Any,
        key: str,
        per_build_headers: Sequence[str] = (),
    ) -> _MessageTemplate | None:
        props = message.get("properties", {})
        if props.get("body_encoding") != "base64" or message.get("content-type") != "application/json":
            return None
        if not (isinstance(body, tuple | list) and len(body) == 3):
            return None
        return cls(message, body, sent_event, key, per_build_headers)

    def render(
        self,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        argsrepr: str,
        kwargsrepr: str,
        tag: str,
        per_build_json: tuple[str, ...] = (),
        *,
        plain: bool = False,
    ) -> str:
        """The message's envelope; ``per_build_json``: the per-build headers' values, as JSON."""
        # Plain arguments (texts, a model name; anything as JSON decoded it) are encoded by orjson:
        # the same JSON values as kombu's encoder, which is kept for anything it would tag
        # (datetime, UUID, ...) and for what orjson refuses (integers past 64 bits, lone surrogates).
        data = dumps_plain((args, kwargs, self._embed)) if plain or flat_plain(args, kwargs) else None
        if data is None:
            data = envelope_dumps((args, kwargs, self._embed)).encode("utf-8")  # type: ignore[no-untyped-call]
        # base64 needs no JSON escaping; the others are encoded once each, however often they appear.
        return self._format(
            _json_str(task_id),
            '"' + base64.b64encode(data).decode("ascii") + '"',
            _json_str(argsrepr),
            '"{}"' if kwargsrepr == "{}" else _json_str(kwargsrepr),
            _json_str(tag),
            *per_build_json,
        )

    def sent_event(self, task_id: str, argsrepr: str, kwargsrepr: str) -> dict[str, Any] | None:
        if self._sent is None:
            return None
        event = dict(self._sent, uuid=task_id, args=argsrepr, kwargs=kwargsrepr)
        if self._root_is_id:
            event["root_id"] = task_id
        return event


def uuid4_strings(count: int) -> list[str]:
    """``count`` random (version 4) UUIDs as ``str(uuid.uuid4())`` gives them, from one read of the
    OS's randomness instead of one read and one UUID object each."""
    digits = os.urandom(16 * count).hex()
    out = []
    for start in range(0, 32 * count, 32):
        h = digits[start : start + 32]
        # The version nibble is 4; the variant's two high bits are 10 (RFC 4122).
        variant = "89ab"[int(h[16], 16) & 3]
        out.append(f"{h[0:8]}-{h[8:12]}-4{h[13:16]}-{variant}{h[17:20]}-{h[20:32]}")
    return out


def _fast_repr(args: tuple[Any, ...], limit: int) -> str | None:
    """``saferepr(args)`` for the common case (short plain strings), where the two agree; else None."""
    if all(type(a) is str for a in args):
        text = repr(args)
        if len(text) <= limit and "\\" not in text and '"' not in text:
            return text
    return None  # Celery computes saferepr


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
