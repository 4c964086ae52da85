"""Python's cyclic garbage collector: paused around bulk work whose objects all live on, and kept off
what a service process built to start.

A producer builds thousands of messages in one call and decodes thousands of results in another.
Every object made there is kept (by the caller, or until the call returns), yet each few hundred
allocations of containers set off a collection, and every so often a full one that walks every
object of the process, results already gathered included: more CPU than the work itself. Paused,
the allocations are counted all the same, so the first allocation after the pause starts one
collection instead of many.

A coordinator or a worker starts by importing Celery and building its tokenizers or models: hundreds
of thousands of objects that live as long as the process, and that every full collection walks
again. Serving, such a collection stalled a coordinator's loop for tens of milliseconds in the middle
of a burst. :func:`freeze_startup` moves them to the collector's permanent generation, as
``gc.freeze()`` is meant to be used; what the process builds afterwards is collected as before.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collections inside the block (left as it is if the collector is already off)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def freeze_startup() -> None:
    """Collect the garbage of starting up, then leave every object alive now out of later collections
    (a service process's own call, once it is ready to serve: never a library's in someone's process)."""
    gc.collect()
    gc.freeze()
