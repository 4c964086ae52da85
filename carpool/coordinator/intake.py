"""Intake: raw messages taken from the request queue -> policy Requests, and the requests refused.

Per message: decode it (what is not a carpool request is set aside to be dead-lettered), let its
task accept it (bind and validate its arguments, name its routing key), refuse it when
``CARPOOL_MAX_PENDING`` requests already wait; then per routing key, one ``prepare`` call of its task
measures every value taken (``carpool.infer``: one tokenizer call per model; a ``@batched`` task: its
length function) and says what travels to the worker (where that call raises, one call per value
refuses only the values it raises for); last, the producer's wall-clock times move onto the
coordinator's monotonic clock. A message whose decoding or acceptance raises is dead-lettered or
refused alone. No I/O: the tasks and both clocks' readings are passed in, and the caller stores
the failures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from carpool.batching import Request
from carpool.celery_edge import requests as protocol
from carpool.celery_edge.requests import Incoming
from carpool.config import Settings
from carpool.errors import (
    CarpoolError,
    InputTooLong,
    InvalidInput,
    MalformedMessage,
    QueueFull,
    RefusedMessage,
    described,
    stops_the_process,
)
from carpool.names import INFER_TASK
from carpool.registry import Prepared, TaskSpec
from carpool.wire import Links, RequestSlot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Refused:
    """A request answered with an error instead of run."""

    id: str
    reason: str  # the metrics label: invalid, queue_full, too_long, deadline, unwritable
    error: CarpoolError
    message: Incoming | None = None  # its message, when refused before its task-received event
    # Its task, links (error callbacks, chain) and result inbox, when its message is no longer at hand.
    task: str | None = None
    links: Links | None = None
    inbox: str | None = None

    def task_and_links(self) -> tuple[str | None, Links | None]:
        """The refused request's task name and links (None when it has none): what its failure goes on to."""
        if self.message is not None:
            return self.message.task, self.message.links
        return self.task, self.links

    def inbox_of(self) -> str | None:
        """The result inbox channel its producer named, if any."""
        return self.message.inbox if self.message is not None else self.inbox


@dataclass(frozen=True, slots=True)
class Malformed:
    """A taken message that is not a carpool request: it goes to the dead-letter list, unanswered."""

    id: str
    raw: bytes
    reason: str


@dataclass(slots=True)
class Intake:
    """What one take turned into; ``admitted`` keeps each request's message for its task events."""

    admitted: list[tuple[Incoming, Request]] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    #: CPU time of the thread that ran the tasks' ``prepare`` calls (tokenization, for infer), and
    #: how many values they were given: the stats hash's ``prepare_cpu_ns`` and ``prepared``
    prepare_cpu_ns: int = 0
    prepared: int = 0


def decode_taken(request_id: str, raw: bytes, tasks: Any = (INFER_TASK,)) -> Incoming:
    """The request message ``raw``, taken under ``request_id``, or raise :class:`MalformedMessage`."""
    try:
        msg = protocol.decode(raw, tasks)
    except RefusedMessage as exc:
        if exc.task_id != request_id:  # answered under the take's id, which must be the message's
            raise MalformedMessage(f"task id {exc.task_id!r} is not the message's only id key") from None
        raise
    if msg.id != request_id:  # in-flight bookkeeping is keyed by the id the take found
        raise MalformedMessage(f"task id {msg.id!r} is not the message's only id key")
    return msg


def queue_full(max_pending: int) -> QueueFull:
    return QueueFull(
        f"{max_pending} requests already wait in this coordinator (CARPOOL_MAX_PENDING, per coordinator;"
        " requests held for their countdown or eta count too); retry later"
    )


def to_request(
    msg: Incoming,
    key: str,
    item: Any,
    length: int,
    now: float,
    wall_now: float,
    default_deadline_s: float,
) -> Request:
    """The policy's view of ``msg`` under routing ``key``, carrying the slot the worker will read
    (``item``: what its task's batch function takes; ``length``: what it is binned by).

    Times the producer stamped on its wall clock become coordinator-clock times (``now`` and
    ``wall_now`` are the same instant on both clocks); a message sent "in the future" by a
    producer whose clock runs ahead counts as arriving now, and its default deadline counts from
    then. A request with an eta arrives at its eta: its wait, and its default deadline, count from
    then (its ``arrival_s`` may lie ahead).
    """
    sent_at = msg.sent_at if msg.sent_at is not None else wall_now
    if msg.eta_at is None:
        start = min(sent_at, wall_now)  # its default deadline counts from its arrival, as its wait does
        arrival_s = now - max(0.0, wall_now - sent_at)
    else:
        start = max(sent_at, msg.eta_at)
        arrival_s = now + (start - wall_now)
    deadline_wall = msg.expires_at if msg.expires_at is not None else start + default_deadline_s
    slot: RequestSlot = {
        "id": msg.id,
        "item": item,
        "len": length,
        "sent_at": sent_at,
        "deadline": deadline_wall,
    }
    if msg.expires_at is not None:
        slot["expires"] = True
    if msg.links is not None:
        slot["links"] = msg.links
    if msg.inbox is not None:
        slot["inbox"] = msg.inbox
    return Request(
        id=msg.id,
        model=key,
        length=max(1, length),
        arrival_s=arrival_s,
        deadline_s=now + (deadline_wall - wall_now),
        priority=msg.priority,
        payload=slot,
    )


