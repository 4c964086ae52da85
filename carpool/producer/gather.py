"""Collecting results in bulk: one MGET for what is stored, then pub/sub for the rest.

    vectors = gather(results, timeout=60)
    vectors = await gather_async(submit_many(texts, subscribe=False), timeout=60)

:class:`Gathering` is the part both share: fed the result metas that arrive, it settles the
waiting AsyncResults, raises the first failure and keeps the deadline. The adapters differ only in
where the metas come from: :func:`gather` reads Celery's own result pub/sub connection (subscribed
to this process's result inbox, :mod:`carpool.celery_edge.inbox`, while it waits, and to the result
channels of results from elsewhere), :func:`gather_async` a ``redis.asyncio`` connection of its own.
Celery's own bulk read (``ResultSet.join`` / ``backend.get_many``) polls with MGET every half
second instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from celery import states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import assert_will_not_block

from carpool import collector
from carpool.celery_edge.compat import cached_meta, set_cached_meta
from carpool.celery_edge.inbox import inbox_of
from carpool.celery_edge.result_consumer import (
    PromptResultConsumer,
    deferring_cancels,
    read_result_messages,
    subscribe_channels,
    subscribe_results,
    take_buffered,
    unsubscribe_channels,
    unsubscribe_results,
)
from carpool.celery_edge.results import success_row
from carpool.codec import brief
from carpool.names import INBOX_CHANNEL
from carpool.redis_edge.socket_options import async_client_options

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from celery.result import AsyncResult
    from numpy.typing import NDArray

_MGET_CHUNK = 5000  # keys per MGET
_SUBSCRIBE_CHUNK = 5000  # channels per SUBSCRIBE
_READ_LIMIT = 10_000  # messages settled between two checks of the deadline
_LONGEST_WAIT_S = 1.0  # a wait for messages without a deadline still returns this often
_LONGEST_RECHECK_S = 10.0  # gather_async re-reads stored results after this long without a message
_QUIET_RECHECK_S = 1.0  # gather re-reads stored results after this long without one of its own
_FIRST_READ_S = (
    1.0  # gather_async's first read of the stored results may take this long, whatever its timeout
)
# The collector stays paused while results keep coming (a gap this long ends the stream), for at
# most this long at a time: see collector.Stream.
_STREAM_GAP_S = 0.05
_LONGEST_PAUSE_S = 1.0
_READY = states.READY_STATES
_NUMBER_KINDS = "biuf"  # numpy's kinds of bools, integers and floats: what as_array stacks
_Decode = Callable[[Any], Any] | None  # a result meta's decoder; None: the result backend's own
_FAILED = states.PROPAGATE_STATES


class Gathering:
    """One gather's state, whatever the transport: what still waits, what failed, the deadline."""

    def __init__(
        self,
        results: Sequence[AsyncResult],
        timeout: float | None,
        return_exceptions: bool,
        rows: Rows | None = None,
        backend: Any = None,
    ) -> None:
        self.results = results
        self.return_exceptions = return_exceptions
        # The backend whose result consumer gather waits on (None: none to tell), the calling
        # thread's; results sent from other threads hold other backend objects of the same app.
        self.backend = backend
        # With ``rows`` (gather's as_array), successes are kept here by task id, not settled into
        # their AsyncResults: the values are arrays, which a later .get() must not return.
        self.rows = rows
        self._kept: dict[str, Any] = {}
        self._deadline = None if timeout is None else time.monotonic() + timeout
        # task id -> its results not settled yet (one task may appear more than once in ``results``)
        self.waiting: dict[str, list[AsyncResult]] = {}
        for r in results:
            if cached_meta(r) is None:
                self.waiting.setdefault(r.id, []).append(r)

    @property
    def done(self) -> bool:
        return not self.waiting

    def pending(self) -> list[str]:
        """The task ids still waited for."""
        return list(self.waiting)

    def settle(self, metas: Iterable[Mapping[str, Any] | None]) -> None:
        """Give each final meta to the results waiting for its task, then raise the stored exception
        of the earliest result in ``results`` that failed among these (unless ``return_exceptions``).
        Metas of other tasks, of tasks settled already, and unfinished ones are passed over."""
        failed: set[str] = set()
        waiting = self.waiting
        with collector.paused():  # the metas (decoded here when a generator) and Celery's promises
            for meta in metas:
                if not meta or meta.get("status") not in _READY:
                    continue
                task_id: str = meta.get("task_id", "")
                rs = waiting.pop(task_id, None)
                if rs is None:
                    continue
                if self.rows is not None and meta["status"] == states.SUCCESS:
                    self._kept[task_id] = meta["result"]
                    for r in rs:  # done waiting, as a settled result is: Celery lets it go, unsubscribed
                        r.backend.remove_pending_result(r)
                        self._let_go(r)
                    continue
                for r in rs:
                    set_cached_meta(r, dict(meta))
                    self._let_go(r)
                if meta["status"] in _FAILED:
                    failed.add(task_id)
        self._raise_first(failed)

    def take_settled(self) -> None:
        """Stop waiting for the tasks whose results Celery settled itself (one of them is enough: the
        others of the same task get its meta); raise as :meth:`settle` does."""
        failed: set[str] = set()
        for task_id, rs in list(self.waiting.items()):
            metas = [cached_meta(r) for r in rs]
            known = next((m for m in metas if m is not None), None)
            if known is None:
                continue
            for r, meta in zip(rs, metas, strict=True):
                if meta is None:
                    set_cached_meta(r, dict(known))
                self._let_go(r)
            del self.waiting[task_id]
            if known["status"] in _FAILED:
                failed.add(task_id)
        self._raise_first(failed)

    def _let_go(self, r: AsyncResult) -> None:
        """Stop the waiting backend's consumer waiting for settled ``r`` when ``r`` holds another
        thread's backend: settling ``r`` tells only its own (Celery's ``on_ready``)."""
        backend = self.backend
        if backend is not None and r.backend is not backend:
            backend.remove_pending_result(r)

    def _raise_first(self, failed: set[str]) -> None:
        if failed and not self.return_exceptions:
            for r in self.results:
                if r.id in failed:
                    r.maybe_throw()

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (not below 0), None without one."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def wait_s(self) -> float:
        """How long to wait for the next messages; raises Celery's TimeoutError once the deadline has
        passed, as ``.get()`` does."""
        if self._deadline is None:
            return _LONGEST_WAIT_S
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise CeleryTimeoutError("The operation timed out.")
        return min(left, _LONGEST_WAIT_S)

    def values(self) -> list[Any] | NDArray[Any]:
        """Every result's value, in order (a failure raises, or is its exception instance); with
        ``rows``, stacked into one array."""
        out = []
        kept = self._kept
        for r in self.results:
            if r.id in kept:
                out.append(kept[r.id])
                continue
            meta = cached_meta(r)
            assert meta is not None, "values() before every result settled"
            if meta["status"] in _FAILED and not self.return_exceptions:
                r.maybe_throw()
            out.append(meta["result"])
        return out if self.rows is None else self.rows.stack(out)


