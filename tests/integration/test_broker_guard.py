"""kombu's Redis consumer with carpool's guard (:func:`carpool.celery_edge.compat.guard_broker_transports`):
a list element that is no kombu message is dropped and the messages after it are delivered; an
error raised while a readable message is handled still propagates."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import connection, entity, messaging

from carpool.celery_edge.compat import GuardedRedisTransport
from carpool.tools.embedded import EmbeddedRedis

QUEUE = "guard.test"
# kombu's classes, untyped.
Connection: Any = connection.Connection
Consumer: Any = messaging.Consumer
Queue: Any = entity.Queue


@pytest.fixture()
def guarded(clean_redis: EmbeddedRedis) -> Iterator[Any]:
    with Connection(clean_redis.url(0), transport=GuardedRedisTransport) as conn:
        yield conn


def test_an_element_that_is_no_message_is_dropped_and_the_next_delivered(
    guarded: Any, clean_redis: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    got: list[Any] = []
    producer = guarded.Producer()
    queue = Queue(QUEUE)
    with Consumer(guarded, [queue], callbacks=[lambda body, msg: got.append(body)], accept=["json"]):
        client = redis.Redis(port=clean_redis.port)
        client.lpush(QUEUE, b"not json at all", b"[]", b"\xff garbage", b'{"body": "x", "properties": {}}')
        producer.publish({"n": 1}, routing_key=QUEUE, serializer="json")
        with caplog.at_level(logging.ERROR, logger="carpool.celery_edge.compat"):
            for _ in range(10):
                guarded.drain_events(timeout=2)
                if got:
                    break
    assert got == [{"n": 1}]
    assert caplog.text.count("that is not a kombu message") == 4
    assert "JSONDecodeError" in caplog.text and "b'[]'" in caplog.text


def test_an_error_handling_a_readable_message_still_propagates(guarded: Any) -> None:
    def fails(body: Any, message: Any) -> None:
        raise ValueError("the consumer's own error")

    producer = guarded.Producer()
    with Consumer(guarded, [Queue(QUEUE)], callbacks=[fails], accept=["json"]):
        producer.publish({"n": 1}, routing_key=QUEUE, serializer="json")
        with pytest.raises(ValueError, match="the consumer's own error"):
            guarded.drain_events(timeout=5)


def test_a_message_popped_as_the_channel_closes_goes_back_to_be_taken_next_and_is_not_delivered(
    clean_redis: EmbeddedRedis,
) -> None:
    # kombu's close() reads the reply of a BRPOP still in flight and delivers its message: under a
    # solo worker the task ran there, then was restored as unacknowledged and ran again.
    got: list[Any] = []
    client = redis.Redis(port=clean_redis.port)
    # A BRPOP blocks up to polling_interval seconds: long enough for the publish below.
    options = {"polling_interval": 30}
    conn = Connection(clean_redis.url(0), transport=GuardedRedisTransport, transport_options=options)
    keep = [lambda body, msg: got.append(body)]
    Consumer(conn.default_channel, [Queue(QUEUE)], callbacks=keep, accept=["json"]).consume()
    with pytest.raises(socket.timeout):
        conn.drain_events(timeout=0.05)  # leaves the BRPOP it sent in flight, blocked on the empty list
    with Connection(clean_redis.url(0)) as other:
        producer = other.Producer()
        producer.publish({"n": 1}, routing_key=QUEUE, serializer="json")
        for _ in range(200):  # popped by the blocked BRPOP as it arrives, its reply unread
            if client.llen(QUEUE) == 0:
                break
            time.sleep(0.01)
        assert client.llen(QUEUE) == 0
        producer.publish({"n": 2}, routing_key=QUEUE, serializer="json")
    conn.release()  # closes its channels, as Celery's consumer does when its connection is lost
    assert got == []
    assert client.llen(QUEUE) == 2
    with (
        Connection(clean_redis.url(0), transport=GuardedRedisTransport) as again,
        Consumer(again, [Queue(QUEUE)], callbacks=keep, accept=["json"]),
    ):
        for _ in range(10):
            again.drain_events(timeout=2)
            if len(got) == 2:
                break
    assert got == [{"n": 1}, {"n": 2}]  # the one put back is taken first, as it would have been
