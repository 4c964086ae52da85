"""What crosses processes between coordinators and GPU workers, defined once for writer and reader.

coordinator --:class:`BatchMessage` (the argument of a ``carpool.run_batch`` task)--> worker
worker --:class:`BatchReport` (the coordinator's report list in Redis)--> coordinator

Both carry ``version`` (:data:`WIRE_VERSION`). A reader refuses a message of another version with
:class:`~carpool.errors.WireVersionMismatch` instead of misreading it, so a deployment running two
releases side by side during a rolling upgrade says so. The types are TypedDicts: the messages stay
plain dicts, JSON-ready for Celery's serializer and the store, with nothing converted per request.
"""

from __future__ import annotations

from typing import Any, Final, NotRequired, TypedDict

from carpool.errors import WireError, WireVersionMismatch

#: Bump whenever a field below appears, goes or changes meaning.
WIRE_VERSION: Final = 6


class Links(TypedDict, total=False):
    """What Celery's tracer would do after a request, as its message asked: present only when it asks.

    The signatures are Celery's own (``Signature`` dicts, as the message's embed carried them).
    """

    callbacks: list[dict[str, Any]]  # link=: applied with the result on success
    errbacks: list[dict[str, Any]]  # link_error=: called on failure
    chain: list[dict[str, Any]]  # the rest of a chain, the next step last (Celery's embed order)
    root_id: str  # the id of the canvas's first task (Celery's root_id header)
    parent_id: str  # the id of the task whose result this request received
    priority: int  # the request's own priority, for Celery's task_inherit_parent_priority (not 0)
    # With error callbacks only: the request's args and kwargs, which Celery hands an error callback
    # in its request (``errback(request, exc, traceback)``)
    args: list[Any]
    kwargs: dict[str, Any]


class RequestSlot(TypedDict):
    """One request inside a batch: all the worker needs, so it never tokenizes again."""

    id: str  # the request's Celery task id: its result is stored under it
    # What the task's batch function takes: a @batched task's item as the producer sent it;
    # infer's token ids (None when the model reads only the attention mask).
    item: Any
    len: int  # what the request is binned by: its task's length (infer: tokens, special tokens included)
    sent_at: float  # producer's wall clock
    deadline: float  # wall clock; the worker fails the request if its batch starts later
    # Only when the deadline is the caller's expires=: then passing it answers the request REVOKED
    # ('expired'), as Celery does, instead of DeadlineExceeded.
    expires: NotRequired[bool]
    links: NotRequired[Links]  # callbacks, error callbacks, chain: only when the request has any
    # The producer process's result inbox channel (its INBOX_HEADER): only when it named one.
    inbox: NotRequired[str]


class BatchMessage(TypedDict):
    """A micro-batch, coordinator to worker."""

    version: int
    id: str  # the batch's Celery task id
    task: str  # the requests' task: carpool.infer, or a @batched task's name
    model: str  # the routing key: infer's model; a @batched task's name again
    bin: str  # token lengths the batch's bin holds, e.g. "17-32"
    flush: str  # why the batch left the coordinator (a FlushReason value)
    padded_len: int
    dispatched_at: float  # coordinator's wall clock
    coordinator: str  # whose report list receives the batch's report
    requests: list[RequestSlot]


class BatchReport(TypedDict):
    """What a worker tells the coordinator about a batch it ran: a freed slot and a latency sample."""

    version: int
    batch_id: str
    model: str
    worker: str
    device: str
    bin: str
    flush: str
    size: int  # requests run
    padded_len: int
    padded_tokens: int
    real_tokens: int
    run_s: float | None  # model time; None when nothing ran or a failure split the batch
    failed_model: int
    failed_deadline: int
    done_at: float  # worker's wall clock


_BATCH_KEYS: Final = frozenset(BatchMessage.__annotations__)
_REPORT_KEYS: Final = frozenset(BatchReport.__annotations__)


def batch_message(
    *,
    batch_id: str,
    task: str,
    model: str,
    bin_label: str,
    flush: str,
    padded_len: int,
    dispatched_at: float,
    coordinator: str,
    requests: list[RequestSlot],
) -> BatchMessage:
    return {
        "version": WIRE_VERSION,
        "id": batch_id,
        "task": task,
        "model": model,
        "bin": bin_label,
        "flush": flush,
        "padded_len": padded_len,
        "dispatched_at": dispatched_at,
        "coordinator": coordinator,
        "requests": requests,
    }


def batch_report(
    *,
    batch_id: str,
    model: str,
    worker: str,
    device: str,
    bin_label: str,
    flush: str,
    size: int,
    padded_len: int,
    real_tokens: int,
    run_s: float | None,
    failed_model: int,
    failed_deadline: int,
    done_at: float,
) -> BatchReport:
    return {
        "version": WIRE_VERSION,
        "batch_id": batch_id,
        "model": model,
        "worker": worker,
        "device": device,
        "bin": bin_label,
        "flush": flush,
        "size": size,
        "padded_len": padded_len,
        "padded_tokens": padded_len * size,
        "real_tokens": real_tokens,
        "run_s": run_s,
        "failed_model": failed_model,
        "failed_deadline": failed_deadline,
        "done_at": done_at,
    }


def read_batch(value: object) -> BatchMessage:
    """``value`` (a ``carpool.run_batch`` argument) as a batch message, or raise :class:`WireError`.

    Slots are not checked one by one: that would cost per request, and a coordinator of this
    version writes them from :class:`RequestSlot`.
    """
    message = _checked(value, "batch message", _BATCH_KEYS, writer="coordinator", reader="worker")
    if not isinstance(message["requests"], list):
        raise WireError(f"batch message {message['id']!r} has no list of requests")
    return message  # type: ignore[return-value]


def read_report(value: object) -> BatchReport:
    """``value`` (an entry of a coordinator's report list) as a batch report, or raise :class:`WireError`."""
    return _checked(value, "batch report", _REPORT_KEYS, writer="worker", reader="coordinator")  # type: ignore[return-value]


def _checked(value: object, what: str, keys: frozenset[str], *, writer: str, reader: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{what} is a {type(value).__name__}, not a JSON object")
    version = value.get("version")
    if version != WIRE_VERSION:
        found = "no wire version" if version is None else f"wire version {version!r}"
        raise WireVersionMismatch(
            f"{what} has {found}, but this {reader} reads wire version {WIRE_VERSION}: the {writer} "
            f"that wrote it runs another carpool release. Run one release on every coordinator and "
            f"worker (finish or roll back the upgrade)."
        )
    missing = keys - value.keys()
    if missing:
        raise WireError(f"{what} lacks {', '.join(sorted(missing))}")
    return value
