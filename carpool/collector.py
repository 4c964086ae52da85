"""Python's cyclic garbage collector paused around bulk work whose objects all live on.

A producer builds thousands of messages in one call and decodes thousands of results in another.
Every object made there is kept (by the caller, or until the call returns), yet each few hundred
allocations of containers set off a collection, and every so often a full one that walks every
object of the process, results already gathered included: more CPU than the work itself. Paused,
the allocations are counted all the same, so the first allocation after the pause starts one
collection instead of many.
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