class Rows:
    """gather's ``as_array``: how results are decoded (a model's numeric row straight into an array,
    :func:`~carpool.celery_edge.results.success_row`) and stacked into one array of ``dtype``."""

    def __init__(self, backend: Any, dtype: Any) -> None:
        try:
            import numpy
        except ImportError:
            raise ImportError("gather(..., as_array=True) needs numpy: pip install numpy") from None
        self.numpy = numpy
        self.dtype = numpy.dtype("float32" if dtype is None else dtype)
        if self.dtype.kind not in _NUMBER_KINDS:
            raise ValueError(f"as_array needs a numeric dtype, not {self.dtype}")
        self.backend = backend  # None when there are no results to decode

    def decode(self, payload: Any) -> Any:
        """A result meta; a success holding a numeric row, with that row as an array."""
        meta = success_row(payload) if type(payload) is bytes else None
        return meta if meta is not None else self.backend.decode_result(payload)

    def stack(self, values: list[Any]) -> NDArray[Any]:
        """``values`` as one array of ``dtype``, a row per result; a clear error for a result that is
        not numbers or whose shape differs from the first's."""
        numpy = self.numpy
        rows = []
        for index, value in enumerate(values):
            try:
                row = numpy.asarray(value)
            except ValueError:  # ragged nesting
                row = None
            if row is None or row.dtype.kind not in _NUMBER_KINDS:
                raise ValueError(
                    f"gather(..., as_array=True): result {index} is not numbers ({brief(value)}; a "
                    "non-finite float is stored as None): gather it with as_array=False"
                )
            rows.append(row.astype(self.dtype, copy=False))
            if rows[index].shape != rows[0].shape:
                raise ValueError(
                    f"gather(..., as_array=True): result {index} has shape {rows[index].shape}, result "
                    f"0 has {rows[0].shape}; one array needs results of one shape: gather these with "
                    "as_array=False"
                )
        return cast("NDArray[Any]", numpy.stack(rows) if rows else numpy.empty((0,), dtype=self.dtype))


