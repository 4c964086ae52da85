"""Per-request Celery task events, so every ``infer.delay()`` shows up in Flower as its own task.

Nobody runs ``carpool.infer`` as a Celery task, so nobody would send its events; the coordinator
sends ``task-received`` when it takes a request, the worker ``task-started`` and then
``task-succeeded``/``task-failed`` with the batch's run time. Events are buffered and published as
one list message per flush (Celery's ``task.multi``; Flower and ``celery events`` accept lists),
so a batch of 32 costs one publish, not 96.

Why not ``app.events.Dispatcher``: its event object, per-event bookkeeping and kombu's publish
(a new Redis client per message) cost more per request than the rest of the pipeline's own work on
a fast model. Here an event is a dict with the fields ``celery.events.Event`` would give it (type,
timestamp, hostname, utcoffset, pid, Lamport clock from ``app.clock``), and a flush is one JSON
encoding into kombu's envelope (:mod:`carpool.celery_edge.fanout`) that the caller can PUBLISH
inside a pipeline it sends anyway.

Events are telemetry: a failure to build or send them is logged and dropped, never allowed to stop
serving. They are also pub/sub: a message nobody is subscribed to reaches no one. So by default
(``CARPOOL_EVENTS=auto``) a process builds them only while some client receives them (Flower,
``celery events``, any event receiver): :class:`Listeners` asks Redis every ``PROBE_INTERVAL_S``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import orjson
from celery import Celery
from celery.states import FAILURE, SUCCESS

from carpool.celery_edge.compat import traceback_of
from carpool.codec import float_row_dtypes, native_numpy, stored_form
from carpool.names import INFER_TASK

if TYPE_CHECKING:
    from carpool.celery_edge.requests import Incoming

log = logging.getLogger(__name__)

TASK_NAME = INFER_TASK
REPR_LIMIT = 200  # characters of a result or argument shown in Flower
SHOWN_ITEMS = 16  # items of a long list shown before its length
_UTCOFFSET_REFRESH_S = 60.0  # the offset changes only at DST transitions
PROBE_INTERVAL_S = 0.1  # how long a monitor that starts listening may miss events

EventsMode = bool | Literal["auto"]
_start_lock = threading.Lock()  # one probe thread per process, whichever thread asks first


def short_repr(value: Any, limit: int = REPR_LIMIT, serializer: str = "json") -> str:
    """A repr of ``value`` cut to ``limit`` characters, without building the whole repr of a long list.

    An embedding is a list of hundreds of floats: a ``repr`` of all of it, to show 200 characters,
    would be the largest per-request cost of a worker on a fast model, and even ``repr`` of the 16
    floats shown costs more than the rest of the event, so numbers are written by orjson where its
    text is ``repr``'s. A model's numpy row is shown as the list a reader of its result stored with
    ``serializer`` gets back.
    """
    if getattr(value, "ndim", None) and hasattr(value, "tolist"):  # a model's row (numpy, torch)
        text = _list_text(value, _array_text(value[:SHOWN_ITEMS], serializer))
    elif isinstance(value, list) or (isinstance(value, tuple) and len(value) > SHOWN_ITEMS):
        head = value[:SHOWN_ITEMS]
        shown = _numbers_text(head) if set(map(type, head)) <= _NUMBERS else None
        text = _list_text(value, ", ".join(map(repr, head)) if shown is None else shown)
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_reprs(values: Sequence[Any], limit: int = REPR_LIMIT, serializer: str = "json") -> list[str]:
    """:func:`short_repr` of each value. Under msgpack the shown items of a batch's float rows are
    checked finite and made Python numbers in one pass for them all: per row, those two calls cost
    more than writing the row's text."""
    numpy = sys.modules.get("numpy")
    if numpy is None or serializer != "msgpack":
        return [short_repr(value, limit, serializer) for value in values]
    floats = float_row_dtypes(numpy)
    heads = [
        value[:SHOWN_ITEMS]
        if type(value) is numpy.ndarray and value.ndim == 1 and value.dtype in floats and len(value)
        else None
        for value in values
    ]
    rows = [head for head in heads if head is not None]
    if not rows:
        return [short_repr(value, limit, serializer) for value in values]
    # Joined, float32 beside float64 heads become float64: the same Python numbers either way.
    joined = numpy.concatenate(rows)
    if not numpy.isfinite(joined).all():  # a reader gets None for those: each row on its own
        return [short_repr(value, limit, serializer) for value in values]
    numbers = joined.tolist()
    out, at = [], 0
    for value, head in zip(values, heads, strict=True):
        if head is None:
            out.append(short_repr(value, limit, serializer))
            continue
        shown = numbers[at : at + len(head)]
        at += len(head)
        written = _numbers_text(shown)
        text = _list_text(value, ", ".join(map(repr, shown)) if written is None else written)
        out.append(text if len(text) <= limit else text[: limit - 3] + "...")
    return out


