"""Raw request messages for unit tests, built by hand so that no producer or broker is needed."""

from __future__ import annotations

import base64
import json
from typing import Any


def message(
    task_id: str,
    *args: Any,
    sent_at: float | None = None,
    expires: str | None = None,
    priority: int = 0,
    task: str = "carpool.infer",
    **kwargs: Any,
) -> bytes:
    """A Celery protocol-2 message as kombu's Redis transport stores it."""
    headers: dict[str, Any] = {"id": task_id, "task": task, "expires": expires}
    if sent_at is not None:
        headers["carpool_sent_at"] = sent_at
    body = base64.b64encode(json.dumps([list(args), kwargs, {}]).encode()).decode()
    envelope = {
        "body": body,
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": headers,
        "properties": {"body_encoding": "base64", "priority": priority},
    }
    return json.dumps(envelope).encode()