def _backend_of(results: Sequence[AsyncResult]) -> Any:
    """The result backend to read ``results`` with: the calling thread's backend of their app.

    Celery makes one backend object per app and thread (its result consumer is not thread-safe), so
    results sent from other threads of one app hold other objects; only results of different apps,
    or of a backend given to them that is not their app's, are refused. None when no result has a
    backend (eager results, settled when made)."""
    theirs = {id(b): b for r in results if (b := r.backend) is not None}
    if not theirs:
        return None
    apps = {id(b.app): b.app for b in theirs.values()}
    if len(apps) > 1:
        raise ValueError(
            f"gather needs results of one Celery app; these belong to {len(apps)} apps "
            f"({', '.join(repr(a) for a in apps.values())}): gather each app's results on their own"
        )
    (app,) = apps.values()
    own = app.backend
    if all(_same_store(b, own) for b in theirs.values()):
        return own
    if len(theirs) == 1:  # a backend of their own, not the app's: read with it, as .get() does
        return next(iter(theirs.values()))
    raise ValueError(
        "gather needs results of one result backend; these hold backends of different kinds or "
        "addresses: gather each backend's results on their own"
    )


def _same_store(backend: Any, other: Any) -> bool:
    """Whether two backend objects read the same results (one app's, made in different threads)."""
    return backend is other or (
        type(backend) is type(other) and getattr(backend, "url", None) == getattr(other, "url", None)
    )


def _stored(backend: Any, task_ids: Sequence[str], decode: _Decode) -> Iterator[Any]:
    """The stored metas of ``task_ids`` (None where none is stored), one MGET per chunk."""
    decode = decode or backend.decode_result
    for start in range(0, len(task_ids), _MGET_CHUNK):
        keys = [backend.get_key_for_task(t) for t in task_ids[start : start + _MGET_CHUNK]]
        for value in backend.client.mget(keys):
            yield None if value is None else decode(value)


