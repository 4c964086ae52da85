"""Raw request messages for unit tests, built by hand so that no producer or broker is needed."""

from __future__ import annotations

import base64
import json
from typing import Any

NO_LINKS = ("callbacks", "errbacks", "chain", "chord")


def message(
    task_id: str,
    *args: Any,
    sent_at: float | None = None,
    expires: str | None = None,
    priority: int = 0,
    task: str = "carpool.infer",
    eta: str | None = None,
    embed: dict[str, Any] | None = None,
    extra_headers: dict[str, Any] | None = None,
    **kwargs: Any,
) -> bytes:
    """A Celery protocol-2 message as kombu's Redis transport stores it; ``embed`` holds its
    callbacks, errbacks and chain (Celery sends them all None when it has none)."""
    headers: dict[str, Any] = {"id": task_id, "task": task, "expires": expires, "eta": eta}
    headers.update(extra_headers or {})
    if sent_at is not None:
        headers["carpool_sent_at"] = sent_at
    body = base64.b64encode(
        json.dumps(
            [list(args), kwargs, embed or dict.fromkeys(("callbacks", "errbacks", "chain", "chord"))]
        ).encode()
    ).decode()
    envelope = {
        "body": body,
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": headers,
        "properties": {"body_encoding": "base64", "priority": priority},
    }
    return json.dumps(envelope).encode()
