"""Every use of Celery's and kombu's undocumented internals, each behind one small named function.

carpool builds Celery's task messages itself and reads Celery's result pub/sub itself, both to avoid
per-message overhead; that needs a few private attributes and methods. Nothing else in carpool
touches them: an upgrade that changes one breaks this module and tests/unit/test_compat.py, which
checks the installed versions against the ranges below and every name in :data:`RELIED_ON`.
Widen a range only after reading the new release's code behind each function here.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from queue import Empty
from typing import Any

import redis
from celery import Celery
from celery._state import task_join_will_block
from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

# (lowest, first unsupported) major.minor of the libraries this module was checked against.
CELERY_VERSIONS = ((5, 6), (5, 7))
KOMBU_VERSIONS = ((5, 6), (5, 8))

# (class, attribute, its parameters after self; None for a plain attribute) for every private or
# undocumented name used below and by carpool's subclasses of Celery's classes.
RELIED_ON: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("celery.result:AsyncResult", "_cache", None),
    ("celery.result:AsyncResult", "_maybe_set_cache", ("meta",)),
    ("celery.backends.redis:ResultConsumer", "_pubsub", None),
    ("celery.backends.redis:ResultConsumer", "subscribed_to", None),
    ("celery.backends.redis:ResultConsumer", "reconnect_on_error", ()),
    ("celery.backends.redis:ResultConsumer", "_reconnect", ()),
    ("celery.backends.redis:ResultConsumer", "on_wait_for_pending", ("result", "kwargs")),
    ("celery.backends.redis:ResultConsumer", "drain_events", ("timeout",)),
    ("celery.backends.redis:ResultConsumer", "start", ("initial_task_id", "kwargs")),
    ("celery.backends.redis:ResultConsumer", "on_state_change", ("meta", "message")),
    ("celery.backends.redis:ResultConsumer", "cancel_for", ("task_id",)),
    ("celery.backends.redis:ResultConsumer", "drain_events_until", ("p", "timeout", "on_interval")),
    (
        "celery.backends.redis:ResultConsumer",
        "_wait_for_pending",
        ("result", "timeout", "on_interval", "on_message", "kwargs"),
    ),
    ("celery.backends.redis:ResultConsumer", "on_wait_for_pending", ("result", "kwargs")),
    ("celery.backends.redis:ResultConsumer", "on_message", None),
    ("celery.backends.redis:ResultConsumer", "_get_pending_result", ("task_id",)),
    ("celery.backends.redis:ResultConsumer", "_pending_messages", None),
    ("celery.backends.redis:ResultConsumer", "buckets", None),
    ("celery.backends.redis:ResultConsumer", "_maybe_cancel_ready_task", ("meta",)),
    ("celery.backends.redis:ResultConsumer", "drainer", None),
    ("celery.backends.redis:RedisBackend", "add_pending_result", ("result", "weak", "start_drainer")),
    (
        "celery.backends.redis:RedisBackend",
        "_get_result_meta",
        ("result", "state", "traceback", "request", "format_date", "encode"),
    ),
    ("celery:Celery", "_get_backend", ()),
    ("celery:Celery", "_local", None),
    ("celery.backends.redis:RedisBackend", "client", None),
    ("celery.backends.base:Backend", "_call_task_errbacks", ("request", "exc", "traceback")),
    ("celery.worker:state", "revoked", None),
    ("celery.worker:state", "total_count", None),
    ("celery.worker:state", "all_total_count", None),
    ("kombu.transport.redis:Channel", "_inplace_augment_message", ("message", "exchange", "routing_key")),
    ("kombu.transport.redis:Channel", "_get_publish_topic", ("exchange", "routing_key")),
    ("kombu.transport.redis:Channel", "_get_message_priority", ("message", "reverse")),
    ("kombu.transport.redis:Channel", "_q_for_pri", ("queue", "pri")),
    ("kombu.transport.redis:Channel", "_create_client", ("asynchronous",)),
    ("kombu.transport.redis:Channel", "_brpop_read", ("options",)),
    ("kombu.transport.redis:Channel", "Message", None),
    ("kombu.transport.redis:SentinelChannel", "_create_client", ("asynchronous",)),
    ("kombu.transport.redis:SentinelTransport", "Channel", None),
    ("kombu.transport.redis:Transport", "Channel", None),
)


# --- results (celery.result.AsyncResult) ---------------------------------------------------------


def cached_meta(result: Any) -> dict[str, Any] | None:
    """The final meta ``result`` holds (status, result, ...), or None while it is not known."""
    meta: dict[str, Any] | None = result._cache
    return meta


def set_cached_meta(result: Any, meta: Mapping[str, Any]) -> None:
    """Give ``result`` its final meta as Celery's consumer would: its ``.get()`` returns at once, and
    Celery calls the consumer's ``cancel_for`` for it."""
    result._maybe_set_cache(meta)


