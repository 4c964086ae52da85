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

from carpool.celery_edge.options import UNSUPPORTED_OPTIONS
from carpool.codec import MAX_DEPTH, brief, kombu_tags, tag_failure
from carpool.codec import loads as json_loads
from carpool.codec import loads_numbers_loosely as envelope_loads
from carpool.errors import MalformedMessage, RefusedMessage
from carpool.names import INBOX_HEADER, INFER_TASK, NOT_SENDABLE, RUN_BATCH_TASK, SENT_AT_HEADER
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
    shadow: str | None = None  # the name the caller gave it for logs and monitors (shadow=)


def _refuse_protocol_1(envelope: dict[str, Any]) -> None:
    """Raise a refusal to answer under its id if ``envelope`` is a task message of Celery's protocol
    1 (``task_protocol=1``: the task's name and id in a JSON body, no task header); else nothing."""
    props = envelope.get("properties")
    body = envelope.get("body")
    if not (isinstance(props, dict) and props.get("body_encoding") == "base64" and isinstance(body, str)):
        return
    try:
        decoded = json_loads(base64.b64decode(body))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return
    if not isinstance(decoded, dict):
        return
    task, task_id = decoded.get("task"), decoded.get("id")
    if isinstance(task, str) and isinstance(task_id, str) and task_id:
        raise _refused(
            task_id,
            task,
            None,
            "sent with Celery's task message protocol 1 (task_protocol=1): carpool reads protocol 2,"
            " Celery's default since 4.0; send from an app with task_protocol=2",
        )


def decode(raw: bytes, tasks: Container[str] = (TASK_NAME,)) -> Incoming:
    """Decode ``raw``, a message for one of ``tasks``, or raise :class:`MalformedMessage` naming what
    is wrong with it."""
    try:
        envelope = envelope_loads(raw)  # its numbers are only read; the body's are passed on
    except (ValueError, UnicodeDecodeError):
        raise MalformedMessage("not a Celery message: the envelope is not JSON") from None
    if not isinstance(envelope, dict) or not isinstance(envelope.get("headers"), dict):
        raise MalformedMessage("not a Celery message: no headers")
    headers = envelope["headers"]
    task = headers.get("task")
    if not isinstance(task, str):
        _refuse_protocol_1(envelope)
        raise MalformedMessage(f"not a Celery task message: its task name is {task!r}")
    task_id = headers.get("id")
    inbox = headers.get(INBOX_HEADER)
    inbox = inbox if type(inbox) is str and inbox else None
    if not isinstance(task_id, str) or not task_id:
        # The take found the request under its correlation id, which its caller waits on: answer there.
        props = envelope.get("properties")
        named = props.get("correlation_id") if isinstance(props, dict) else None
        if isinstance(named, str) and named:
            raise _refused(
                named,
                task,
                inbox,
                "the message has no task id header (only a correlation id): send it with Celery's own"
                " send (apply_async, send_task), which writes one",
            )
        raise MalformedMessage("Celery message without a task id")

    props = envelope.get("properties") or {}
    if not isinstance(props, dict):
        raise _refused(task_id, task, inbox, "not a Celery message: its properties are not an object")
    compression = headers.get("compression")
    if compression:
        raise _refused(
            task_id,
            task,
            inbox,
            f"the message body is compressed ({compression}): carpool requests are plain JSON; send"
            " them from an app without task_compression (or compression=)",
        )
    body = envelope.get("body")
    try:
        if props.get("body_encoding") == "base64":
            if not isinstance(body, str | bytes):
                raise _refused(task_id, task, inbox, "message body is missing")
            body = base64.b64decode(body)  # as kombu decodes it: wrapped lines too
        content_type = envelope.get("content-type", "application/json")
        if not isinstance(body, str | bytes):
            raise _refused(task_id, task, inbox, "message body is missing")
        if content_type == "application/json" and envelope.get("content-encoding", "utf-8") == "utf-8":
            # What every Celery producer sends: plain JSON decoding, without kombu's registry lookups
            # (which cost as much again as the decoding, per request). kombu's type tags
            # ({"__type__": ..., "__value__": ...}) stay dicts here: in an item, validation refuses
            # them; in a link, :func:`_tags_decode` checks that the worker can decode them.
            decoded = json_loads(body)
        else:
            decoded = loads(  # type: ignore[no-untyped-call]  # kombu is untyped
                body, content_type, envelope.get("content-encoding", "utf-8"), accept={"application/json"}
            )
    except ContentDisallowed:
        raise _refused(
            task_id,
            task,
            inbox,
            f"content type {envelope.get('content-type')!r} refused: carpool accepts JSON only (send"
            " from an app with task_serializer='json')",
        ) from None
    except RecursionError:  # JSON nested past what orjson and then Python's decoder read
        raise _refused(
            task_id,
            task,
            inbox,
            f"message body does not decode: nested too deep (carpool reads up to {MAX_DEPTH} levels)",
        ) from None
    except (DecodeError, binascii.Error, TypeError, ValueError) as exc:
        raise _refused(task_id, task, inbox, f"message body does not decode: {exc}") from None
    if not (isinstance(decoded, list) and len(decoded) == 3):
        raise _refused(task_id, task, inbox, "message body is not Celery protocol 2 (args, kwargs, embed)")
    args, kwargs, embed = decoded
    eta = headers.get("eta")
    links = None
    # Celery sends {"callbacks": None, "errbacks": None, "chain": None, "chord": None} when none.
    if headers.get("parent_id") or (
        type(embed) is dict and (embed.get("callbacks") or embed.get("errbacks") or embed.get("chain"))
    ):
        links = _links(embed, headers, task_id, task, inbox)
        if "errbacks" in links and isinstance(args, list) and isinstance(kwargs, dict):
            links["args"], links["kwargs"] = args, kwargs
    # The worker decodes a batch message with kombu's type tags: a tag in a link that does not decode
    # would fail the whole batch. Its key is in the body as "__type__" or escaped (\u...).
    if links is not None and _may_hold_tag(body):
        _tags_decode(links, task_id, task, inbox)
    try:
        expires_at = _when(headers.get("expires"), "expires")
        eta_at = None if eta is None else _when(eta, "eta")
    except ValueError as exc:  # readable enough to answer its caller with the reason
        raise RefusedMessage(str(exc), task_id=task_id, task=task, links=links, inbox=inbox) from None
    unsupported = _unsupported_option(headers, embed)
    if unsupported is not None:
        option, why = unsupported
        if option == "chord":
            # The chord's body waits on a counter no batch worker advances: its caller is answered
            # with the refusal stored under the body's ids, as a failed chain step's are.
            links = links if links is not None else _links(embed, headers, task_id, task, inbox)
            links["chain"] = [*links.get("chain", []), embed["chord"]]
        raise RefusedMessage(
            f"{option}= is not supported by carpool tasks: {why} (the message was sent from an app"
            " that does not refuse it at the call, as carpool's own does)",
            task_id=task_id,
            task=task,
            links=links,
            inbox=inbox,
        )
    if task == RUN_BATCH_TASK:
        raise RefusedMessage(
            NOT_SENDABLE,
            task_id=task_id,
            task=task,
            links=links,
            inbox=inbox,
        )
    if task not in tasks:
        # A task of a module the coordinators do not import yet (a rolling deploy), or one routed
        # here by mistake: its caller learns why at once instead of waiting on a dead letter.
        raise RefusedMessage(
            f"unknown task name {task!r}: this deployment's coordinators serve only {TASK_NAME} and the"
            " @batched tasks of CARPOOL_IMPORTS (for a @batched task, add its module to CARPOOL_IMPORTS"
            " on the coordinators and workers; a plain Celery task sent from a process that does not"
            " import it needs a queue a Celery worker serves, on its signature: sig.set(queue=...))",
            task_id=task_id,
            task=task,
            links=links,
            inbox=inbox,
        )
    priority = _priority(props.get("priority"))
    if links is not None and priority:
        links["priority"] = priority
    return Incoming(
        id=task_id,
        task=task,
        args=args,
        kwargs=kwargs,
        priority=priority,
        sent_at=_number(headers.get(SENT_AT_HEADER)),
        expires_at=expires_at,
        argsrepr=str(headers.get("argsrepr") or "")[:200],
        kwargsrepr=str(headers.get("kwargsrepr") or "{}")[:200],
        eta_at=eta_at,
        links=links,
        inbox=inbox,
        shadow=shadow if isinstance(shadow := headers.get("shadow"), str) and shadow else None,
    )


