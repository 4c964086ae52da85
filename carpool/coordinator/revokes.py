"""The revokes a coordinator hears: ``AsyncResult.revoke()`` broadcasts, read on a thread of their own.

``revoke()`` broadcasts Celery's remote-control command on the ``celery.pidbox`` fanout (a Redis
PUB/SUB topic), which every Celery worker hears, carpool's GPU workers among them. A coordinator
listens too, so that a request it still holds (for its eta, or while no worker is up) is answered
REVOKED at once, and one it takes later is never batched. Like Celery's workers it remembers
revoked ids for a while (``celery.worker.state``'s limits), and records them in Redis, where a
coordinator or worker that starts later reads them (:class:`Revoked`, ``compat.learn_revokes``):
a revoke broadcast while no coordinator and no worker listens is still heard by nobody.

A broadcast published before a SUBSCRIBE is in effect reaches nobody, so :func:`listen` returns
once Redis confirmed the subscription (or after :data:`SUBSCRIBED_WITHIN_S`), and the coordinator
takes requests only after it: a revoke of a request it took is heard.

The thread only collects ids; the coordinator's loop takes them between steps, so the loop's cost
stays one list check per step.
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.utils.collections import LimitedSet

from carpool.celery_edge import compat
from carpool.celery_edge.app import state_of
from carpool.codec import loads
from carpool.config import Settings
from carpool.redis_edge.connect import UNREACHABLE, client_for
from carpool.redis_edge.socket_options import client_options, drop, silent
from carpool.redis_edge.store import RequestStore

log = logging.getLogger(__name__)

RECONNECT_S = 1.0
SUBSCRIBED_WITHIN_S = 5.0


def revoked_task_ids(raw: bytes | str) -> list[str]:
    """The task ids a remote-control message revokes; none when it is another command, or one aimed at
    named workers (``destination=``), or not a message at all.

    The message is kombu's envelope of Celery's ``{"method", "arguments", "destination", ...}`` body;
    ``arguments["task_id"]`` is one id or a list of them.
    """
    try:
        envelope = loads(raw)
        body: Any = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        command = loads(body) if isinstance(body, str | bytes) else body
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        return []
    if not isinstance(command, dict) or command.get("method") != "revoke" or command.get("destination"):
        return []
    arguments = command.get("arguments")
    task_ids = arguments.get("task_id") if isinstance(arguments, dict) else None
    if isinstance(task_ids, str):
        task_ids = [task_ids]
    if not isinstance(task_ids, list):
        return []
    return [t for t in task_ids if isinstance(t, str) and t]


class RevokeListener:
    """Collects the ids revoked on ``topic`` (the remote-control fanout) until :meth:`take` is called."""

    def __init__(self, client: redis.Redis, topic: str) -> None:
        self._client = client
        self._topic = topic
        self._heard: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, within_s: float = SUBSCRIBED_WITHIN_S) -> None:
        """Start listening; wait up to ``within_s`` until Redis confirmed the subscription, since a
        broadcast published before that reaches nobody (after that it goes on trying)."""
        self._thread = threading.Thread(target=self._listen, name="carpool-revokes", daemon=True)
        self._thread.start()
        if not self._subscribed.wait(within_s):
            log.warning(
                "revoke listener not subscribed after %.0fs; revokes until it is are missed", within_s
            )

    def stop(self) -> None:
        self._stop.set()

    def take(self) -> list[str]:
        """The ids heard since the last call."""
        if not self._heard:
            return []
        with self._lock:
            heard, self._heard = self._heard, []
        return heard

    def _listen(self) -> None:
        while not self._stop.is_set():
            pubsub = self._client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]
            try:
                pubsub.subscribe(self._topic)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=RECONNECT_S)
                    if silent(pubsub):  # the connection died without closing: a new one, resubscribed
                        log.info("revoke listener's connection stopped answering; reconnecting")
                        drop(pubsub)
                        continue
                    if message is not None and message.get("type") == "subscribe":
                        self._subscribed.set()
                    elif message is not None and message.get("type") == "message":
                        ids = revoked_task_ids(message["data"])
                        if ids:
                            with self._lock:
                                self._heard.extend(ids)
            except redis.ResponseError as exc:  # e.g. an ACL without this channel: workers still check
                log.warning("cannot hear revokes on %s (%s); only workers will check them", self._topic, exc)
                self._subscribed.set()  # nothing to wait for
                return
            except redis.RedisError as exc:
                log.info("revoke listener lost redis (%s); resubscribing", exc)
                self._stop.wait(RECONNECT_S)
            finally:
                pubsub.close()


class Revoked:
    """The ids revoked lately, remembered as a Celery worker remembers them (same count and age).

    With a ``store``, also recorded in Redis (:meth:`RequestStore.remember_revoked`), and
    :meth:`load` reads what was recorded there: a coordinator that starts later (a restart, one
    more) knows the revokes heard before it, as a Celery worker learns its peers' at start (mingle).
    """

    def __init__(self, store: RequestStore | None = None, wall: Callable[[], float] = time.time) -> None:
        keep_s, keep = compat.revoke_memory()
        self._ids = LimitedSet(maxlen=keep, expires=keep_s)
        self._store, self._wall = store, wall

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def remember(self, ids: list[str]) -> None:
        self._ids.update(ids)
        if self._store is not None and ids:
            try:
                self._store.remember_revoked(ids, self._wall(), *compat.revoke_memory())
            except redis.RedisError as exc:  # heard here all the same; a later process may miss them
                log.warning("could not record %d revoked ids in redis: %s", len(ids), exc)

    def load(self) -> int:
        """Add the revokes recorded in Redis within their age; how many were read."""
        if self._store is None:
            return 0
        return compat.learn_revokes(self._store.revoked_since, self._ids, self._wall())

    def split(self, taken: list[tuple[str, bytes]]) -> tuple[list[tuple[str, bytes]], list[str]]:
        """(the taken requests not revoked, the ids of those revoked)."""
        revoked = [request_id for request_id, _ in taken if request_id in self._ids]
        if not revoked:
            return taken, []
        gone = set(revoked)
        return [(request_id, raw) for request_id, raw in taken if request_id not in gone], revoked


def listen(app: Celery, settings: Settings) -> RevokeListener | None:
    """A started listener for ``app``'s remote-control broadcasts; None (logged) if it cannot start.
    Raises what an unreachable Redis raises (:data:`~carpool.redis_edge.connect.UNREACHABLE`): the
    caller waits for Redis and asks again."""
    try:
        topic = compat.publish_topic(state_of(app).message_channel(), app.control.mailbox.exchange.name, "")
    except UNREACHABLE:
        raise
    except Exception as exc:
        log.warning("cannot hear revokes (%s); only workers will check them", exc)
        return None
    listener = RevokeListener(client_for(settings.broker_url, settings, **client_options(settings)), topic)
    listener.start()
    return listener
