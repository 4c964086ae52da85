"""Python's cyclic garbage collector: paused around bulk work whose objects all live on (and across a
stream of results being gathered), and kept off what a service process built to start.

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
import os
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType


class _Pauses:
    """The pauses carpool holds, counted across threads: the collector goes off with the first and
    back on with the last, and only if carpool turned it off (a collector the application turned off
    stays off). Without the count, a gather's pause ending in one thread would turn the collector
    back on in the middle of a ``submit_many`` in another.

    Each step is ordered so that an exception arriving between two of them (a KeyboardInterrupt)
    leaves the collector on rather than off for good."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0  # pauses held now
        self._ours = False  # whether the collector is off because of them

    def acquire(self) -> None:
        with self._lock:
            self._count += 1
            if self._count == 1 and gc.isenabled():
                self._ours = True
                gc.disable()

    def release(self) -> None:
        with self._lock:
            if self._count == 0:  # an acquire that an exception cut short
                return
            if self._count == 1 and self._ours:
                gc.enable()
                self._ours = False
            self._count -= 1

    def reset(self) -> None:
        """In a forked child, where the parent's other threads and their pauses do not exist: no
        pause held, a lock no thread holds, and the collector on if only a pause had turned it off."""
        self._lock = threading.Lock()
        self._count = 0
        if self._ours:
            self._ours = False
            gc.enable()


_pauses = _Pauses()
os.register_at_fork(after_in_child=_pauses.reset)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collections inside the block (left as it is if the collector is already off)."""
    _pauses.acquire()
    try:
        yield
    finally:
        _pauses.release()


class Stream:
    """The collector paused across the reads of a stream of results that are all kept, for as long as
    they keep coming: :meth:`hold` when a read brought some, :meth:`release` when the stream went
    quiet (a read came back empty, or brought none of the results waited for).

    A pause per read still left a collection after each read, and every tenth of those walked the
    results of the reads before again (a full one, all of them): in a gather of thousands of
    embeddings, more CPU than decoding them. Held across the stream, the results are walked once,
    by the collection the first allocation after the release sets off. A pause never lasts beyond
    ``longest_s`` once reads go on: the hold after that lets the collector run (the allocations of
    the read's work set off the collection that is due) and the next hold pauses it again, so other
    threads' garbage still gets collected during a stream that does not end. Work that is not a
    read of the stream (waiting on something else, re-reading the store) is for the caller to do
    after a :meth:`release`. As with :func:`paused`, a collector the application turned off stays
    off, but one it turns off during a pause is turned back on when the pause ends. Used as a
    context manager, it releases on the way out.
    """

    def __init__(self, longest_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.longest_s = longest_s
        self.clock = clock
        self._since: float | None = None  # when this pause began; None: not held

    @property
    def held(self) -> bool:
        return self._since is not None

    def hold(self) -> None:
        """Pause the collector until :meth:`release`, unless this pause has lasted ``longest_s``:
        then release it instead, for the next read's work (the hold after that pauses again)."""
        if self._since is not None:
            if self.clock() - self._since >= self.longest_s:
                self.release()
            return
        self._since = self.clock()  # first: cut short here, the release that follows does no harm
        _pauses.acquire()

    def release(self) -> None:
        if self._since is not None:
            _pauses.release()
            self._since = None

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.release()


def freeze_startup() -> None:
    """Collect the garbage of starting up, then leave every object alive now out of later collections
    (a service process's own call, once it is ready to serve: never a library's in someone's process)."""
    gc.collect()
    gc.freeze()