def _unsupported_option(headers: dict[str, Any], embed: Any) -> tuple[str, str] | None:
    """The first option in a message that carpool's own ``apply_async`` would have refused, and
    why: a message from another app (``send_task``, a plain Celery client) carries it unchecked."""
    chord = embed.get("chord") if type(embed) is dict else None
    if isinstance(chord, dict):
        return "chord", UNSUPPORTED_OPTIONS["chord"]
    limits = headers.get("timelimit")
    if isinstance(limits, list | tuple):
        for option, limit in zip(("time_limit", "soft_time_limit"), limits, strict=False):
            if limit:  # 0 is no limit to Celery's worker too (the task's own, where it has one)
                return option, UNSUPPORTED_OPTIONS[option]
    if headers.get("ignore_result"):
        return "ignore_result", UNSUPPORTED_OPTIONS["ignore_result"]
    return None


def _refused(task_id: str, task: str, inbox: str | None, why: str) -> RefusedMessage:
    """A message that names its task and id is answered under that id, whatever else is wrong."""
    return RefusedMessage(why, task_id=task_id, task=task, inbox=inbox)


def inbox_in(raw: bytes) -> str | None:
    """The result inbox channel named in the message ``raw``, without decoding its body; None when
    it names none or is no Celery message."""
    try:
        inbox = envelope_loads(raw).get("headers").get(INBOX_HEADER)
    except (ValueError, UnicodeDecodeError, AttributeError):  # not JSON, or no headers object
        return None
    return inbox if type(inbox) is str and inbox else None