# --- the result consumer (celery.backends.redis.ResultConsumer) -------------------------------


def result_pubsub(consumer: Any) -> Any:
    """The consumer's ``redis`` PubSub, or None before its first subscription."""
    return consumer._pubsub


def new_result_pubsub(consumer: Any) -> None:
    """Give the consumer a PubSub, subscribed to nothing yet, as its ``start`` makes one."""
    consumer._pubsub = consumer.backend.client.pubsub(ignore_subscribe_messages=True)


def forget_result_pubsub(consumer: Any) -> None:
    """Make the consumer start a new PubSub on its next subscription (the old one is let go)."""
    consumer._pubsub = None


def forget_pending(consumer: Any) -> None:
    """Empty the consumer's (its backend's) pending results and buffered result messages, Celery's
    ``_pending_results`` (concrete and weak maps) and ``_pending_messages``, and its buckets."""
    pending = consumer._pending_results
    pending.concrete.clear()
    pending.weak.clear()
    consumer._pending_messages.clear()
    consumer.buckets.clear()


def subscribed_keys(consumer: Any) -> set[Any]:
    """The consumer's own set of subscribed result keys (changing it changes what Celery resubscribes
    after a reconnection)."""
    keys: set[Any] = consumer.subscribed_to
    return keys


def reconnecting(consumer: Any) -> AbstractContextManager[None]:
    """A context in which a connection error replaces the consumer's PubSub (resubscribed) instead of
    propagating."""
    manager: AbstractContextManager[None] = consumer.reconnect_on_error()
    return manager


def has_current_app() -> bool:
    """Whether this thread has a current Celery app (one made with Celery's default,
    ``set_as_current=True``, or set current), rather than Celery's fallback."""
    from celery import _state

    return _state._tls.current_app is not None


def join_will_block() -> bool:
    """True inside a worker's task, where Celery refuses to wait for (or subscribe to) results."""
    return bool(task_join_will_block())


# --- the result backend -------------------------------------------------------------------------


def result_meta(backend: Any, result: Any, state: str, traceback: str | None = None) -> dict[str, Any]:
    """The meta a Celery worker's ``store_result`` would write for ``result`` (already encoded) in
    ``state``: its ``children`` a list, as a worker stores for a task that started none (Celery's
    own ``None`` is for a store made outside any task, which ``AsyncResult.children`` then returns
    instead of a list)."""
    meta: dict[str, Any] = backend._get_result_meta(
        result=result, state=state, traceback=traceback, request=None
    )
    if meta.get("children") is None:
        meta["children"] = []
    return meta


def traceback_of(exc: BaseException) -> str | None:
    """The traceback Celery stores with a task's failure, for an exception that was raised (one made
    to describe a failure, never raised, has none)."""
    if exc.__traceback__ is None:
        return None
    text = "".join(traceback.format_exception(exc))
    # A message may hold what no encoder takes (a lone surrogate from a file name): escaped.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_service = False  # set once, in a coordinator process: see as_service_process


def as_service_process() -> None:
    """Mark this process (a coordinator's) as one that never waits on a result, as a Celery worker
    marks itself (``task_join_will_block``): a task it sends is not subscribed to
    (``backend.on_task_call``, carpool's own publish, a group's barrier, as for an error callback
    Celery sends in a group), and a ``.get()`` raises, as inside a task."""
    global _service
    from celery._state import _set_task_join_will_block

    _set_task_join_will_block(True)
    _service = True


def service_process() -> bool:
    """Whether :func:`as_service_process` marked this process."""
    return _service


def call_errbacks(backend: Any, request: Any, exc: BaseException, traceback: str | None = None) -> None:
    """Call ``request.errbacks`` for the failed ``request`` as ``mark_as_failure`` does: new-style
    ``(request, exc, traceback)`` tasks registered here run in this process, the others are sent
    as tasks with the failed task's id."""
    backend._call_task_errbacks(request, exc, traceback)


# --- the worker's state (celery.worker.state) ---------------------------------------------------


def revoke_memory() -> tuple[float, int]:
    """How long (s) and how many revoked ids a Celery worker remembers (``celery.worker.state``;
    0: no limit)."""
    from celery.worker import state

    return float(state.REVOKE_EXPIRES), int(state.REVOKES_MAX)


