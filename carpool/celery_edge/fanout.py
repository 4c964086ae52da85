"""Kombu's Redis wire format for fanout messages (Celery events), built once and reused.

Why not ``Producer.publish``: on the Redis transport every fanout publish goes through kombu's
``Channel._put_fanout``, which builds a new ``redis.Redis`` client each time, plus the serializer
registry, compression lookup and publish retry wrappers, paid several times per batch. Here a real
kombu channel is asked once for the topic and the envelope it would produce; each message then
costs one JSON encoding (orjson, :mod:`carpool.codec`) and a base64 of its body, and the caller
PUBLISHes it in whatever pipeline it is already sending.
Consumers (Flower, ``celery events``) cannot tell the difference: the envelope is the one kombu's
``prepare_message`` / ``_inplace_augment_message`` make, checked field by field in
tests/integration/test_client.py::test_fanout_encoder_matches_what_celery_publishes.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import orjson

from carpool.celery_edge import compat
from carpool.codec import dumps_lenient


class FanoutEncoder:
    """Encodes message bodies for one (exchange, routing key) as kombu would publish them."""

    def __init__(self, channel: Any, exchange: str, routing_key: str, headers: dict[str, Any]) -> None:
        message = channel.prepare_message(
            "", 0, "application/json", "utf-8", dict(headers), {"delivery_mode": 1}
        )
        compat.augment_message(channel, message, exchange, routing_key)
        self.topic = compat.publish_topic(channel, exchange, routing_key)
        self._template = message

    def encode(self, body: Any) -> bytes:
        """The raw message to PUBLISH on :attr:`topic` for ``body`` (any JSON-serialisable value)."""
        data = dumps_lenient(body)
        message = dict(self._template)
        properties = dict(message["properties"])
        properties["delivery_tag"] = str(uuid.uuid4())
        message["properties"] = properties
        message["body"] = base64.b64encode(data).decode("ascii")
        return orjson.dumps(message)


def event_encoder(app: Any, routing_key: str, hostname: str) -> FanoutEncoder:
    """A :class:`FanoutEncoder` for the app's event exchange, as ``app.events.Dispatcher`` sends."""
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        return FanoutEncoder(channel, app.conf.event_exchange, routing_key, {"hostname": hostname})
