"""The result inbox (carpool.celery_edge.inbox): submit_many's results come back to the producer
process on one channel, while every result keeps its own channel."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.workload import mixed_texts
from tests.integration.conftest import Processes, as_bytes, start_stack, store_later
from tests.integration.models import EXPLODING

pytestmark = pytest.mark.integration


@pytest.fixture()
def admin(clean_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis(port=clean_redis.port)
    yield client
    client.close()


def test_get_settles_the_results_of_inbox_messages_it_reads(clean_redis: EmbeddedRedis) -> None:
    """``.get()`` reads whatever its pub/sub connection delivers: inbox messages there (gather
    subscribes the inbox while waiting) settle their results, as messages on their own channels do."""
    from carpool.celery_edge.app import app
    from carpool.celery_edge.inbox import inbox_of
    from carpool.celery_edge.result_consumer import subscribe_channels, unsubscribe_channels
    from carpool.celery_edge.results import SUCCESS
    from carpool.producer.submit import submit_many

    backend = app.backend
    results = submit_many([f"one by one {i}" for i in range(6)], model="toy")
    channel = inbox_of(results[0])
    assert channel is not None
    subscribe_channels(backend.result_consumer, [channel.encode()])
    try:
        inboxes = {r.id: channel for r in results}
        worker = store_later(
            backend, [(r.id, SUCCESS, i) for i, r in enumerate(results)], 0.2, inboxes=inboxes
        )
        assert [r.get(timeout=10) for r in results] == list(range(6))
        worker.join()
    finally:
        unsubscribe_channels(backend.result_consumer, [channel.encode()])


def test_without_the_inbox_each_result_is_subscribed_as_before(
    clean_redis: EmbeddedRedis, admin: redis.Redis
) -> None:
    """``CARPOOL_RESULT_INBOX=false``: no header, one subscription per result, gather as before."""
    from carpool.celery_edge.app import create_app
    from carpool.celery_edge.inbox import inbox_of
    from carpool.celery_edge.results import SUCCESS
    from carpool.config import load_settings
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from carpool.tools.harness import release_result_consumer

    app = create_app(load_settings(result_inbox=False))
    try:
        results = submit_many(["a", "b", "c"], model="toy", app=app)
        headers = [json.loads(as_bytes(raw))["headers"] for raw in admin.lrange("carpool.requests", 0, -1)]
        assert len(headers) == 3 and not any("carpool_inbox" in h for h in headers)
        assert all(inbox_of(r) is None for r in results)
        consumer = app.backend.result_consumer
        assert {app.backend.get_key_for_task(r.id) for r in results} <= consumer.subscribed_to
        worker = store_later(app.backend, [(r.id, SUCCESS, r.id) for r in results], 0.2)
        assert gather(results, timeout=10) == [r.id for r in results]
        worker.join()
        assert not consumer.subscribed_to
    finally:
        release_result_consumer(app)


def test_gather_rereads_what_was_published_while_its_connection_was_down(
    clean_redis: EmbeddedRedis, admin: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pub/sub connection killed under a waiting gather: reconnected, the inbox resubscribed,
    and the results published meanwhile read from the store."""
    from carpool.celery_edge.app import app
    from carpool.celery_edge.inbox import inbox_of
    from carpool.celery_edge.results import SUCCESS
    from carpool.producer import gather as gathering
    from carpool.producer.submit import submit_many

    # Only the reconnection may find the lost ones: no quiet-time re-read within the test.
    monkeypatch.setattr(gathering, "_QUIET_RECHECK_S", 600.0)
    backend = app.backend
    results = submit_many([f"dropped {i}" for i in range(20)], model="toy")
    inboxes = {r.id: inbox_of(r) or "" for r in results}

    def drop_then_store() -> None:
        time.sleep(0.3)
        admin.client_kill_filter(_type="pubsub")
        backend.store_many([(r.id, SUCCESS, i) for i, r in enumerate(results[:10])], inboxes=inboxes)
        time.sleep(0.5)  # then to the inbox, resubscribed on the new connection
        backend.store_many([(r.id, SUCCESS, i + 10) for i, r in enumerate(results[10:])], inboxes=inboxes)

    worker = threading.Thread(target=drop_then_store)
    worker.start()
    try:
        assert gathering.gather(results, timeout=20) == list(range(20))
    finally:
        worker.join()


