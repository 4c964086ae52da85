"""A producer's side of Celery's result pub/sub: carpool's result consumer, bulk (un)subscription,
and reading the result messages delivered to its connection.

Celery's consumer handles one task per SUBSCRIBE, UNSUBSCRIBE and message; producers that submit and
gather thousands at once (:mod:`carpool.producer`) do each of those in bulk on the same connection,
or subscribe to their process's result inbox (:mod:`carpool.celery_edge.inbox`), one channel for
all their results; ``.get()`` on any single result keeps working as usual.

A pub/sub connection that broke, or went silent (:mod:`carpool.redis_edge.socket_options`), is
reconnected and resubscribed on its next read; what was published meanwhile is read from the stored
results after that, so no result is missed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from celery import states
from celery.backends.asynchronous import Drainer
from celery.backends.redis import ResultConsumer
from celery.exceptions import TimeoutError as CeleryTimeoutError

from carpool import collector
from carpool.celery_edge.compat import (
    forget_pending,
    forget_result_pubsub,
    join_will_block,
    new_result_pubsub,
    reconnecting,
    result_pubsub,
    subscribed_keys,
)
from carpool.config import redact_url
from carpool.redis_edge.socket_options import drop, silent

log = logging.getLogger(__name__)

_SUBSCRIBE_CHUNK = 5000  # channels per (UN)SUBSCRIBE command
_MESSAGE_READ_S = 1.0  # time allowed for the rest of a result message that has started to arrive
_MGET_CHUNK = 5000  # keys per MGET when re-reading stored results
_SETTLED_KEPT = 256  # settled results' channels left subscribed at most, awaiting one UNSUBSCRIBE
_QUIET_REREAD_S = 1.0  # a wait re-reads the stored results it waits for this often


_CONSUMERS: weakref.WeakSet[PromptResultConsumer] = weakref.WeakSet()  # this process's, for a fork


class PromptResultConsumer(ResultConsumer):  # type: ignore[misc]  # Celery is untyped
    """Celery's Redis result consumer, with a prompt ``.get()`` and UNSUBSCRIBEs sent only when due.

    Celery's ``Drainer.drain_events_until`` (celery/backends/asynchronous.py) calls
    ``drain_events(timeout=1)`` *before* it checks whether the awaited result is ready, so a result
    already known when ``.get()`` starts (buffered from an earlier message, or read by the initial
    GET) would wait for another message or a second; length binning completes requests out of
    order, so a producer reading results in submission order would stall on most calls.
    """

    _deferred: list[str] | None = None  # task ids whose unsubscription waits for deferring_cancels
    _settled: list[Any] | None = None  # keys of settled results still subscribed on the wire
    _watched: Any = None  # the pub/sub connection whose (re)connections set _stale
    _stale = False  # the connection was, or is to be, replaced: stored results must be re-read
    _reread_at: float | None = None  # monotonic time a wait in progress next re-reads what it waits for

    on_message: Any  # Celery's: the callback of the .get() in progress, if it passed one

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start_lock = threading.Lock()
        self._away_since: float | None = None  # when its connection broke, until it reconnects
        _CONSUMERS.add(self)

    def start(self, initial_task_id: str, **kwargs: Any) -> None:
        """Celery's first subscription, made once: AsyncResults sent from one thread and waited on
        from several (``submit_many``'s, whose sending thread subscribed nothing of its own) would
        each make a pub/sub connection, the last replacing the others and their subscriptions."""
        with self._start_lock:
            if result_pubsub(self) is None:
                super().start(initial_task_id, **kwargs)
                return
        self._consume_from(initial_task_id)

    def consume_from(self, task_id: str) -> None:
        if result_pubsub(self) is None:
            self.start(task_id)
            return
        self._consume_from(task_id)

    def forget_after_fork(self) -> None:
        """In a forked child: let go of the parent's pub/sub connection, whose socket the child
        shares (reading it would take the parent's result messages, and the parent the child's),
        without a word on it; and of what the parent subscribed to and waited on. The child's next
        wait subscribes on a connection of its own, after reading the stored result first."""
        forget_result_pubsub(self)
        self._start_lock = threading.Lock()  # a lock held in the parent at the fork stays held here
        subscribed_keys(self).clear()
        forget_pending(self)
        self._deferred = self._settled = None
        self._watched, self._stale = None, False

    def _wait_for_pending(
        self,
        result: Any,
        timeout: float | None = None,
        on_interval: Any = None,
        on_message: Any = None,
        **kwargs: Any,
    ) -> Iterator[None]:
        """Celery's wait for one result, without the ``sleep(0)`` after each drained message when the
        process runs threads: it yields to other greenlets, and with threads it is a nap of the
        kernel's timer slack on the way from the result message to ``.get()``'s return."""
        if type(self.drainer) is not Drainer:  # eventlet or gevent: their drainers need the yield
            yield from super()._wait_for_pending(
                result, timeout=timeout, on_interval=on_interval, on_message=on_message, **kwargs
            )
            return
        self.on_wait_for_pending(result, timeout=timeout, **kwargs)
        previous, self.on_message = self.on_message, on_message
        outer, self._reread_at = self._reread_at, time.monotonic() + _QUIET_REREAD_S
        try:
            yield from self.drain_events_until(result.on_ready, timeout=timeout, on_interval=on_interval)
        except TimeoutError:  # socket.timeout, as Celery's drainer raises it
            raise CeleryTimeoutError("The operation timed out.") from None
        finally:
            self.on_message = previous
            self._reread_at = outer

    def on_state_change(self, meta: Any, message: Any) -> None:
        """Celery's (``BaseResultConsumer``'s, then the Redis consumer's unsubscription of a settled
        result), without its closing ``sleep(0)`` when the process runs threads (see
        :meth:`_wait_for_pending`)."""
        # Celery's own path where its internals differ from those this copy relies on (other releases).
        if type(self.drainer) is not Drainer or not hasattr(self, "_get_pending_result"):
            super().on_state_change(meta, message)
            return
        if self.on_message:
            self.on_message(meta)
        if meta["status"] not in states.READY_STATES:
            return
        task_id = meta["task_id"]
        try:
            result = self._get_pending_result(task_id)
        except KeyError:
            # The result got here before its AsyncResult was waited on: kept for it, while it is
            # subscribed (sent from here, not yet settled or forgotten). A result settled already
            # comes back here too (Celery reads the stored meta of one it took from this buffer):
            # kept again, it stayed for good, up to the buffer's 8,192 per thread.
            if self.backend.get_key_for_task(task_id) in subscribed_keys(self):
                self._pending_messages.put(task_id, meta)
        else:
            result._maybe_set_cache(meta)
            bucket = self.buckets.pop(result, None)
            if bucket is not None:
                bucket.append(result)
        self.cancel_for(task_id)

    # --- a connection that broke or went silent ----------------------------------------------
    def _reconnect(self) -> None:
        """On a connection error (Celery's ``reconnect_on_error``): drop the connection; the next read
        reconnects, resubscribes and re-reads the stored results. One try per read, not Celery's
        retry loop, so that ``.get(timeout=...)`` keeps its timeout while Redis is unreachable."""
        drop(result_pubsub(self))
        self._stale = True
        if self._away_since is None:  # said once an outage: each read tries again
            self._away_since = time.monotonic()
            log.warning(
                "lost the connection to the result backend (CARPOOL_RESULT_BACKEND=%s); reconnecting at"
                " each read: results are waited on until it answers (give .get() and gather() a timeout=)",
                redact_url(str(self.backend.url or "")),
            )

    def _connected(self, connection: Any) -> None:
        self._stale = True

    def _back(self) -> bool:
        """After a (re)connection: says so when an outage was said; True."""
        if self._away_since is not None:
            log.warning("reconnected to the result backend after %.1f s", time.monotonic() - self._away_since)
            self._away_since = None
        return True

    def mark_stale(self) -> None:
        """Results may have been missed: re-read the stored ones after the next (re)connection."""
        self._stale = True

    def check_connection(self, ping: bool = False) -> bool:
        """Before a read: drop the connection if its health-check PINGs went unanswered, reconnect it if
        it was dropped (``ping``: send a health-check PING if one is due, for readers that only wait
        on the socket). True once after a (re)connection: the caller then reads the stored results of
        what it waits for, since messages published meanwhile are lost. Raises connection errors."""
        pubsub = result_pubsub(self)
        if pubsub is None:
            return False
        if pubsub.connection is None:
            # Never connected: its first SUBSCRIBE met Redis down, and redis-py, with no connection
            # to resubscribe on, would wait on nothing for good. Subscribing connects it (raising
            # while Redis is still down); the stored results are then read, as after a reconnection.
            keys = list(subscribed_keys(self))
            if not (self._stale and keys):
                return False
            for start in range(0, len(keys), _SUBSCRIBE_CHUNK):
                pubsub.subscribe(*keys[start : start + _SUBSCRIBE_CHUNK])
            self._stale = False
            return self._back()
        conn = pubsub.connection
        if conn is not self._watched:
            # Told of every reconnection, redis-py's own retries included.
            conn.register_connect_callback(self._connected)
            self._watched = conn
        if silent(pubsub):
            log.warning("the result pub/sub connection stopped answering; reconnecting")
            self._reconnect()
        if ping and pubsub.subscribed:  # unsubscribed, redis-py would not read the answer
            pubsub.check_health()
        if not self._stale:
            return False
        conn.connect()  # when dropped: connects, and redis-py resubscribes the channels it knows
        # ...which lack those whose SUBSCRIBE failed: Celery's own set is the one to trust.
        missing = [key for key in subscribed_keys(self) if key not in pubsub.channels]
        for start in range(0, len(missing), _SUBSCRIBE_CHUNK):
            pubsub.subscribe(*missing[start : start + _SUBSCRIBE_CHUNK])
        self._stale = False
        return self._back()

    def on_wait_for_pending(self, result: Any, **kwargs: Any) -> None:
        """Celery reads the stored result first; when that fails the wait goes on over pub/sub, and the
        stored result is read again once the connection is back."""
        try:
            super().on_wait_for_pending(result, **kwargs)
        except self.backend.connection_errors:
            self._stale = True

    def drain_events(self, timeout: float | None = None) -> None:
        t0 = time.monotonic()
        try:
            if self.check_connection():
                self._reread_subscribed()
            elif self._reread_at is not None and t0 >= self._reread_at:
                # A result published before its SUBSCRIBE took effect in Redis (the SUBSCRIBE's
                # packet late, or sent after the initial read from another thread) reaches no one:
                # a wait reads what it waits for from the store now and then, as gather does.
                self._reread_at = t0 + _QUIET_REREAD_S
                if self._reread_pending():
                    return  # settled: the wait looks at its results now, not after another read
        except self.backend.connection_errors:
            self._reconnect()
            if timeout:  # as long as the read would have waited, not a busy loop
                time.sleep(max(0.0, timeout - (time.monotonic() - t0)))
            return
        super().drain_events(timeout)

    def _reread_pending(self) -> bool:
        """Settle, from their stored results, the results this thread waits for that finished;
        whether any did. A state short of ready (a task's own PROGRESS) is left to its message:
        passed on here, a ``.get(on_message=...)`` would hear it again every second."""
        ids = [task_id for mapping in self._pending_results for task_id in list(mapping)]
        key_of = self.backend.get_key_for_task
        settled = False
        for start in range(0, len(ids), _MGET_CHUNK):
            chunk = ids[start : start + _MGET_CHUNK]
            for stored in self.backend.client.mget([key_of(task_id) for task_id in chunk]):
                if stored:
                    meta = self.backend.decode_result(stored)
                    if meta.get("status") in states.READY_STATES:
                        self.on_state_change(meta, None)
                        settled = True
        return settled

    def _reread_subscribed(self) -> None:
        """Settle, from their stored results, the subscribed tasks that finished (as Celery does after
        reconnecting)."""
        keys = list(subscribed_keys(self))
        for start in range(0, len(keys), _MGET_CHUNK):
            for meta in self.backend.client.mget(keys[start : start + _MGET_CHUNK]):
                if meta:
                    self.on_state_change(self.backend.decode_result(meta), None)

    # --- prompt .get() and bulk subscriptions --------------------------------------------------
    def drain_events_until(
        self, p: Any, timeout: float | None = None, on_interval: Any = None
    ) -> Iterator[None]:
        if p.ready:
            return iter(())
        if timeout and type(self.drainer) is Drainer:
            # Celery's loop reads for up to a second before it looks at its clock again: .get(timeout=
            # 0.1) raised a second late, or returned a result that came after it. Each read here ends
            # by the deadline, and the loop's next look raises Celery's timeout.
            deadline = time.monotonic() + timeout

            def wait(timeout: float | None = None) -> None:
                self.drain_events(timeout=max(0.0, min(timeout or 1.0, deadline - time.monotonic())))

            bounded: Iterator[None] = self.drainer.drain_events_until(
                p, timeout=timeout, on_interval=on_interval, wait=wait
            )
            return bounded
        it: Iterator[None] = super().drain_events_until(p, timeout=timeout, on_interval=on_interval)
        return it

    def cancel_for(self, task_id: str) -> None:
        """Unsubscribe from ``task_id``'s result, if subscribed (Celery sends UNSUBSCRIBE regardless,
        and calls this for every AsyncResult that settles or goes away).

        With Celery's plain drainer the UNSUBSCRIBE itself waits until :data:`_SETTLED_KEPT`
        settled results' channels have gathered, and goes out for all of them in one command: sent
        one by one, it stood between each result's message and ``.get()``'s return, and woke Redis
        once more per request. The channel leaves Celery's set at once, so a reconnection does not
        subscribe it again, and a result is published once, so nothing more arrives on it."""
        if self._deferred is not None:
            self._deferred.append(task_id)
            return
        key = self.backend.get_key_for_task(task_id)
        subscribed = subscribed_keys(self)
        if key not in subscribed:
            return
        if type(self.drainer) is not Drainer:  # eventlet or gevent: no wait of ours sends it later
            super().cancel_for(task_id)
            return
        subscribed.discard(key)
        if self._settled is None:
            self._settled = []
        self._settled.append(key)
        if len(self._settled) >= _SETTLED_KEPT:
            self._unsubscribe_settled()

    def _unsubscribe_settled(self) -> None:
        """Send the UNSUBSCRIBE that :meth:`cancel_for` left for later, in one command; a key
        subscribed again since (the same task waited on anew) stays."""
        settled, self._settled = self._settled, None
        if not settled or result_pubsub(self) is None:
            return
        subscribed = subscribed_keys(self)
        keys = [k for k in settled if k not in subscribed]
        if keys:
            with reconnecting(self):
                result_pubsub(self).unsubscribe(*keys)

    @contextlib.contextmanager
    def deferring_cancels(self) -> Iterator[None]:
        """Within: the unsubscriptions Celery asks for one result at a time are collected, and sent as
        one command on leaving."""
        if self._deferred is not None:  # nested: the outermost one sends
            yield
            return
        self._deferred = []
        try:
            yield
        finally:
            cancelled, self._deferred = self._deferred, None
            unsubscribe_results(self.backend, cancelled)

    def release(self) -> None:
        """Close the pub/sub connection and forget every subscription (before its Redis goes away, so
        AsyncResults collected later do not retry unsubscribing against a server that is gone)."""
        with contextlib.suppress(Exception):  # the connection may be broken: it is let go anyway
            self.stop()
        self._settled = None
        forget_result_pubsub(self)
        subscribed_keys(self).clear()
        self._watched, self._stale = None, False


def _after_fork_in_child() -> None:
    for consumer in list(_CONSUMERS):
        consumer.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def deferring_cancels(consumer: Any) -> contextlib.AbstractContextManager[None]:
    """``consumer.deferring_cancels()`` on carpool's consumer; nothing deferred on another."""
    if isinstance(consumer, PromptResultConsumer):
        return consumer.deferring_cancels()
    return contextlib.nullcontext()


def take_buffered(backend: Any, task_ids: Iterable[str]) -> list[Any]:
    """Take out the result messages Celery's consumer keeps for ``task_ids`` (those that came while
    they were subscribed and nobody waited on them yet), as their metas: ``gather`` settles with
    them, where a copy kept for a ``.get()`` that never comes would stay for good."""
    buffered = getattr(backend, "_pending_messages", None)
    if not buffered:
        return []
    metas = []
    for task_id in task_ids:
        buf = buffered.pop(task_id, None)
        if buf:
            buffered.total -= len(buf)
            metas.extend(buf.data)  # a Messagebuffer's deque
    return metas


def subscribe_results(backend: Any, task_ids: Sequence[str]) -> list[str]:
    """Subscribe Celery's result consumer to ``task_ids`` in one SUBSCRIBE; returns the ids newly added.

    What ``backend.on_task_call`` does per request, for many. Inside a worker (where joining a task
    would block) it does nothing, as Celery does.
    """
    consumer = getattr(backend, "result_consumer", None)
    if consumer is None or join_will_block() or not task_ids:
        return []
    subscribed = subscribed_keys(consumer)
    key_of = backend.get_key_for_task
    wanted = {t: key_of(t) for t in task_ids}
    fresh = [t for t, k in wanted.items() if k not in subscribed]
    if fresh:
        _subscribe(consumer, [wanted[t] for t in fresh])
    return fresh


def unsubscribe_results(backend: Any, task_ids: Sequence[str]) -> None:
    """Cancel the result subscriptions of ``task_ids`` in one UNSUBSCRIBE."""
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None:
        _unsubscribe(consumer, [backend.get_key_for_task(t) for t in dict.fromkeys(task_ids)])


def subscribe_channels(consumer: Any, channels: Sequence[bytes]) -> list[bytes]:
    """Subscribe Celery's result consumer to ``channels`` (result inboxes) in one SUBSCRIBE, like its
    result keys: resubscribed after a reconnection. Returns those newly subscribed."""
    subscribed = subscribed_keys(consumer)
    fresh = [c for c in dict.fromkeys(channels) if c not in subscribed]
    if fresh:
        _subscribe(consumer, fresh)
    return fresh


def unsubscribe_channels(consumer: Any, channels: Sequence[bytes]) -> None:
    """Cancel the subscriptions of ``channels`` in one UNSUBSCRIBE."""
    _unsubscribe(consumer, list(dict.fromkeys(channels)))


def _subscribe(consumer: Any, keys: list[Any]) -> None:
    """SUBSCRIBE ``keys`` (none subscribed yet) on the consumer's pub/sub, made now if it has none."""
    if result_pubsub(consumer) is None:
        new_result_pubsub(consumer)
    subscribed_keys(consumer).update(keys)
    with reconnecting(consumer):
        pubsub = result_pubsub(consumer)
        for start in range(0, len(keys), _SUBSCRIBE_CHUNK):
            pubsub.subscribe(*keys[start : start + _SUBSCRIBE_CHUNK])


def _unsubscribe(consumer: Any, keys: list[Any]) -> None:
    """UNSUBSCRIBE those of ``keys`` that are subscribed."""
    subscribed = subscribed_keys(consumer)
    keys = [k for k in keys if k in subscribed]
    if not keys:
        return
    subscribed.difference_update(keys)
    if result_pubsub(consumer) is not None:
        with reconnecting(consumer):
            pubsub = result_pubsub(consumer)
            for start in range(0, len(keys), _SUBSCRIBE_CHUNK):
                pubsub.unsubscribe(*keys[start : start + _SUBSCRIBE_CHUNK])


def read_result_messages(
    backend: Any, consumer: Any, timeout_s: float, limit: int
) -> tuple[list[tuple[str, Any]], bool]:
    """The result messages delivered to the consumer's pub/sub connection, as (task id, message).

    Waits up to ``timeout_s`` for the first, then takes whatever else is already there, up to
    ``limit``. The flag is False when the connection had to be replaced after an error: messages
    published meanwhile are lost to it, so the caller reads the stored results instead.

    Why not ``consumer.drain_events``: it handles one message per call and ends each with
    ``sleep(0)``, which for a burst of thousands of results was most of the producer's time.

    Why ``can_read`` and not ``get_message(timeout=0)``: redis-py reads the rest of a message with
    the same timeout, so a large result that had only partly arrived raised half-way and left the
    parser out of step, losing the following messages. A non-blocking ``can_read`` (which only
    buffers bytes) says whether anything is there; the message is then read with a timeout that lets
    its remainder arrive.
    """
    pubsub = result_pubsub(consumer)
    if pubsub is None:
        return [], True
    prefix = backend.task_keyprefix
    prefix = prefix.encode() if isinstance(prefix, str) else prefix
    out: list[tuple[str, Any]] = []
    count = 0
    wait = timeout_s
    prompt = isinstance(consumer, PromptResultConsumer)
    replaced = failed = quiet = False
    # Once the first message is there, the rest are read without the collector: each is kept.
    with reconnecting(consumer), contextlib.ExitStack() as reading:
        failed = True  # on a connection error: dropped, reconnected on the next read
        replaced = prompt and consumer.check_connection(ping=True)
        while count < limit:
            conn = pubsub.connection
            if conn is None or not conn.can_read(timeout=wait):
                break
            if not quiet:
                reading.enter_context(collector.paused())
                quiet = True
            wait = 0.0
            message = _next_message(pubsub, conn)
            if message is None:  # a (un)subscribe confirmation: look for more
                if not pubsub.subscribed:  # then redis-py reads nothing: what is there stays
                    break
                continue
            count += 1
            if message.get("type") == "message":
                channel = message["channel"]
                channel = channel.encode() if isinstance(channel, str) else channel
                task_id = channel[len(prefix) :].decode() if channel.startswith(prefix) else ""
                out.append((task_id, message))
        failed = False
    if failed and prompt and not out:
        time.sleep(wait)  # Redis unreachable: wait as long as the read would have, not a busy loop
    return out, not replaced and result_pubsub(consumer) is pubsub


def _next_message(pubsub: Any, conn: Any) -> dict[str, Any] | None:
    """The next reply on ``pubsub``'s connection ``conn``, as ``pubsub.get_message`` gives it (None
    for a subscription confirmation or a health-check reply), read in fewer steps.

    ``get_message`` costs several times the decoding of a result per message (retry wrappers and
    telemetry around each read); a published message or a SUBSCRIBE confirmation is taken here as
    it is, and any other reply goes through redis-py's own handling, which keeps its state.
    """
    response = conn.read_response(disconnect_on_error=False, push_request=True, timeout=_MESSAGE_READ_S)
    if type(response) is list and len(response) == 3:
        kind = response[0]
        if kind == b"message":
            return {"type": "message", "pattern": None, "channel": response[1], "data": response[2]}
        if kind == b"subscribe":
            return None
    if pubsub.is_health_check_response(response):  # as redis-py's parse_response: counted, dropped
        pubsub.health_check_response_counter -= 1
        return None
    message: dict[str, Any] | None = pubsub.handle_message(response, ignore_subscribe_messages=True)
    return message