@overload
def gather(
    results: Iterable[AsyncResult],
    timeout: float | None = None,
    *,
    return_exceptions: bool = False,
    as_array: Literal[False] = False,
    dtype: None = None,
) -> list[Any]: ...
@overload
def gather(
    results: Iterable[AsyncResult],
    timeout: float | None = None,
    *,
    return_exceptions: Literal[False] = False,
    as_array: Literal[True],
    dtype: Any = None,
) -> NDArray[Any]: ...
@overload
def gather(
    results: Iterable[AsyncResult],
    timeout: float | None = None,
    *,
    return_exceptions: bool = False,
    as_array: bool,
    dtype: Any = None,
) -> list[Any] | NDArray[Any]: ...
def gather(
    results: Iterable[AsyncResult],
    timeout: float | None = None,
    *,
    return_exceptions: bool = False,
    as_array: bool = False,
    dtype: Any = None,
) -> list[Any] | NDArray[Any]:
    """Every result's value, in order: one MGET for what is stored, then pub/sub for the rest.

    Like ``asyncio.gather``: with ``return_exceptions=False`` (default) the first failed request that
    gather learns of (the earliest in ``results`` among those learnt at the same moment) raises its
    stored exception, exactly as its ``.get()`` would (``InvalidInput``, ``DeadlineExceeded``,
    ``ModelError``...); the other requests keep running and stay collectable. With
    ``return_exceptions=True`` a failed request's exception instance takes its place in the list.
    ``timeout`` bounds the whole call and raises ``celery.exceptions.TimeoutError`` as ``.get()``
    does. Results arriving while gather waits are each delivered once: those of ``submit_many``
    through this process's result inbox, subscribed while gather waits, the others on their own
    result channels, subscribed by ``submit_many`` or here; the unsubscriptions go out as one
    command at the end. A result stored without a message gather hears (a coordinator of an older
    release or a plain Celery worker answering, without the inbox; one published while its
    SUBSCRIBE was on its way) is read from the store after a second without one of ours.
    The garbage collector stays paused while its results keep coming (:class:`carpool.collector.Stream`:
    no gap over 50 ms; once they flow, a second at a time), so it walks them once, after gather.
    Results sent from any thread of one app can be gathered together: gather reads them with the
    calling thread's result backend (Celery makes one per thread), and refuses results of different
    apps. One gather at a time per thread, like Celery's result consumer it uses. Inside a Celery
    task it refuses to wait (``RuntimeError``), as ``.get()`` does, unless within
    ``allow_join_result()``.

    ``as_array=True`` returns one numpy array instead of a list: a row per result, of ``dtype``
    (default float32), for results that are numbers of one shape (embeddings). A model's float32 or
    float64 row stored as msgpack (the default ``CARPOOL_RESULT_SERIALIZER``) is read from its bytes
    straight into the array, without a Python float per value: a third to two fifths less CPU per
    result than the lists, and about half the garbage collector's walk afterwards. The values are the
    ones ``.get()`` returns (exactly, for float32 rows into float32). The AsyncResults of the
    successes are not filled with the arrays: their ``.get()`` reads the stored result and returns
    its list. A failure raises as above; ``return_exceptions=True`` cannot be combined with it, and a
    result that is not numbers or whose shape differs from the first's raises ValueError naming it.
    Needs numpy in the producer.
    """
    results = list(results)
    backend: Any = _backend_of(results)
    rows = _rows(backend, as_array, dtype, return_exceptions)
    if not results:
        return [] if rows is None else rows.stack([])
    with collector.Stream(_LONGEST_PAUSE_S) as stream:
        stream.hold()  # what gather builds to wait and the stored results it reads all live on
        return _gather(results, backend, timeout, return_exceptions, stream, rows)


def _rows(backend: Any, as_array: bool, dtype: Any, return_exceptions: bool) -> Rows | None:
    """``as_array``'s decoding and stacking, or None without it; refuses arguments that contradict it."""
    if not as_array:
        if dtype is not None:
            raise ValueError("dtype applies to as_array=True only")
        return None
    if return_exceptions:
        raise ValueError(
            "as_array=True cannot hold a failed request's exception: use return_exceptions=False (the "
            "first failure raises) or as_array=False"
        )
    return Rows(backend, dtype)