def test_gather_async_rereads_what_was_published_while_its_connection_was_down(
    clean_redis: EmbeddedRedis, admin: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gather_async's own pub/sub connection killed under it: once it has reconnected and
    resubscribed, the results published meanwhile are read from the store at once."""
    import asyncio

    from carpool.celery_edge.app import app
    from carpool.celery_edge.results import SUCCESS
    from carpool.producer import gather as gathering
    from carpool.producer.submit import submit_many

    real_client = gathering._async_client
    # Only the reconnection may find the lost ones: no quiet-time re-read within the test.
    monkeypatch.setattr(gathering, "_async_client", lambda backend: (real_client(backend)[0], 600.0))
    backend = app.backend
    results = submit_many([f"dropped {i}" for i in range(20)], model="toy", subscribe=False)

    async def drop_then_store() -> list[Any]:
        waiting = asyncio.ensure_future(gathering.gather_async(results, timeout=20))
        await asyncio.sleep(0.3)  # subscribed, reading
        # No await between the kill and the first results: the event loop, where redis-py would
        # reconnect and resubscribe, does not run until they were published to nobody.
        admin.client_kill_filter(_type="pubsub")
        backend.store_many([(r.id, SUCCESS, i) for i, r in enumerate(results[:10])])
        await asyncio.sleep(0.5)  # then on the resubscribed connection
        backend.store_many([(r.id, SUCCESS, i + 10) for i, r in enumerate(results[10:])])
        return await waiting

    assert asyncio.run(drop_then_store()) == list(range(20))


def test_gather_over_the_inbox_with_failures_and_other_readers(processes: Processes) -> None:
    """Through a real coordinator and worker: inbox and per-result results gathered together, in
    order; failures stored by the worker (ModelError) and by the coordinator (a refused request)
    arrive through the inbox; a plain Celery client, and ``.get()`` one by one, read the same."""
    from celery import Celery

    from carpool.celery_edge.app import app
    from carpool.celery_edge.inbox import inbox_channel, inbox_of
    from carpool.errors import InvalidInput, ModelError
    from carpool.names import INFER_TASK
    from carpool.producer.gather import gather
    from carpool.producer.submit import publish_tasks, submit_many

    start_stack(processes, CARPOOL_MODEL=EXPLODING, CARPOOL_MODELS=EXPLODING)
    texts = mixed_texts(120, seed=31)
    texts[7] = "this one says boom"
    inboxed = submit_many(texts[:80], model=EXPLODING)
    plain = submit_many(texts[80:], model=EXPLODING, subscribe=False)
    # Sent past the producer's validation: the coordinator refuses it, into the inbox too.
    (refused,) = publish_tasks(
        INFER_TASK,
        [(["fine", "no-such-model"], {})],
        app=app,
        queue="carpool.requests",
        inbox=inbox_channel(app),
    )
    assert inbox_of(inboxed[0]) == inbox_of(refused) and inbox_of(plain[0]) is None
    other = Celery("plain", broker=processes.broker_url, backend=processes.result_backend)
    # A plain Celery client of the same app: carpool's result serializer, nothing else of carpool.
    other.conf.update(result_serializer="msgpack", accept_content=["json"], result_accept_content=["msgpack"])
    try:
        # Another client waits on the result's own channel, as ever.
        watched = other.AsyncResult(inboxed[-1].id).get(timeout=60)
        results = [*inboxed[:40], refused, *plain, *inboxed[40:]]
        values = gather(results, timeout=60, return_exceptions=True)
        with pytest.raises(ModelError, match="boom"):  # the earliest failure raises
            gather(results, timeout=60)
        read = [other.AsyncResult(r.id).get(timeout=10, propagate=False) for r in results]
    finally:
        other.backend.result_consumer.stop()
        other.close()
    assert isinstance(values[7], ModelError) and isinstance(values[40], InvalidInput)
    ok = [i for i in range(len(results)) if i not in (7, 40)]
    assert all(isinstance(values[i], list) and len(values[i]) == 32 for i in ok)
    assert [values[i] for i in ok] == [read[i] for i in ok] and watched == values[-1]

    # .get() on each result, one by one.
    ones = submit_many(texts[:12], model=EXPLODING)
    got = [r.get(timeout=60, propagate=False) for r in ones]
    assert isinstance(got[7], ModelError)
    assert all(isinstance(v, list) and len(v) == 32 for i, v in enumerate(got) if i != 7)