def add_revoked(found: Iterable[tuple[str, float]], into: Any, now_s: float) -> None:
    """Add (task id, when it was revoked by the wall clock) pairs to ``into``, a Celery ``LimitedSet``
    of revoked ids (as ``celery.worker.state.revoked``), each as old as it is: the set ages its
    entries on the monotonic clock. An id there already keeps its own age."""
    monotonic_now = time.monotonic()
    for task_id, revoked_at in found:
        if task_id not in into:
            into.add(task_id, now=monotonic_now - max(0.0, now_s - revoked_at))


def learn_revokes(read: Callable[[float | None], list[tuple[str, float]]], into: Any, now_s: float) -> int:
    """Add to ``into`` (as :func:`add_revoked`) the revokes ``read(since)`` gives (a
    ``RequestStore.revoked_since``: those recorded in Redis) within a Celery worker's memory of
    them; how many. A Redis error is logged: the process then knows only the revokes it hears."""
    keep_s = revoke_memory()[0]
    try:
        found = read(now_s - keep_s if keep_s > 0 else None)
    except redis.RedisError as exc:
        log.warning("could not read the revoked ids recorded in redis: %s", exc)
        return 0
    add_revoked(found, into, now_s)
    if found:
        log.info("remembering %d revoked ids recorded in redis", len(found))
    return len(found)


def revoked_ids() -> Collection[str]:
    """The task ids this worker process was told to revoke (a ``LimitedSet`` that remote control's
    ``revoke`` fills; empty outside a worker)."""
    from celery.worker import state

    revoked: Collection[str] = state.revoked
    return revoked


def count_task_run(name: str) -> None:
    """Count a task this worker process ran without Celery's consumer delivering it in Celery's own
    totals, as ``task_accepted`` counts one it delivers (``celery inspect stats``' ``total``). Not
    in ``inspect active``: that lists Celery's own request objects."""
    from celery.worker import state

    state.total_count[name] += 1
    state.all_total_count[0] += 1


def made_backend(app: Celery) -> Any:
    """This thread's result backend of ``app`` if it was made (Celery makes one per thread on first
    use of ``app.backend``), else None."""
    return getattr(app._local, "backend", None)


def made_client(backend: Any) -> Any:
    """``backend``'s Redis client if it was made (a cached property), else None."""
    return backend.__dict__.get("client")


class AppWithBackendClass(Celery):
    """A Celery app whose result backend is ``result_backend_class()`` built on ``result_backend``,
    the URL as Celery's ``by_url`` would hand it over (Celery would pick the class from its scheme)."""

    def result_backend_class(self) -> type[Any]:
        raise NotImplementedError

    def _get_backend(self) -> Any:
        from celery.app.backends import by_url

        # by_url's URL: what follows a "redis+" (a Unix socket is redis+socket://), as Celery's own.
        _, url = by_url(self.conf.result_backend, self.loader)
        return self.result_backend_class()(app=self, url=url)


# --- kombu's Redis channel (kombu.transport.redis.Channel) ------------------------------------


def augment_message(channel: Any, message: dict[str, Any], exchange: str, routing_key: str) -> None:
    """Finish a ``prepare_message`` envelope as ``basic_publish`` does: encoded body, delivery tag and
    delivery info."""
    channel._inplace_augment_message(message, exchange, routing_key)


def publish_topic(channel: Any, exchange: str, routing_key: str) -> str:
    """The pub/sub channel a fanout message to (exchange, routing key) is published on (kombu also
    publishes to a legacy topic with Sentinel's ``sentinel_fanout_compat``, which carpool does not use)."""
    topic: str = channel._get_publish_topic(exchange, routing_key)
    return topic


def priority_list(channel: Any, queue: str, message: Mapping[str, Any]) -> str:
    """The Redis list ``Channel._put`` pushes ``message`` to: ``queue``, or its list for the message's
    priority step."""
    key: str = channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False))
    return key


def new_client(channel: Any) -> Any:
    """A ``redis.Redis`` on the channel's connection pool (with the broker URL's settings)."""
    return channel._create_client()


# --- kombu's Redis consumer (kombu.transport.redis.Channel._brpop_read) -------------------------


def guard_broker_transports() -> None:
    """In this process, kombu's Redis and Sentinel transports are the guarded ones (:func:`_guarded`),
    under kombu's own names: a broker URL keeps its scheme, so kombu still gives ``rediss://`` its
    TLS and ``redis+socket://`` its socket, and Celery's banner and logs name the URL as given.
    For a worker's process only: every kombu connection it makes to Redis is then guarded."""
    import kombu.transport

    guarded = {
        "redis": f"{__name__}:GuardedRedisTransport",
        "rediss": f"{__name__}:GuardedRedisTransport",
        "sentinel": f"{__name__}:GuardedSentinelTransport",
    }
    kombu.transport.TRANSPORT_ALIASES.update(guarded)
    for name in guarded:  # kombu keeps each name's class once resolved
        getattr(kombu.transport, "_transport_cache", {}).pop(name, None)