def _gather(
    results: list[AsyncResult],
    backend: Any,
    timeout: float | None,
    return_exceptions: bool,
    stream: collector.Stream,
    rows: Rows | None,
) -> list[Any] | NDArray[Any]:
    consumer = getattr(backend, "result_consumer", None)
    state = Gathering(results, timeout, return_exceptions, rows, backend if consumer else None)
    if state.done:  # eager results, or settled before: nothing to read (there may be no backend)
        return state.values()
    # Inside a task, as .get() and ResultSet.join: a worker waiting on other tasks may deadlock.
    assert_will_not_block()
    state.settle(take_buffered(backend, state.pending()))  # kept by Celery's consumer: not for good
    decode = None if rows is None else rows.decode  # None: the backend's own
    inboxes, plain = _by_channel(state) if isinstance(consumer, PromptResultConsumer) else ({}, None)
    # Subscribed before the stored results are read: a result stored later is published to it.
    fresh_inboxes = subscribe_channels(consumer, [c.encode() for c in inboxes]) if inboxes else []
    try:
        with deferring_cancels(consumer):
            _settle_stored(backend, consumer, state, state.pending(), decode)
            if consumer is None:  # not a pub/sub backend: Celery's own wait, per result
                stream.release()  # no stream of results here, only waits
                for rs in list(state.waiting.values()):
                    for r in rs:
                        r.get(timeout=state.remaining_s(), propagate=False)
                return state.values()
            if not state.done:
                plain = state.pending() if plain is None else [t for t in plain if t in state.waiting]
                fresh = subscribe_results(backend, plain)
                if fresh:  # subscribed only now: what was stored in between is read, not missed
                    _settle_stored(backend, consumer, state, fresh, decode)
                _wait_on_celery(backend, consumer, state, plain, stream, decode)
            _read_leftovers(backend, consumer, {r.id for r in results}, limit=2 * len(results) + 100)
    finally:
        if fresh_inboxes:  # with nobody reading it, its messages would pile up in the socket
            unsubscribe_channels(consumer, fresh_inboxes)
    return state.values()


def _by_channel(state: Gathering) -> tuple[dict[str, None], list[str] | None]:
    """The result inboxes of the results ``state`` waits for, and the task ids of the others (None:
    all of them)."""
    inboxes: dict[str, None] = {}
    plain: list[str] = []
    for task_id, rs in state.waiting.items():
        channel = inbox_of(rs[0])
        if channel is None:
            plain.append(task_id)
        else:
            inboxes[channel] = None
    return inboxes, (None if not inboxes else plain)


def _wait_on_celery(
    backend: Any,
    consumer: Any,
    state: Gathering,
    plain: Sequence[str],
    stream: collector.Stream,
    decode: _Decode,
) -> None:
    """Settle ``state`` from the messages on Celery's result pub/sub connection; ``plain``: the
    waited-for tasks with a subscription of their own, not an inbox. After a quiet second the
    stored results are read again: a result stored without a message of ours (see :func:`gather`),
    or published while a SUBSCRIBE was still on its way (redis-py does not wait for its answer).
    ``stream`` keeps the collector paused while results keep coming."""
    if plain:
        for task_id in plain:
            for r in state.waiting.get(task_id, ()):
                # Registers r with Celery's consumer; a result that arrived earlier for nobody
                # waiting sits in Celery's buffer and settles r right here.
                backend.add_pending_result(r, start_drainer=False)
        state.take_settled()
    ours = {r.id for r in state.results}  # a message for one no longer waited for: a duplicate
    heard_s = time.monotonic()
    while not state.done:
        heard_s = _read_and_settle(backend, consumer, state, ours, stream, heard_s, decode)


def _read_and_settle(
    backend: Any,
    consumer: Any,
    state: Gathering,
    ours: set[str],
    stream: collector.Stream,
    heard_s: float,
    decode: _Decode,
) -> float:
    """One read of result messages and what follows from it; returns when gather last heard one of
    its own results."""
    wait = state.wait_s()
    if stream.held:  # a stream of results, and the collector paused for it: a short gap ends both
        wait = min(wait, _STREAM_GAP_S)
    messages, intact = read_result_messages(backend, consumer, wait, _READ_LIMIT)
    if messages:
        stream.hold()
    before = len(state.waiting)
    with collector.paused():  # decoded results, all kept (settle's own pause then does nothing)
        state.settle(_route(backend, consumer, messages, want=state.waiting, ignore=ours, decode=decode))
    if len(state.waiting) < before:
        heard_s = time.monotonic()
    else:  # quiet, or only other waiters' messages: not a stream of ours
        stream.release()
    if not intact:  # the connection was replaced: what was published meanwhile is stored
        stream.release()
        _settle_stored(backend, consumer, state, state.pending(), decode)
    elif time.monotonic() - heard_s >= _QUIET_RECHECK_S:
        heard_s = time.monotonic()
        _settle_stored(backend, consumer, state, state.pending(), decode)
    return heard_s


