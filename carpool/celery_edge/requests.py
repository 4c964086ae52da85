"""Decode the Celery (protocol 2) messages that ``infer.delay()`` writes into the request list.

Envelope (kombu's Redis transport): ``{"body": base64(json([args, kwargs, embed])), "headers": {"id",
"task", "expires", ...}, "properties": {"priority", "body_encoding", ...}, "content-type", ...}``.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Container
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kombu.exceptions import ContentDisallowed, DecodeError
from kombu.serialization import loads

from carpool.codec import loads as json_loads
from carpool.errors import MalformedMessage, RefusedMessage
from carpool.names import INBOX_HEADER, INFER_TASK, SENT_AT_HEADER
from carpool.wire import Links

TASK_NAME = INFER_TASK  # the built-in task; @batched tasks' messages share the request queue


# Not frozen: a frozen dataclass sets each field through object.__setattr__, per request.
@dataclass(slots=True)
class Incoming:
    """A decoded request message; ``args``/``kwargs`` still unvalidated. Treat it as read-only."""

    id: str
    task: str
    args: Any
    kwargs: Any
    priority: int
    sent_at: float | None  # wall clock
    expires_at: float | None  # wall clock
    argsrepr: str
    kwargsrepr: str
    eta_at: float | None = None  # wall clock: not to run before (countdown= / eta=)
    links: Links | None = None  # callbacks, chain, root and parent ids: None when it has none
    inbox: str | None = None  # the producer's result inbox channel, when it named one


def decode(raw: bytes, tasks: Container[str] = (TASK_NAME,)) -> Incoming:
    """Decode ``raw``, a message for one of ``tasks``, or raise :class:`MalformedMessage` naming what
    is wrong with it."""
    try:
        envelope = json_loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise MalformedMessage("not a Celery message: the envelope is not JSON") from None
    if not isinstance(envelope, dict) or not isinstance(envelope.get("headers"), dict):
        raise MalformedMessage("not a Celery message: no headers")
    headers = envelope["headers"]
    task = headers.get("task")
    if not isinstance(task, str):
        raise MalformedMessage(f"not a Celery task message: its task name is {task!r}")
    task_id = headers.get("id")
    if not isinstance(task_id, str) or not task_id:
        raise MalformedMessage("Celery message without a task id")
    props = envelope.get("properties") or {}
    if not isinstance(props, dict):
        raise MalformedMessage("not a Celery message: its properties are not an object")
    body = envelope.get("body")
    try:
        if props.get("body_encoding") == "base64":
            if not isinstance(body, str | bytes):
                raise MalformedMessage("message body is missing")
            body = base64.b64decode(body, validate=True)
        content_type = envelope.get("content-type", "application/json")
        if not isinstance(body, str | bytes):
            raise MalformedMessage("message body is missing")
        if content_type == "application/json" and envelope.get("content-encoding", "utf-8") == "utf-8":
            # What every Celery producer sends: plain JSON decoding, without kombu's registry lookups
            # (which cost as much again as the decoding, per request). The args are strings; kombu's
            # tagged types ({"__type__": ...}) would only reach validation, which names the problem.
            decoded = json_loads(body)
        else:
            decoded = loads(  # type: ignore[no-untyped-call]  # kombu is untyped
                body, content_type, envelope.get("content-encoding", "utf-8"), accept={"application/json"}
            )
    except ContentDisallowed:
        raise MalformedMessage(
            f"content type {envelope.get('content-type')!r} refused: carpool accepts JSON only"
        ) from None
    except (DecodeError, binascii.Error, TypeError, ValueError) as exc:
        raise MalformedMessage(f"message body does not decode: {exc}") from None
    if not (isinstance(decoded, list) and len(decoded) == 3):
        raise MalformedMessage("message body is not Celery protocol 2 (args, kwargs, embed)")
    args, kwargs, embed = decoded
    eta = headers.get("eta")
    links = None
    # Celery sends {"callbacks": None, "errbacks": None, "chain": None, "chord": None} when none.
    if headers.get("parent_id") or (
        type(embed) is dict and (embed.get("callbacks") or embed.get("errbacks") or embed.get("chain"))
    ):
        links = _links(embed, headers)
    inbox = headers.get(INBOX_HEADER)
    inbox = inbox if type(inbox) is str and inbox else None
    try:
        expires_at = _when(headers.get("expires"), "expires")
        eta_at = None if eta is None else _when(eta, "eta")
    except ValueError as exc:  # readable enough to answer its caller with the reason
        raise RefusedMessage(str(exc), task_id=task_id, task=task, links=links, inbox=inbox) from None
    if task not in tasks:
        # A task of a module the coordinators do not import yet (a rolling deploy), or one routed
        # here by mistake: its caller learns why at once instead of waiting on a dead letter.
        raise RefusedMessage(
            f"unknown task name {task!r}: this deployment's coordinators serve only {TASK_NAME} and the"
            " @batched tasks of CARPOOL_IMPORTS (add the task's module to CARPOOL_IMPORTS on the"
            " coordinators and workers, or route the task to a queue a Celery worker serves)",
            task_id=task_id,
            task=task,
            links=links,
            inbox=inbox,
        )
    return Incoming(
        id=task_id,
        task=task,
        args=args,
        kwargs=kwargs,
        priority=_priority(props.get("priority")),
        sent_at=_number(headers.get(SENT_AT_HEADER)),
        expires_at=expires_at,
        argsrepr=str(headers.get("argsrepr") or "")[:200],
        kwargsrepr=str(headers.get("kwargsrepr") or "{}")[:200],
        eta_at=eta_at,
        links=links,
        inbox=inbox,
    )


def inbox_in(raw: bytes) -> str | None:
    """The result inbox channel named in the message ``raw``, without decoding its body; None when
    it names none or is no Celery message."""
    try:
        inbox = json_loads(raw).get("headers").get(INBOX_HEADER)
    except (ValueError, UnicodeDecodeError, AttributeError):  # not JSON, or no headers object
        return None
    return inbox if type(inbox) is str and inbox else None


def _links(embed: Any, headers: dict[str, Any]) -> Links:
    """The embed's callbacks, error callbacks and chain, and the canvas ids the tracer would pass on."""
    links: Links = {}
    if isinstance(embed, dict):
        if embed.get("callbacks"):
            links["callbacks"] = _signatures(embed, "callbacks")
        if embed.get("errbacks"):
            links["errbacks"] = _signatures(embed, "errbacks")
        if embed.get("chain"):
            links["chain"] = _signatures(embed, "chain")
    root_id = headers.get("root_id")
    if isinstance(root_id, str) and root_id:
        links["root_id"] = root_id
    parent_id = headers.get("parent_id")
    if isinstance(parent_id, str) and parent_id:
        links["parent_id"] = parent_id
    return links


