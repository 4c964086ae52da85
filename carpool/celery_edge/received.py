"""A Celery task message read straight off its Redis list, as kombu's Redis transport would deliver it.

A GPU worker's claim script takes the next batch message off the batch queue (so the worker runs it
without a round trip to fetch it, see :mod:`carpool.gpu_worker.runtime`); this module reads that
message: kombu's envelope (JSON, the body base64-encoded), then the body with kombu's serializer for
its content type, as Celery's protocol 2 lays it out (``[args, kwargs, embed]``). Only a message
the worker can run exactly as Celery would is read; anything else (another task, a countdown or an
expiry, callbacks, a compressed body, another protocol) is None, to go back to the list for
Celery's consumer.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import orjson
from kombu.serialization import loads as deserialize
from kombu.serialization import prepare_accept_content


@dataclass(frozen=True, slots=True)
class TaskRequest:
    """The fields of Celery's task request that the worker's runtime reads from a batch's task."""

    id: str
    argsrepr: str
    kwargsrepr: str
    root_id: str | None
    parent_id: str | None
    retries: int


@dataclass(frozen=True, slots=True)
class ReceivedTask:
    request: TaskRequest
    args: list[Any]
    kwargs: dict[str, Any]


def marker(task_name: str) -> str:
    """Text that every envelope of a ``task_name`` message holds: its ``task`` header as kombu's JSON
    writes it (the claim script takes only messages holding it; :func:`read_task` still checks)."""
    return json.dumps({"task": task_name})[1:-1]


def accepted(content: Collection[str]) -> set[str]:
    """The content types that an app's ``accept_content`` (serializer names or content types)
    admits, as :func:`read_task` takes them."""
    types: set[str] = prepare_accept_content(content)  # type: ignore[no-untyped-call]
    return types


def read_task(raw: bytes | str, task_name: str, accept: set[str]) -> ReceivedTask | None:
    """``raw`` (an envelope off a Redis list) as a ``task_name`` task to run now; None where it is
    another task's, or is to run later, expires, or is not encoded as this reader expects.
    ``accept``: the content types to decode (:func:`accepted`)."""
    try:
        envelope = orjson.loads(raw)
        headers = envelope["headers"]
        properties = envelope["properties"]
        if (
            headers.get("task") != task_name
            or headers.get("eta") is not None
            or headers.get("expires") is not None
            or headers.get("compression") is not None
            or properties.get("body_encoding") != "base64"
        ):
            return None
        body = deserialize(  # type: ignore[no-untyped-call]
            base64.b64decode(envelope["body"]),
            envelope["content-type"],
            envelope["content-encoding"],
            accept=accept,
        )
        args, kwargs, embed = body
        request = TaskRequest(
            id=str(headers["id"]),
            argsrepr=str(headers.get("argsrepr") or ""),
            kwargsrepr=str(headers.get("kwargsrepr") or "{}"),
            root_id=headers.get("root_id"),
            parent_id=headers.get("parent_id"),
            retries=int(headers.get("retries") or 0),
        )
    except Exception:  # not a protocol-2 message this reader understands: Celery's consumer will say
        return None
    if not isinstance(args, list) or not isinstance(kwargs, dict) or _links(embed):
        return None
    return ReceivedTask(request, args, kwargs)


def _links(embed: object) -> bool:
    """Whether a message's embed holds callbacks, error callbacks, a chain or a chord (Celery
    applies them after the task: left to it)."""
    if not isinstance(embed, dict):
        return embed is not None
    return any(embed.get(k) for k in ("callbacks", "errbacks", "chain", "chord"))