def _settle_stored(
    backend: Any, consumer: Any, state: Gathering, task_ids: Sequence[str], decode: _Decode
) -> None:
    """Settle ``state`` with the stored results of ``task_ids``. When Redis cannot be reached, carpool's
    consumer is told to have them read again once its connection is back, and the wait goes on
    (so that only the deadline ends it, as for ``.get()``)."""
    try:
        with collector.paused():  # decoded results, all kept
            metas = list(_stored(backend, task_ids, decode))
    except backend.connection_errors:
        if not isinstance(consumer, PromptResultConsumer):
            raise
        consumer.mark_stale()
        return
    state.settle(metas)


def _route(
    backend: Any,
    consumer: Any,
    messages: list[tuple[str, Any]],
    want: Mapping[str, Any],
    ignore: set[str],
    decode: _Decode = None,
) -> list[Any]:
    """The decoded metas of the messages for tasks in ``want``; messages for tasks in ``ignore`` are
    dropped undecoded, and any other goes to Celery's consumer as it would have, so that other
    waiters in this process lose nothing. An inbox message is sorted by its meta's task id. Ours
    are decoded by ``decode`` (default: the backend's)."""
    ours = decode or backend.decode_result
    metas = []
    for task_id, message in messages:
        if task_id in want:
            metas.append(ours(message["data"]))
        elif task_id.startswith(INBOX_CHANNEL):
            meta = ours(message["data"])
            if meta.get("task_id") in want:
                metas.append(meta)
            elif meta.get("task_id") not in ignore:
                if decode is not None:  # another waiter's: decoded as Celery's consumer would
                    meta = backend.decode_result(message["data"])
                consumer.on_state_change(meta, message)
        elif task_id not in ignore:
            consumer.on_state_change(backend.decode_result(message["data"]), message)
    return metas


def _read_leftovers(backend: Any, consumer: Any, ignore: set[str], limit: int) -> None:
    """Read result messages already delivered to this process, so the subscriber socket never backs
    up: a result found by MGET may also have been published to us before its unsubscription."""
    import redis

    try:
        messages, _ = read_result_messages(backend, consumer, 0.0, limit)
    except (redis.RedisError, OSError):
        return
    for message in messages:  # one at a time: a callback that raises loses no other's message
        try:
            _route(backend, consumer, [message], want={}, ignore=ignore)
        except Exception:  # another result's .then() callback: not this gather's failure
            log.exception("a callback of another result, run as gather read that result's message, raised")