def _signatures(embed: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = embed[key]
    if not (isinstance(value, list) and all(isinstance(sig, dict) for sig in value)):
        raise MalformedMessage(f"the message's {key} is not a list of signatures")
    return value


def _priority(value: Any) -> int:
    try:
        return max(0, min(255, int(value)))
    except (TypeError, ValueError, OverflowError):  # OverflowError: a client's Infinity
        return 0


def _number(value: Any) -> float | None:
    """A finite number of seconds, else None (a client's ``NaN`` or ``Infinity`` means nothing here)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            return None
        if math.isfinite(number):
            return number
    return None


# The epoch seconds a UTC datetime can hold: from year 1 up to, not including, year 10000.
_EARLIEST = datetime.min.replace(tzinfo=UTC).timestamp()
_END = datetime.max.replace(tzinfo=UTC).timestamp()  # rounds up to the first instant of year 10000


def _when(value: Any, header: str) -> float | None:
    """Celery sends ``eta`` and ``expires`` as ISO 8601 datetimes (or, from old clients, epoch seconds).

    Raises ``ValueError`` for a time no datetime can hold: it could be neither compared with a
    datetime nor reported as one (Flower's eta), and it is no time a request runs or expires at.
    """
    if value is None:
        return None
    if isinstance(value, int | float):
        when = _number(value)
        if when is None:
            return None
    else:
        try:
            dt = datetime.fromisoformat(str(value))
        except ValueError:
            return None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        when = dt.timestamp()  # a UTC offset can move a time in year 1 or 9999 past either end
    if not _EARLIEST <= when < _END:
        raise ValueError(
            f"{header} {value!r} lies outside the years 1 to 9999 that a datetime holds; "
            f"send an {header} within them"
        )
    return when