def _guarded(base: Any) -> Any:
    """``base``, a kombu Redis channel class, except that an element its BRPOP pops that is not a
    kombu message (not JSON, or an envelope kombu's ``Message`` cannot read: anyone may LPUSH
    anything onto a queue's list) is logged and dropped, where kombu would raise out of the
    consumer and stop a Celery worker ("Unrecoverable error"). Only what the element itself
    explains is dropped: an error raised while the consumer handles a readable message still
    propagates. On the hot path it costs a response callback per BRPOP reply (the raw reply
    kept, since kombu decodes it before anything else could see it). And a message popped by a
    BRPOP still in flight when the channel closes (the connection lost, a shutdown) goes back to
    its list, not to a task run inside ``close()`` that would then be restored and run twice."""

    class Channel(base):
        _popped: Any = None  # the raw reply of the last BRPOP read on this channel's client

        def _create_client(self, asynchronous: bool = False) -> Any:
            client = super()._create_client(asynchronous=asynchronous)
            if asynchronous:  # the client BRPOP runs on
                parse = client.response_callbacks.get("BRPOP")

                def kept(response: Any, **options: Any) -> Any:
                    self._popped = response
                    return parse(response, **options) if parse is not None else response

                client.set_response_callback("BRPOP", kept)
            return client

        def _brpop_read(self, **options: Any) -> Any:
            if self._closing:
                return self._put_back_in_flight_pop(**options)
            self._popped = None
            try:
                return super()._brpop_read(**options)
            except Exception as exc:
                popped, self._popped = self._popped, None
                if isinstance(exc, Empty) or not popped or self._readable(popped[1]):
                    raise
                _dropped(popped[0], popped[1], exc)
                raise Empty() from None  # as kombu says a read delivered nothing

        def _put_back_in_flight_pop(self, **options: Any) -> Any:
            """What kombu's ``close()`` does with a BRPOP still in flight, except for where the
            message goes: kombu reads the reply, so that a message it popped is not lost, and
            delivers it (kombu#1733). A solo worker then runs the task inside ``close()`` while
            Celery's ack, deferred to the event loop's next turn, never reaches the closing channel,
            which restores the message as unacknowledged: the task ran, and runs again. Here the
            message goes back to the end of the list that BRPOP takes from, to be taken next by
            whichever consumer comes first, and nothing runs it now."""
            try:
                try:
                    reply = self.client.parse_response(self.client.connection, "BRPOP", **options)
                except self.connection_errors:
                    self.client.connection.disconnect()  # as kombu: the next use reconnects
                    raise
            finally:
                self._in_poll = None
            if reply:
                key, item = reply
                try:
                    self.client.rpush(key, item)
                except self.connection_errors as exc:
                    _not_put_back(key, item, exc)
            raise Empty()

        def _readable(self, item: Any) -> bool:
            """Whether kombu makes a message of ``item`` (as ``_brpop_read`` and ``basic_consume``)."""
            from kombu.utils.encoding import bytes_to_str
            from kombu.utils.json import loads

            try:
                self.Message(loads(bytes_to_str(item)), channel=self)  # type: ignore[no-untyped-call]
            except Exception:
                return False
            return True

    Channel.__name__ = Channel.__qualname__ = f"Guarded{base.__name__}"
    return Channel


def _dropped(source: Any, item: Any, exc: BaseException) -> None:
    _log_element("dropped an element of list %r that is not a kombu message (%s): %r", source, item, exc)


def _log_element(text: str, source: Any, item: Any, exc: BaseException) -> None:
    """Log ``text`` with the list's name, why (``exc``) and the start of the element, an ERROR."""
    from carpool.errors import described

    name = source.decode("utf-8", "replace") if isinstance(source, bytes) else str(source)
    shown = item if len(item) <= 300 else item[:300] + b"..."
    log.error(text, name, described(exc), shown)


def _not_put_back(source: Any, item: Any, exc: BaseException) -> None:
    _log_element(
        "a message popped from list %r as the broker connection closed could not be put back (%s); a"
        " batch's requests come back through their leases (CARPOOL_RECOVERY_TIMEOUT_S): %r",
        source,
        item,
        exc,
    )


class GuardedRedisTransport(kombu_redis.Transport):
    """kombu's Redis transport with :func:`_guarded`'s channel (:func:`guard_broker_transports`)."""

    Channel = _guarded(kombu_redis.Channel)


class GuardedSentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Redis Sentinel transport with :func:`_guarded`'s channel (:func:`guard_broker_transports`)."""

    Channel = _guarded(kombu_redis.SentinelChannel)