@overload
async def gather_async(
    results: Iterable[AsyncResult],
    timeout: float | None = None,
    *,
    return_exceptions: bool = False,
    as_array: Literal[False] = False,
    dtype: None = None,
) -> list[Any]: ...
@overload
async def gather_async(
    results: Iterable[AsyncResult],
    timeout: float | None = None,
    *,
    return_exceptions: Literal[False] = False,
    as_array: Literal[True],
    dtype: Any = None,
) -> NDArray[Any]: ...
@overload
async def gather_async(
    results: Iterable[AsyncResult],
    timeout: float | None = None,
    *,
    return_exceptions: bool = False,
    as_array: bool,
    dtype: Any = None,
) -> list[Any] | NDArray[Any]: ...
async def gather_async(
    results: Iterable[AsyncResult],
    timeout: float | None = None,
    *,
    return_exceptions: bool = False,
    as_array: bool = False,
    dtype: Any = None,
) -> list[Any] | NDArray[Any]:
    """``await`` every result, in order; same semantics as :func:`gather` (``as_array`` included).

    On a ``redis.asyncio`` connection of its own (SUBSCRIBE to the pending results, then one MGET,
    then wait for messages), not ``gather`` in ``run_in_executor``: each awaiting coroutine would pin
    a thread, and each executor thread hold a pub/sub connection of its own (Celery's result consumer
    is one per thread) for as long as it lives. Here many gathers can await at once on one loop, and
    cancelling the awaiting task closes its connection. It subscribes to each result's own channel,
    not to the process's result inbox: every gather listening there would decode every batch of the
    process's results, so many gathers awaiting at once would each decode them all. Results
    subscribed on Celery's consumer (``submit_many`` with ``CARPOOL_RESULT_INBOX=false``) are
    unsubscribed there first, so that connection does not back up with messages nobody reads
    (``submit_many(..., subscribe=False)`` leaves nothing to undo). Costs two connections per call,
    both closed on return: the pub/sub one, and one for the MGETs of stored results (a subscribed
    connection takes no other command). While no message comes for a health-check interval
    (``CARPOOL_REDIS_HEALTH_CHECK_S``) the stored results are read again, so a pub/sub connection
    that died without closing costs latency, not results; after a reconnection (redis-py's own
    retries included) they are read again at once, since what was published meanwhile reached
    nobody. Redis unreachable or stalled, when the call starts as later, is waited out until the
    deadline, which raises ``celery.exceptions.TimeoutError`` as ``gather`` does.
    """
    results = list(results)
    backend: Any = _backend_of(results)
    rows = _rows(backend, as_array, dtype, return_exceptions)
    if not results:
        return [] if rows is None else rows.stack([])
    state = Gathering(results, timeout, return_exceptions, rows)
    if state.done:  # eager results, or settled before: nothing to read (there may be no backend)
        return state.values()
    assert_will_not_block()  # as in gather
    decode = backend.decode_result if rows is None else rows.decode  # no other waiters read here
    unsubscribe_results(backend, state.pending())
    state.settle(take_buffered(backend, state.pending()))  # kept by Celery's consumer: not for good
    if state.done:
        return state.values()
    client, recheck_s = _async_client(backend)
    stream = collector.Stream(_LONGEST_PAUSE_S)
    try:
        async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
            with deferring_cancels(getattr(backend, "result_consumer", None)):
                # A stalled Redis holds each read for its socket timeout, and redis-py retries it:
                # only this bounds the wait by the deadline. The stored results are read once
                # whatever the timeout (given up to _FIRST_READ_S), as gather and .get() read them:
                # a call with a timeout of 0 collects what is ready.
                loop = asyncio.get_running_loop()
                remaining = state.remaining_s()
                deadline = None if remaining is None else loop.time() + remaining
                limit = asyncio.timeout_at(
                    None if deadline is None else max(deadline, loop.time() + _FIRST_READ_S)
                )
                try:
                    async with limit:
                        await _subscribe_and_read(pubsub, backend, client, state, decode)
                        if deadline is not None:
                            limit.reschedule(deadline)
                        await _wait_async(pubsub, backend, client, state, decode, recheck_s, stream)
                except TimeoutError:
                    if not limit.expired():
                        raise
                    raise CeleryTimeoutError("The operation timed out.") from None
    finally:
        stream.release()
        await client.aclose()
        consumer = getattr(backend, "result_consumer", None)
        if isinstance(consumer, PromptResultConsumer):
            # What this thread's Celery connection got for these results before their UNSUBSCRIBE
            # (and its confirmations), however the call ends: read now (no await: a cancellation
            # cannot cut it short), it would otherwise pile up in a socket that only a .get() on
            # this thread reads, which an event loop's thread may never call.
            _read_leftovers(backend, consumer, {r.id for r in results}, limit=2 * len(results) + 100)
    return state.values()