def not_accepted(msg: Incoming, exc: Exception) -> InvalidInput:
    """The refusal of ``msg``, whose task's ``accept`` raised ``exc`` instead of InvalidInput."""
    if not isinstance(msg.args, list | None) or not isinstance(msg.kwargs, dict | None):
        # Celery itself could not call a task with these: the message's fault, not carpool's.
        return InvalidInput(
            f"{msg.task}: a Celery message carries its args as a list and its kwargs as an object, "
            f"not a {type(msg.args).__name__} and a {type(msg.kwargs).__name__}"
        )
    log.error("%s: accepting request %s raised; refusing it", msg.task, msg.id, exc_info=exc)
    return InvalidInput(f"{msg.task}: its arguments could not be taken: {described(exc)}")


def prepared(spec: TaskSpec, key: str, values: list[Any], settings: Settings) -> Prepared:
    """``spec.prepare`` of ``values``; where that raises, each value is prepared alone and those it
    still raises for are refused, so that one bad value fails only its own request."""
    try:
        out = spec.prepare(key, values, settings)
        if len(out.lengths) == len(out.items) == len(values):
            return out
        raise ValueError(
            f"prepare gave {len(out.lengths)} lengths, {len(out.items)} items for {len(values)} values"
        )
    except BaseException as raised:  # sys.exit() in a model's or task's code fails its requests only
        if stops_the_process(raised):
            raise
        log.warning(
            "%s: preparing %d requests for %s raised; preparing each alone to refuse only those it fails for",
            spec.name,
            len(values),
            key,
            exc_info=True,
        )
    lengths: list[int | InvalidInput] = []
    items: list[Any] = []
    for value in values:
        try:
            [length], [item] = spec.prepare(key, [value], settings)
        except InvalidInput as exc:
            length, item = exc, None
        except BaseException as exc:
            if stops_the_process(exc):
                raise
            length = InvalidInput(
                f"{spec.name}: preparing this request's input for {key} raised {described(exc)}"
            )
            item = None
        lengths.append(length)
        items.append(item)
    return Prepared(lengths, items)


def take_in(
    taken: Sequence[tuple[str, bytes]],
    *,
    settings: Settings,
    specs: Mapping[str, TaskSpec],
    room: int,
    now: float,
    wall_now: float,
) -> Intake:
    """Turn ``taken`` (request id, raw message) pairs into requests for the policy and refusals.

    ``specs``: the tasks served, by name; ``room``: how many more requests the policy may hold;
    ``now`` and ``wall_now``: the coordinator's monotonic and wall clocks, read at one instant.
    """
    out = Intake()
    by_key: dict[str, tuple[TaskSpec, list[tuple[Incoming, Any]]]] = {}
    for request_id, raw in taken:
        try:
            msg = decode_taken(request_id, raw, specs)
        except RefusedMessage as exc:  # its caller is answered with the reason
            error = InvalidInput(f"{exc}; nothing was run")
            out.refused.append(
                Refused(request_id, "invalid", error, task=exc.task, links=exc.links, inbox=exc.inbox)
            )
            continue
        except MalformedMessage as exc:
            out.malformed.append(Malformed(request_id, raw, str(exc)))
            continue
        except Exception as exc:
            # A decoding defect this message exposes: it alone is dead-lettered, kept to be looked at.
            log.exception("decoding message %s raised; dead-lettering it", request_id)
            out.malformed.append(Malformed(request_id, raw, f"decoding raised {described(exc)}"))
            continue
        spec = specs[msg.task]
        try:
            key, value = spec.accept(msg.args, msg.kwargs, settings)
        except InvalidInput as exc:
            out.refused.append(Refused(msg.id, "invalid", exc, message=msg))
            continue
        except Exception as exc:  # only this request is refused; the others taken with it go on
            out.refused.append(Refused(msg.id, "invalid", not_accepted(msg, exc), message=msg))
            continue
        if room <= 0:
            out.refused.append(Refused(msg.id, "queue_full", queue_full(settings.max_pending), message=msg))
            continue
        room -= 1
        group = by_key.get(key)
        if group is None:
            group = by_key[key] = (spec, [])
        group[1].append((msg, value))

    deadline_s = settings.default_deadline_s
    for key, (spec, entries) in by_key.items():
        started = time.thread_time_ns()
        lengths, items = prepared(spec, key, [value for _, value in entries], settings)
        out.prepare_cpu_ns += time.thread_time_ns() - started
        out.prepared += len(entries)
        for (msg, _), length, item in zip(entries, lengths, items, strict=True):
            if isinstance(length, InvalidInput):
                reason = "too_long" if isinstance(length, InputTooLong) else "invalid"
                out.refused.append(Refused(msg.id, reason, length, message=msg))
                continue
            out.admitted.append((msg, to_request(msg, key, item, length, now, wall_now, deadline_s)))
    return out
