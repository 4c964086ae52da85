"""What `.delay()` really writes to Redis decodes into what the coordinator needs."""

from __future__ import annotations

import time

import pytest
import redis

from carpool.celery_edge import requests as protocol
from carpool.errors import MalformedMessage
from carpool.redis_edge.keys import Keys
from carpool.tools.embedded import EmbeddedRedis
from tests.integration.conftest import as_bytes

pytestmark = pytest.mark.integration


def test_delay_writes_to_the_request_list_and_decodes(clean_redis: EmbeddedRedis) -> None:
    from carpool.tasks import infer

    client = redis.Redis(port=clean_redis.port)
    keys = Keys("carpool.requests")
    before = time.time()
    r1 = infer.delay("hello world")
    r2 = infer.apply_async(("urgent text",), {"model": "toy"}, priority=9, expires=30)
    assert client.llen("carpool.requests") == 1
    high = [k for k in keys.request_lists if client.llen(k)]
    assert len(high) == 2 and keys.request_lists.index(high[0]) == 0  # priority 9 list drains first
    m1 = protocol.decode(as_bytes(client.lindex("carpool.requests", 0)))
    m2 = protocol.decode(as_bytes(client.lindex(high[0], 0)))
    assert m1.id == r1.id and m1.args == ["hello world"] and m1.priority == 0
    assert m1.sent_at is not None and before <= m1.sent_at <= time.time()
    assert m1.expires_at is None
    assert m2.id == r2.id and m2.kwargs == {"model": "toy"} and m2.priority == 9
    assert m2.expires_at is not None and 25 < m2.expires_at - before < 35


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"\x00\xffnot json", "not JSON"),
        (b'{"no": "headers"}', "no headers"),
        (b'{"headers": {"task": "other.task", "id": "1"}, "body": ""}', "does not decode"),
        (b'{"headers": {"task": 7, "id": "1"}, "body": "[[], {}, {}]"}', "its task name is 7"),
        (
            b'{"headers": {"task": "other.task", "id": "1"}, "body": "[[], {}, {}]"}',
            "unknown task name 'other.task'",
        ),
        (
            b'{"headers": {"task": "carpool.infer", "id": "1"}, "body": "!!", '
            b'"properties": {"body_encoding": "base64"}}',
            "does not decode",
        ),
    ],
)
def test_garbage_is_named(raw: bytes, needle: str) -> None:
    with pytest.raises(MalformedMessage, match=needle):
        protocol.decode(raw)


def test_take_finds_the_task_id_however_the_message_is_written(clean_redis: EmbeddedRedis) -> None:
    """The take script reads the id by a plain search when the message has one "id" key, and decodes
    the JSON when it has several (a custom header holding an "id") or none, so in-flight bookkeeping
    is always keyed by headers.id."""
    import json

    from carpool.redis_edge.store import RequestStore
    from carpool.tasks import infer

    client = redis.Redis(port=clean_redis.port)
    store = RequestStore(client, Keys("carpool.requests"), 30)
    plain = infer.delay("plain")
    nested = infer.apply_async(("nested",), headers={"trace": {"id": "not-the-task-id"}})
    infer.delay("compact")
    compact_raw = as_bytes(client.lpop("carpool.requests"))  # the newest: re-push it written compactly
    compact_id = json.loads(compact_raw)["headers"]["id"]
    client.lpush("carpool.requests", json.dumps(json.loads(compact_raw), separators=(",", ":")))
    client.lpush("carpool.requests", b'{"headers": {"task": "carpool.infer"}}')  # no id at all
    taken, _ = store.take(10)
    ids = [request_id for request_id, _ in taken]
    assert ids[:3] == [plain.id, nested.id, compact_id]
    assert ids[3].startswith("carpool-garbage-")
    for request_id, raw in taken[:3]:
        assert protocol.decode(raw).id == request_id
        assert client.hget(Keys("carpool.requests").inflight_raw, request_id) == raw


def test_the_apps_default_priority_reaches_every_request(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Celery's apply_async adds task_default_priority (a task's priority attribute) to every call;
    # carpool's direct publish and submit_many must too, or the policy never sees it.
    import carpool
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    client = redis.Redis(port=clean_redis.port)
    monkeypatch.setattr(infer, "priority", 7)  # what task_default_priority=7 makes it at bind
    monkeypatch.setattr(t.count, "priority", 7)
    monkeypatch.setitem(infer.app.conf, "task_default_priority", 7)
    sent = [
        infer.delay("direct"),
        t.count.delay("direct"),
        infer.apply_async(("celery's path",), countdown=0),
    ]
    sent += carpool.submit_many(["many"], subscribe=False) + carpool.submit_many(["x"], task=t.count)
    sent.append(infer.apply_async(("its own",), priority=2))
    decoded = {}
    for key in Keys("carpool.requests").request_lists:
        for raw in client.lrange(key, 0, -1):
            msg = protocol.decode(as_bytes(raw), (infer.name, t.count.name))
            decoded[msg.id] = msg.priority
    assert [decoded[r.id] for r in sent] == [7, 7, 7, 7, 7, 2]