async def _subscribe_and_read(
    pubsub: Any, backend: Any, client: Any, state: Gathering, decode: Callable[[Any], Any]
) -> None:
    """Subscribe to the pending results, then settle ``state`` with the stored ones; while Redis
    cannot be reached, tried again until the deadline (``state.wait_s`` raises past it)."""
    while True:
        try:
            # Subscribed before the stored results are read: a result stored later is published to it.
            keys = [backend.get_key_for_task(t) for t in state.pending()]
            for start in range(0, len(keys), _SUBSCRIBE_CHUNK):
                await pubsub.subscribe(*keys[start : start + _SUBSCRIBE_CHUNK])
            await _settle_stored_async(backend, client, state, decode)
            return
        except backend.connection_errors:  # tried again whole: subscribing twice is harmless
            await asyncio.sleep(state.wait_s())


async def _wait_async(
    pubsub: Any,
    backend: Any,
    client: Any,
    state: Gathering,
    decode: Callable[[Any], Any],
    recheck_s: float,
    stream: collector.Stream,
) -> None:
    """gather_async's wait, once subscribed and the stored results read: settle ``state`` from the
    messages until done. While Redis cannot be reached the wait goes on (so that only the deadline
    ends it, as for ``gather`` and ``.get()``)."""
    heard_s = time.monotonic()
    connections = _Connections()
    pubsub.connection.register_connect_callback(connections.made)
    reread = 0
    while not state.done:
        wait = min(state.wait_s(), recheck_s, _STREAM_GAP_S if stream.held else recheck_s)
        try:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
        except backend.connection_errors:  # redis-py reconnects on the next read
            stream.release()
            await asyncio.sleep(min(state.wait_s(), _LONGEST_WAIT_S))
            continue
        if message and message.get("type") == "message":
            stream.hold()
            state.settle([decode(message["data"])])
            heard_s = time.monotonic()
        else:
            stream.release()
        if connections.count > reread:  # resubscribed: what was published meanwhile is stored
            stream.release()  # not across a round trip, while other coroutines run
            with contextlib.suppress(*backend.connection_errors):
                seen = connections.count
                await _settle_stored_async(backend, client, state, decode)
                reread, heard_s = seen, time.monotonic()
        elif time.monotonic() - heard_s >= recheck_s:
            heard_s = time.monotonic()
            with contextlib.suppress(*backend.connection_errors):
                await _settle_stored_async(backend, client, state, decode)


class _Connections:
    """Counts a pub/sub connection's reconnections, redis-py's own retries inside a read included
    (its connect callbacks are weak references to bound methods)."""

    def __init__(self) -> None:
        self.count = 0

    def made(self, _connection: Any) -> None:
        self.count += 1


async def _settle_stored_async(
    backend: Any, client: Any, state: Gathering, decode: Callable[[Any], Any]
) -> None:
    keys = [backend.get_key_for_task(t) for t in state.pending()]
    for start in range(0, len(keys), _MGET_CHUNK):
        values = await client.mget(keys[start : start + _MGET_CHUNK])
        state.settle(decode(v) for v in values if v is not None)


def _async_client(backend: Any) -> tuple[Any, float]:
    """A ``redis.asyncio`` client on the result backend's server, with the backend's settings and
    carpool's socket options; and how long a quiet wait lasts before the stored results are re-read."""
    import redis.asyncio as aioredis

    from carpool.celery_edge.app import settings_of
    from carpool.config import Settings
    from carpool.redis_edge.connect import async_client_for

    settings: Settings | None
    try:
        settings = settings_of(backend.app)
    except TypeError:  # not a carpool app: redis-py's own defaults
        settings, options, recheck_s = None, {}, _LONGEST_RECHECK_S
    else:
        options, recheck_s = async_client_options(settings), settings.redis_health_check_s
    protocol = backend.connparams.get("protocol", 2)  # RESP2: see CarpoolRedisBackend.__init__
    if getattr(backend, "url", None):
        return async_client_for(backend.url, settings, protocol=protocol, **options), recheck_s
    params = {
        k: v
        for k, v in backend.connparams.items()
        if k in ("host", "port", "db", "username", "password", "path") and v is not None
    }
    if "path" in params:
        params["unix_socket_path"] = params.pop("path")
    return aioredis.Redis(**params, protocol=protocol, **options), recheck_s


__all__ = ["Gathering", "gather", "gather_async"]
