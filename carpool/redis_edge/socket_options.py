"""How every Redis connection carpool opens notices a peer that went away without closing it.

A reset connection fails at once; a stalled or half-open one (a NAT or firewall that dropped its
state, a host that vanished) accepts writes and never answers. So every client waits at most
``CARPOOL_REDIS_SOCKET_TIMEOUT_S`` for a reply or a connection, retries a command once on a fresh
connection, keeps TCP keepalive on (a Unix socket has none and needs none: its peer is local), and
PINGs a connection idle for ``CARPOOL_REDIS_HEALTH_CHECK_S`` before using it. A pub/sub
connection is only read, so a dead one is noticed by its unanswered health-check PINGs
(:func:`silent`) and dropped (:func:`drop`): the next read reconnects and resubscribes, and the
reader re-reads what was stored meanwhile.

:func:`client_options` is for carpool's own ``redis.Redis`` clients, :func:`celery_options` for
Celery's result backend and kombu's broker connections (the same values under their names).
"""

from __future__ import annotations

from typing import Any

from carpool.config import Settings

# Health-check PINGs left unanswered before a pub/sub connection counts as dead. A live server
# answers within a round trip; a reader PINGs at most once per read once the interval has passed.
MISSED_PINGS = 3


def _common(settings: Settings) -> dict[str, Any]:
    return {
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_socket_timeout_s,
        "socket_keepalive": True,
        "health_check_interval": settings.redis_health_check_s,
    }


def client_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``redis.Redis(...)`` and ``redis.Redis.from_url(url, ...)``."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # One retry on a fresh connection: what a reset or dead connection needs; carpool's scripts
    # are safe to run twice (write-once results, leases; a claim run twice takes a second batch
    # message, and the first one's requests return through their leases), and callers retry longer
    # outages.
    return {**_common(settings), "retry": Retry(NoBackoff(), 1)}


def async_client_options(settings: Settings) -> dict[str, Any]:
    """:func:`client_options` for ``redis.asyncio`` clients."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return {**_common(settings), "retry": Retry(NoBackoff(), 1)}


def celery_options(settings: Settings) -> dict[str, Any]:
    """Celery settings giving the result backend's and the broker's connections the same options.

    kombu also uses ``health_check_interval`` for its own checks of a worker's BRPOP and pub/sub
    connections: one whose reply is overdue by that long is dropped and reconnected.

    Neither retries a command inside redis-py. kombu and Celery reconnect by themselves, and a
    retry inside kombu's blocking pub/sub read would reconnect and then wait, with no timeout, on
    the fresh connection for a message that may never come: the worker stopped consuming. A
    producer's ``.get()`` goes on waiting and reads again by itself; a retry would only double how
    far it can overrun its timeout while Redis does not answer.
    """
    from carpool.redis_edge.connect import is_socket

    common = _common(settings)
    options = {
        "broker_transport_options": common,  # kombu leaves out keepalive on a Unix socket itself
        "redis_socket_timeout": common["socket_timeout"],
        "redis_socket_connect_timeout": common["socket_connect_timeout"],
        "redis_backend_health_check_interval": common["health_check_interval"],
    }
    if not is_socket(settings.result_backend):  # Celery's backend would hand it to a Unix socket too
        options["redis_socket_keepalive"] = True
    return options


def silent(pubsub: Any) -> bool:
    """Whether ``pubsub``'s connection left :data:`MISSED_PINGS` health-check PINGs unanswered."""
    return pubsub.connection is not None and pubsub.health_check_response_counter >= MISSED_PINGS


def drop(pubsub: Any) -> None:
    """Close ``pubsub``'s connection without a word to the peer; redis-py reconnects it and
    resubscribes its channels on its next use."""
    if pubsub is None:
        return
    pubsub.health_check_response_counter = 0
    connection = pubsub.connection
    if connection is not None:
        connection.disconnect()
