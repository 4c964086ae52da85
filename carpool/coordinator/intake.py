"""Intake: raw messages taken from the request queue -> policy Requests, and the requests refused.

Per message: decode it (what is not a carpool request is set aside to be dead-lettered), bind and
validate its arguments, refuse it when ``CARPOOL_MAX_PENDING`` requests already wait; then per model,
refuse texts over the model's window (with truncation off), tokenize the rest in one call; per
``@batched`` task, measure each item with the task's length function; and move the producer's
wall-clock times onto the coordinator's monotonic clock. No I/O: the tokenizers and
both clocks' readings are passed in, and the caller stores the failures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from carpool.batching import Request
from carpool.celery_edge import requests as protocol
from carpool.celery_edge.requests import Incoming
from carpool.config import Settings
from carpool.errors import CarpoolError, InputTooLong, InvalidInput, MalformedMessage, QueueFull
from carpool.models import BatchModel
from carpool.names import INFER_TASK
from carpool.registry import BatchedSpec
from carpool.validation import (
    InferPayload,
    bind_infer_args,
    bind_item,
    checked_length,
    validate_infer,
    validate_item,
)
from carpool.wire import Links, RequestSlot


@dataclass(frozen=True, slots=True)
class Refused:
    """A request answered with an error instead of run."""

    id: str
    reason: str  # the metrics label: invalid, queue_full, too_long, deadline
    error: CarpoolError
    message: Incoming | None = None  # its message, when refused before its task-received event
    # Its task and links (error callbacks, chain), when its message is no longer at hand.
    task: str | None = None
    links: Links | None = None

    def task_and_links(self) -> tuple[str | None, Links | None]:
        """The refused request's task name and links (None when it has none): what its failure goes on to."""
        if self.message is not None:
            return self.message.task, self.message.links
        return self.task, self.links


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


def decode_taken(request_id: str, raw: bytes, tasks: Any = (INFER_TASK,)) -> Incoming:
    """The request message ``raw``, taken under ``request_id``, or raise :class:`MalformedMessage`."""
    msg = protocol.decode(raw, tasks)
    if msg.id != request_id:  # in-flight bookkeeping is keyed by the id the take found
        raise MalformedMessage(f"task id {msg.id!r} is not the message's only id key")
    return msg


def validated(msg: Incoming, settings: Settings) -> InferPayload:
    """The text and served model of ``msg``'s ``carpool.infer`` call, or raise :class:`InvalidInput`."""
    text, model = bind_infer_args(msg.args, msg.kwargs)
    return validate_infer(text, model, settings)


def queue_full(max_pending: int) -> QueueFull:
    return QueueFull(f"{max_pending} requests already wait (CARPOOL_MAX_PENDING); retry later")


def too_long(count: int, max_length: int, model_name: str) -> InputTooLong:
    return InputTooLong(
        f"text is {count} tokens, over the {max_length}-token window of {model_name}; "
        "shorten it, or set CARPOOL_TRUNCATE=true to cut it as sentence-transformers does"
    )


def split_too_long(
    model: BatchModel, model_name: str, items: list[tuple[Incoming, str]]
) -> tuple[list[tuple[Incoming, str]], list[Refused]]:
    """(items that fit the model's window, refusals of those that do not), by untruncated counts."""
    counts = model.count_tokens([text for _, text in items])  # type: ignore[attr-defined]
    keep: list[tuple[Incoming, str]] = []
    refused: list[Refused] = []
    for item, count in zip(items, counts, strict=True):
        if count > model.max_length:
            error = too_long(count, model.max_length, model_name)
            refused.append(Refused(item[0].id, "too_long", error, message=item[0]))
        else:
            keep.append(item)
    return keep, refused


def measured(spec: BatchedSpec, items: list[tuple[Incoming, Any]]) -> list[int | InvalidInput]:
    """Each item's length by the task's length function, or the error that request fails with.

    The function's batch form (one call for all) is tried first; if it raises, each item is measured
    alone so that one bad item fails only its own request.
    """
    values = [item for _, item in items]
    try:
        raw: Sequence[Any] = spec.lengths(values)
        if len(raw) != len(values):
            raise ValueError(f"lengths() gave {len(raw)} values for {len(values)} items")
    except Exception:
        raw = []
        for value in values:
            try:
                raw.append(spec.length(value))
            except Exception as exc:
                raw.append(
                    InvalidInput(f"{spec.name}: length() raised {type(exc).__name__}: {exc}; fix the item")
                )
    out: list[int | InvalidInput] = []
    for value in raw:
        if isinstance(value, InvalidInput):
            out.append(value)
            continue
        try:
            out.append(checked_length(spec.name, value))
        except InvalidInput as exc:
            out.append(exc)
    return out