def _list_text(value: Any, shown: str) -> str:
    size = len(value)
    return f"[{shown}, ... ({size} items)]" if size > SHOWN_ITEMS else f"[{shown}]"


def _array_text(head: Any, serializer: str = "json") -> str:
    """The items of an array as :func:`short_repr` shows them; a numpy array's as a reader of its
    result stored with ``serializer`` gets them back."""
    numpy = sys.modules.get("numpy")
    if numpy is None or type(head) is not numpy.ndarray:
        return ", ".join(map(repr, head.tolist()))
    if serializer == "json":
        shown = _numbers_text(head, orjson.OPT_SERIALIZE_NUMPY) if native_numpy(head) else None
        return ", ".join(map(repr, stored_form(head))) if shown is None else shown
    values = stored_form(head, serializer)  # msgpack: the values themselves, as Python numbers
    shown = _numbers_text(values) if set(map(type, values)) <= _NUMBERS else None
    return ", ".join(map(repr, values)) if shown is None else shown


_NUMBERS = frozenset({float, int})


def _numbers_text(numbers: Any, option: int = 0) -> str | None:
    """``", ".join(map(repr, numbers))`` for numbers (lists of them, from a numpy array), written
    by orjson; None where orjson's text could differ from ``repr``'s: an exponent, a number below
    1e-4 (orjson writes those without one), a non-finite float (``null``), or anything else."""
    try:
        text = orjson.dumps(numbers, option=option)
    except TypeError:  # orjson.JSONEncodeError: not numbers, an integer past 64 bits, a non-contiguous row
        return None
    # Anything but digits, signs, points, commas and brackets (an exponent, null, a string, true),
    # or a number below 1e-4, which orjson writes without an exponent.
    if text.translate(None, b"-0123456789.,[]") or b"0.0000" in text:
        return None
    return text[1:-1].replace(b",", b", ").decode()


class Heard:
    """What a process last heard of event receivers: the answer to a PUBLISH on the events topic
    (how many subscribers got it). Events are wanted until an answer says nobody got them, and
    again once that answer is ``fresh_s`` old, so the next publish asks again."""

    def __init__(
        self, fresh_s: float = PROBE_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._fresh_s, self._clock = fresh_s, clock
        self._nobody_at: float | None = None  # when an answer last said nobody listens

    def heard(self, receivers: int) -> None:
        self._nobody_at = self._clock() if receivers <= 0 else None

    def wanted(self) -> bool:
        nobody_at = self._nobody_at
        return nobody_at is None or self._clock() - nobody_at >= self._fresh_s


class Listeners:
    """Whether any client receives task events now, for a process whose events go out inside Redis
    scripts (where a PUBLISH's answer stays): a daemon thread asks every ``interval_s``.

    It PUBLISHes an empty ``task.multi`` list on the events topic; an event receiver processes that
    as no events. Until the first answer, and while Redis does not answer for a few intervals,
    events are wanted: a monitor already connected misses nothing.
    """

    def __init__(self, client: Any, topic: str, probe: bytes, interval_s: float = PROBE_INTERVAL_S) -> None:
        self.heard = Heard(fresh_s=3 * interval_s)  # one late answer does not turn events on
        self.pid = os.getpid()  # a forked child starts its own: threads do not survive a fork
        self._client, self._topic, self._probe, self._interval_s = client, topic, probe, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="carpool-event-listeners", daemon=True)
        self._thread.start()

    @property
    def listening(self) -> bool:
        return self.heard.wanted()

    def _run(self) -> None:
        while True:
            try:
                self.heard.heard(self._client.publish(self._topic, self._probe))
            except Exception as exc:  # Redis away: serving goes on
                log.debug("could not probe for task event listeners: %s", exc)
            if self._stop.wait(self._interval_s):
                return

    def close(self) -> None:
        self._stop.set()


