"""kombu's Redis consumer with carpool's guard (:func:`carpool.celery_edge.compat.guard_broker_transports`):
a list element that is no kombu message is dropped and the messages after it are delivered; an
error raised while a readable message is handled still propagates."""

from __future__ import annotations

import logging
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