def to_request(
    msg: Incoming,
    model_name: str,
    ids: list[int],
    keep_ids: bool,
    now: float,
    wall_now: float,
    default_deadline_s: float,
    *,
    item: Any = None,
    length: int | None = None,
) -> Request:
    """The policy's view of ``msg``, carrying the slot the worker will read.

    Times the producer stamped on its wall clock become coordinator-clock times (``now`` and
    ``wall_now`` are the same instant on both clocks); a message sent "in the future" by a
    producer whose clock runs ahead counts as arriving now. A request with an eta arrives at its
    eta: its wait, and its default deadline, count from then (its ``arrival_s`` may lie ahead).
    """
    sent_at = msg.sent_at if msg.sent_at is not None else wall_now
    if msg.eta_at is None:
        start = sent_at
        arrival_s = now - max(0.0, wall_now - sent_at)
    else:
        start = max(sent_at, msg.eta_at)
        arrival_s = now + (start - wall_now)
    deadline_wall = msg.expires_at if msg.expires_at is not None else start + default_deadline_s
    size = len(ids) if length is None else length
    slot: RequestSlot = {
        "id": msg.id,
        "ids": ids if keep_ids else None,
        "len": size,
        "sent_at": sent_at,
        "deadline": deadline_wall,
    }
    if length is not None:
        slot["item"] = item
    if msg.links is not None:
        slot["links"] = msg.links
    return Request(
        id=msg.id,
        model=model_name,
        length=max(1, size),
        arrival_s=arrival_s,
        deadline_s=now + (deadline_wall - wall_now),
        priority=msg.priority,
        payload=slot,
    )


def take_in(
    taken: Sequence[tuple[str, bytes]],
    *,
    settings: Settings,
    models: Mapping[str, BatchModel],
    room: int,
    now: float,
    wall_now: float,
    specs: Mapping[str, BatchedSpec] | None = None,
) -> Intake:
    """Turn ``taken`` (request id, raw message) pairs into requests for the policy and refusals.

    ``room``: how many more requests the policy may hold; ``now`` and ``wall_now``: the coordinator's
    monotonic and wall clocks, read at one instant.
    """
    specs = specs or {}
    tasks = {INFER_TASK, *specs}
    out = Intake()
    by_model: dict[str, list[tuple[Incoming, str]]] = {}
    by_task: dict[str, list[tuple[Incoming, Any]]] = {}
    for request_id, raw in taken:
        try:
            msg = decode_taken(request_id, raw, tasks)
        except MalformedMessage as exc:
            out.malformed.append(Malformed(request_id, raw, str(exc)))
            continue
        try:
            if msg.task == INFER_TASK:
                payload = validated(msg, settings)
            else:
                item = bind_item(msg.task, msg.args, msg.kwargs)
                validate_item(msg.task, item, settings)
        except InvalidInput as exc:
            out.refused.append(Refused(msg.id, "invalid", exc, message=msg))
            continue
        if room <= 0:
            out.refused.append(Refused(msg.id, "queue_full", queue_full(settings.max_pending), message=msg))
            continue
        room -= 1
        if msg.task == INFER_TASK:
            by_model.setdefault(payload.model, []).append((msg, payload.text))
        else:
            by_task.setdefault(msg.task, []).append((msg, item))

    deadline_s = settings.default_deadline_s
    for task_name, entries in by_task.items():
        for (msg, item), size in zip(entries, measured(specs[task_name], entries), strict=True):
            if isinstance(size, InvalidInput):
                out.refused.append(Refused(msg.id, "invalid", size, message=msg))
                continue
            request = to_request(msg, task_name, [], False, now, wall_now, deadline_s, item=item, length=size)
            out.admitted.append((msg, request))

    for model_name, items in by_model.items():
        model = models[model_name]
        if not settings.truncate and hasattr(model, "count_tokens"):
            items, refused = split_too_long(model, model_name, items)
            out.refused.extend(refused)
        token_ids = model.encode([text for _, text in items])
        keep_ids = model.needs_token_ids
        for (msg, _), ids in zip(items, token_ids, strict=True):
            out.admitted.append((msg, to_request(msg, model_name, ids, keep_ids, now, wall_now, deadline_s)))
    return out
