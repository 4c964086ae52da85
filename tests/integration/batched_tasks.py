"""@batched tasks the integration tests serve (CARPOOL_IMPORTS=tests.integration.batched_tasks).

Each output says which batch it rode in (the batch's item lengths and the worker's pid), so tests
can check how requests were binned and where they ran.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from carpool import batched
from carpool.celery_app import app


# carpool.batched returns Any (the Celery task it builds is untyped), hence the ignores below.
@batched(length=len, max_batch=8, bins=(4, 16))
def shout(texts: list[str]) -> list[dict[str, Any]]:
    lengths = [len(t) for t in texts]
    return [{"out": t.upper(), "batch": lengths, "pid": os.getpid()} for t in texts]


def _pair_length(pair: dict[str, Any]) -> int:
    return len(pair["a"]) + len(pair["b"])


@batched(length=_pair_length, name="tests.pairs", batch_queue="carpool.batches.pairs")
def pair_sum(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"sum": sum(p["a"]) + sum(p["b"]), "size": len(pairs), "pid": os.getpid()} for p in pairs]


@batched(length=len)
def fragile(texts: list[str]) -> list[str]:
    if "boom" in texts:
        raise ValueError("boom is not a word I take")
    return [t[::-1] for t in texts]


def _cancelling_length(text: str) -> int:
    if text == "cancel-length":
        raise asyncio.CancelledError  # what escapes an asyncio.run() whose task was cancelled
    return len(text)


@batched(length=_cancelling_length)
def cancelling(texts: list[str]) -> list[str]:
    """Raises a BaseException that is no Exception for the batch holding "cancel"."""
    if "cancel" in texts:
        raise asyncio.CancelledError
    return [t.upper() for t in texts]


@batched(length=lambda x: 1)
def slopes(xs: list[float]) -> list[float]:
    """d(x^3)/dx at each x, by autograd: a function that needs gradients runs as called directly."""
    import torch

    x = torch.tensor(xs, dtype=torch.float64, requires_grad=True)
    (x**3).sum().backward()  # type: ignore[no-untyped-call]
    assert x.grad is not None
    return [float(g) for g in x.grad]


@batched(length=lambda item: 1, max_batch=4)
def naps(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sleeps the longest ``s`` of its batch: a slow batch, for what waits behind it."""
    time.sleep(max(item["s"] for item in items))
    return [{"tag": item["tag"], "pid": os.getpid()} for item in items]


@batched(length=len)
def miscounting(texts: list[str]) -> list[str]:
    return texts[:-1]


@batched(length=len)
def unstorable(texts: list[str]) -> list[Any]:
    return [{t} if t == "set" else t for t in texts]


@batched(length=lambda item: item["n"])
def by_declared_length(items: list[dict[str, Any]]) -> list[float]:
    return [item["x"] * 2 for item in items]


@batched(length=len)
def count(items: list[Any]) -> list[int]:
    """The length of each item (a text, a list, a dict): a step to chain after any task."""
    return [len(item) for item in items]


PLAIN_QUEUE = "tests.plain"  # consumed by a plain `celery worker`, not by carpool


@app.task(name="tests.plain.describe", queue=PLAIN_QUEUE)  # type: ignore[untyped-decorator, unused-ignore]
def describe(value: Any) -> str:
    """A plain Celery task, run by a plain Celery worker on its own queue: a chain's non-carpool step."""
    return f"{type(value).__name__} of {len(value)}"


@batched(length=len, max_batch=8, name="tests.greedy")
def greedy(texts: list[str]) -> list[str]:
    """Kills its own process for a batch holding "hog", as the kernel's out-of-memory killer kills a
    worker whose batch needs more memory than it has: no exception, no answer."""
    if "hog" in texts:
        os._exit(137)
    return [t.upper() for t in texts]