def _links(embed: Any, headers: dict[str, Any], task_id: str, task: str, inbox: str | None) -> Links:
    """The embed's callbacks, error callbacks and chain, and the canvas ids the tracer would pass on;
    a refusal under the request's id when one of those is not a list of signatures."""
    links: Links = {}
    if isinstance(embed, dict):
        for key in ("callbacks", "errbacks", "chain"):
            if embed.get(key):
                links[key] = _signatures(embed, key, task_id, task, inbox)
    root_id = headers.get("root_id")
    if isinstance(root_id, str) and root_id:
        links["root_id"] = root_id
    parent_id = headers.get("parent_id")
    if isinstance(parent_id, str) and parent_id:
        links["parent_id"] = parent_id
    return links


def _tags_decode(links: Links, task_id: str, task: Any, inbox: str | None) -> None:
    """Raise :class:`RefusedMessage` if a link holds a dict kombu's JSON takes for a type tag
    (``{"__type__": ..., "__value__": ...}``) that does not decode: a Celery worker could not decode
    the message, nor could carpool's worker the batch it would ride in. A tag that decodes is left as
    it is: the worker hands the link its value (a datetime, a UUID...), as a Celery worker would."""
    for key in ("callbacks", "errbacks", "chain"):
        for tag, decoded in kombu_tags(links.get(key)):
            if isinstance(decoded, Exception):
                raise RefusedMessage(
                    f"the message's {key} hold {brief(tag)}, a dict shaped like one of kombu's type "
                    f"tags (its only keys __type__ and __value__) that Celery's JSON decoding fails on "
                    f"({tag_failure(tag, decoded)}): a Celery worker could not decode this message "
                    "either; pass the value itself (Celery's JSON tags datetimes, UUIDs, decimals and "
                    "bytes), or rename the dict's keys (e.g. 'type' and 'value')",
                    task_id=task_id,
                    task=task,
                    links=links,
                    inbox=inbox,
                )


def _may_hold_tag(body: str | bytes) -> bool:
    """Whether a JSON text may hold the key ``__type__``: as it is, or with a character escaped."""
    if type(body) is str:
        return "__type__" in body or "\\u" in body
    return b"__type__" in body or b"\\u" in body


def _signatures(
    embed: dict[str, Any], key: str, task_id: str, task: str, inbox: str | None
) -> list[dict[str, Any]]:
    value = embed[key]
    if not (isinstance(value, list) and all(isinstance(sig, dict) for sig in value)):
        raise _refused(
            task_id,
            task,
            inbox,
            f"the message's {key} is {brief(value)}, not a list of signatures (Celery writes each as"
            " a dict: send links with link=/link_error= or a chain, from a Celery app)",
        )
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

    None for no time: None, a number that is not finite or a bool (as for a sent-at), or a value
    Celery 5.6 also reads as none (``""``, ``{}``). Raises ``ValueError`` for anything else that is no
    time (a text that is not ISO 8601, an object), which a Celery worker rejects too
    (``InvalidTaskError``), and for a time no datetime can hold: it could be neither compared with a
    datetime nor reported as one (Flower's eta), and it is no time a request runs or expires at.
    """
    if value is None:
        return None
    if isinstance(value, int | float):
        if isinstance(value, bool):
            return None
        try:
            when = float(value)
        except OverflowError:  # an integer past any float's range: past either end of the years too
            when = math.inf if value > 0 else -math.inf
        else:
            if not math.isfinite(when):  # NaN or Infinity, which Python's json writes: absent
                return None
    elif type(value) is str and value:
        dt = _datetime(value)
        if dt is None:
            raise ValueError(_unreadable(value, header))
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        when = dt.timestamp()  # a UTC offset can move a time in year 1 or 9999 past either end
    elif not value:  # "", {}, []: Celery's maybe_iso8601 reads them as no time
        return None
    else:
        raise ValueError(_unreadable(value, header))
    if not _EARLIEST <= when < _END:
        raise ValueError(
            f"{header} {brief(value)} lies outside the years 1 to 9999 that a datetime holds; "
            f"send an {header} within them"
        )
    return when


def _datetime(text: str) -> datetime | None:
    """``text`` as a datetime, read as Python reads ISO 8601 or else as Celery 5.6 does (dateutil's
    ``isoparse``, which also takes ``"2026"`` and ``"2026-05"``); None if neither reads it."""
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        pass
    from dateutil.parser import isoparse  # Celery's own dependency, imported where needed only

    try:
        parsed: datetime = isoparse(text)
    except (ValueError, OverflowError, TypeError):
        return None
    return parsed


def _unreadable(value: Any, header: str) -> str:
    if header == "eta":
        hint, name = "eta= or countdown=", "ETA"
    else:
        hint, name = "expires= (a datetime or seconds)", header
    return (
        f"{header} {brief(value)} is not a time: send an ISO 8601 datetime such as "
        f"'2026-05-01T09:00:00+00:00' (Celery's apply_async writes one from {hint}); a Celery 5.6 "
        f"worker rejects such a message too (InvalidTaskError: invalid {name} value) and never answers "
        "its caller"
    )