class TaskEvents:
    """Buffers one process's per-request task events; :meth:`take` or :meth:`flush` sends them.

    One buffer belongs to one thread at a time: a worker whose batches finish on other threads
    gives each batch a :meth:`fork` of its own, so no batch takes another's events.

    ``mode``: True sends them always, False never, ``"auto"`` while :class:`Listeners` says some
    client receives them (always, without a ``client`` to ask).
    """

    def __init__(self, app: Celery, hostname: str, mode: EventsMode = True, client: Any = None) -> None:
        self.mode = mode
        self.hostname = hostname
        self._app = app
        self._serializer = str(app.conf.result_serializer)  # results are shown as their readers get them
        self._client = client  # a redis.Redis on the broker, for flush() and the listener probe
        self._encoder: Any = None
        self._listeners: Listeners | None = None
        self._pid = os.getpid()
        self._buffer: list[dict[str, Any]] = []
        self._utcoffset = 0
        self._utcoffset_at = -_UTCOFFSET_REFRESH_S
        self._root = self  # holds the encoder that forks share

    def fork(self) -> TaskEvents:
        """A TaskEvents with an empty buffer of its own, sharing this one's hostname, encoder and client."""
        child = object.__new__(TaskEvents)
        child.__dict__.update(self.__dict__)
        child._buffer = []
        return child

    @property
    def enabled(self) -> bool:
        """Whether events are built now (checked per event: a monitor may come or go at any time)."""
        root = self._root
        if root.mode != "auto":
            return bool(root.mode)
        if self._client is None:
            return True
        listeners = root._listeners
        if listeners is None or listeners.pid != os.getpid():
            listeners = root._start_listeners()
        return listeners is None or listeners.listening

    def _start_listeners(self) -> Listeners | None:
        with _start_lock:
            if self._listeners is not None and self._listeners.pid == os.getpid():
                return self._listeners
            try:
                encoder = self._event_encoder()
                self._listeners = Listeners(self._client, encoder.topic, encoder.encode([]))
            except Exception as exc:
                log.warning("could not start probing for task event listeners (events stay on): %s", exc)
                self.mode = True
                return None
            return self._listeners

    def start(self) -> None:
        """Start probing for listeners now (``auto``), so that the first requests served find the
        answer in place; otherwise the first event asked for starts it."""
        _ = self.enabled

    def close(self) -> None:
        """Stop probing for listeners (a process that stops serving)."""
        if self._root._listeners is not None:
            self._root._listeners.close()

    def _event_encoder(self) -> Any:
        encoder = self._root._encoder
        if encoder is None:
            from carpool.celery_edge.fanout import event_encoder

            encoder = self._root._encoder = event_encoder(self._app, "task.multi", self.hostname)
        return encoder

    def _header(self, type_: str) -> dict[str, Any]:
        """The fields every event of ``type_`` sent now carries, bar its Lamport clock."""
        now = time.time()
        if now - self._utcoffset_at > _UTCOFFSET_REFRESH_S:
            from celery.utils.time import utcoffset

            root = self._root  # so that later forks start from the fresh offset
            root._utcoffset = self._utcoffset = utcoffset()
            root._utcoffset_at = self._utcoffset_at = now
        return {
            "type": type_,
            "hostname": self.hostname,
            "utcoffset": self._utcoffset,
            "pid": self._pid,
            "timestamp": now,
        }

    def _event(self, type_: str, fields: dict[str, Any]) -> None:
        if self.enabled:
            fields.update(self._header(type_))
            fields["clock"] = self._app.clock.forward()
            self._buffer.append(fields)

    def received(
        self,
        task_id: str,
        argsrepr: str,
        kwargsrepr: str = "{}",
        *,
        name: str = TASK_NAME,
        root_id: str | None = None,
        parent_id: str | None = None,
        retries: int = 0,
        eta: str | None = None,
        expires: str | None = None,
    ) -> None:
        self._event(
            "task-received",
            {
                "uuid": task_id,
                "name": name,
                "args": argsrepr,
                "kwargs": kwargsrepr,
                "retries": retries,
                "eta": eta,
                "expires": expires,
                "root_id": root_id or task_id,
                "parent_id": parent_id,
            },
        )

    def received_of(self, msg: Incoming) -> None:
        """task-received for the request message ``msg``, with the fields a Celery worker's event
        carries from it: Flower's task takes each field of a later event over the task-sent one's."""
        links = msg.links or {}
        self.received(
            msg.id,
            msg.argsrepr,
            msg.kwargsrepr,
            name=msg.shadow or msg.task,  # as a Celery worker names a shadowed task's events
            root_id=links.get("root_id"),
            parent_id=links.get("parent_id"),
            eta=_iso(msg.eta_at),
            expires=_iso(msg.expires_at),
        )

    def started(self, task_ids: Iterable[str]) -> None:
        if self.enabled:
            header, forward = self._header("task-started"), self._app.clock.forward
            self._buffer += [{**header, "uuid": task_id, "clock": forward()} for task_id in task_ids]

    def succeeded(self, task_id: str, result: Any, runtime_s: float, limit: int = REPR_LIMIT) -> None:
        self._event(
            "task-succeeded",
            {"uuid": task_id, "result": short_repr(result, limit, self._serializer), "runtime": runtime_s},
        )

    def outcomes(self, entries: Iterable[tuple[str, str, Any]], runtime_s: float) -> None:
        """task-succeeded, task-failed or task-revoked per (task id, Celery state, result or
        exception), each with the same ``runtime_s`` (its batch's)."""
        if not self.enabled:
            return
        header = {**self._header("task-succeeded"), "runtime": runtime_s}
        forward, buffer = self._app.clock.forward, self._buffer
        entries = list(entries)
        shown = iter(
            short_reprs(
                [value for _, state, value in entries if state == SUCCESS], serializer=self._serializer
            )
        )
        for task_id, state, value in entries:
            if state == SUCCESS:
                buffer.append({**header, "uuid": task_id, "result": next(shown), "clock": forward()})
            elif state == FAILURE:  # a batch function's exception shows with its traceback, as Celery's
                self.failed(task_id, value, runtime_s, traceback_of(value))
            else:  # revoked, or its caller's expires= passed (Celery's revoke, 'expired')
                self.revoked(task_id, expired=getattr(value, "args", None) == ("expired",))

    def failed(
        self,
        task_id: str,
        exc: BaseException,
        runtime_s: float | None = None,
        traceback: str | None = None,
    ) -> None:
        self._event(
            "task-failed",
            {"uuid": task_id, "exception": short_repr(exc), "traceback": traceback, "runtime": runtime_s},
        )

    def revoked(self, task_id: str, expired: bool = False) -> None:
        self._event(
            "task-revoked", {"uuid": task_id, "terminated": False, "signum": None, "expired": expired}
        )

    def take(self) -> tuple[str, bytes] | None:
        """The buffered events as one ``task.multi`` message: (topic, raw) to PUBLISH; None if none.

        The buffer is emptied either way: events that cannot be encoded are dropped (telemetry).
        """
        return self.encoded(self.take_buffered())

    def take_buffered(self) -> list[dict[str, Any]]:
        """The buffered events themselves, the buffer emptied."""
        events, self._buffer = self._buffer, []
        return events

    def encoded(self, events: list[dict[str, Any]]) -> tuple[str, bytes] | None:
        """``events`` as one ``task.multi`` message: (topic, raw) to PUBLISH; None if none, or if
        they cannot be encoded (dropped: telemetry)."""
        if not events:
            return None
        try:
            encoder = self._event_encoder()
            return encoder.topic, encoder.encode(events)
        except Exception as exc:
            log.warning("could not encode %d task events (Flower will miss them): %s", len(events), exc)
            return None

    def flush(self) -> None:
        """Publish what is buffered, on the client given at construction."""
        message = self.take()
        if message is None or self._client is None:
            return
        try:
            self._client.publish(*message)
        except Exception as exc:
            log.warning("could not publish task events (Flower will miss them): %s", exc)


_OUTCOMES = frozenset({"task-succeeded", "task-failed", "task-revoked"})


def answered_elsewhere(
    events: list[dict[str, Any]], refused: set[str], revoked: set[str]
) -> list[dict[str, Any]]:
    """``events`` without the outcomes of the ``refused`` requests (their results were not stored:
    each had an answer already), those of them answered REVOKED (``revoked``: by another worker's
    revoke handler, which sends no event) said revoked instead. The others' answers are an earlier
    run's, which sent its own events."""
    out = []
    for event in events:
        task_id = event.get("uuid")
        if task_id in refused and event.get("type") in _OUTCOMES:
            if task_id not in revoked:
                continue
            event = {
                **event,
                "type": "task-revoked",
                "terminated": False,
                "signum": None,
                "expired": False,
            }
            for field in ("result", "exception", "traceback", "runtime"):
                event.pop(field, None)
        out.append(event)
    return out


def _iso(wall_s: float | None) -> str | None:
    """An instant as the ISO 8601 text Celery's messages and events carry."""
    return None if wall_s is None else datetime.fromtimestamp(wall_s, UTC).isoformat()
