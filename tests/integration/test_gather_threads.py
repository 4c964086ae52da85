"""gather and gather_async over results sent from several threads of one app: Celery gives each
thread a result backend object of its own, and gather reads them all with the calling thread's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from carpool.tools.embedded import EmbeddedRedis
from tests.integration.conftest import store_later

pytestmark = pytest.mark.integration

SENDERS = 3


@pytest.fixture()
def sent_from_threads(clean_redis: EmbeddedRedis) -> Iterator[list[Any]]:
    """From each of ``SENDERS`` threads: an ``infer.delay`` (subscribed on that thread's result
    consumer), a ``submit_many`` through the result inbox, and one subscribing nothing. No
    coordinator runs: the tests store the results themselves."""
    from carpool.celery_edge.app import app
    from carpool.producer.submit import submit_many
    from carpool.tasks import infer

    batches: dict[int, list[Any]] = {}

    def send(i: int) -> None:
        batches[i] = [
            infer.delay(f"delay {i}", model="toy"),
            *submit_many([f"inbox {i} {j}" for j in range(2)], model="toy"),
            *submit_many([f"plain {i}"], model="toy", subscribe=False),
        ]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(SENDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [r for i in range(SENDERS) for r in batches[i]]
    theirs = {id(r.backend): r.backend for r in results}
    assert len(theirs) == SENDERS and app.backend not in theirs.values()
    yield results
    for backend in theirs.values():  # the threads are gone: nobody else uses their connections
        backend.result_consumer.release()


def _store(results: list[Any]) -> threading.Thread:
    """The first result stored now, the rest (each published to its channel and its inbox) soon."""
    from carpool.celery_edge.app import app
    from carpool.celery_edge.inbox import inbox_of
    from carpool.celery_edge.results import SUCCESS

    inboxes = {r.id: inbox_of(r) or "" for r in results}
    entries = [(r.id, SUCCESS, i) for i, r in enumerate(results)]
    app.backend.store_many(entries[:1], inboxes=inboxes)
    return store_later(app.backend, entries[1:], 0.3, inboxes=inboxes)


def _left_nothing_behind(results: list[Any]) -> None:
    """The calling thread's result consumer neither waits for nor is subscribed to any of ``results``
    (earlier tests of the session may have left results of their own there)."""
    from carpool.celery_edge.app import app

    backend = app.backend
    ids = {r.id for r in results}
    keys = {backend.get_key_for_task(i) for i in ids}
    assert not keys & set(backend.result_consumer.subscribed_to)
    pending = backend._pending_results
    assert not ids & (set(pending.concrete) | set(pending.weak))


def test_gather_collects_results_sent_from_other_threads(sent_from_threads: list[Any]) -> None:
    from carpool.producer.gather import gather

    results = sent_from_threads
    worker = _store(results)
    try:
        assert gather(results, timeout=10) == list(range(len(results)))
    finally:
        worker.join()
    _left_nothing_behind(results)
    assert [r.get(timeout=1) for r in results] == list(range(len(results)))


def test_gather_async_collects_results_sent_from_other_threads(sent_from_threads: list[Any]) -> None:
    from carpool.producer.gather import gather_async

    results = sent_from_threads
    worker = _store(results)
    try:
        assert asyncio.run(gather_async(results, timeout=10)) == list(range(len(results)))
    finally:
        worker.join()
    _left_nothing_behind(results)


def test_submit_many_from_more_threads_than_the_publishers_connections(clean_redis: EmbeddedRedis) -> None:
    # kombu's pool under the publisher holds 10 connections and raises past them; Celery's producer
    # pool waits. So do carpool's sends: every thread's messages arrive, none raises.
    import redis

    from carpool.producer.submit import submit_many
    from carpool.redis_edge.keys import Keys

    errors: list[BaseException] = []
    threads_n, calls, items = 32, 8, 100

    def send(i: int) -> None:
        try:
            for j in range(calls):
                submit_many([f"t{i} c{j} {k}" for k in range(items)], model="toy", subscribe=False)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    client = redis.Redis(port=clean_redis.port)
    queued = sum(client.llen(key) for key in Keys("carpool.requests").request_lists)
    assert queued == threads_n * calls * items


def test_gather_async_reads_what_the_calling_threads_connection_got_for_its_results(
    clean_redis: EmbeddedRedis,
) -> None:
    # An event loop sends with .delay() (Celery subscribes the sending thread, as for any send) and
    # awaits with gather_async, which reads on a connection of its own: the loop thread's Celery
    # connection, which no .get() ever read, kept every result message (until 2026-12-06).
    import time

    from celery.exceptions import TimeoutError as CeleryTimeoutError

    from carpool.celery_edge.app import app
    from carpool.celery_edge.compat import result_pubsub
    from carpool.celery_edge.results import SUCCESS
    from carpool.producer.gather import gather_async
    from carpool.tasks import infer

    async def rounds() -> None:
        for n in range(3):
            results = [infer.delay(f"round {n} text {i}", model="toy") for i in range(20)]
            app.backend.store_many([(r.id, SUCCESS, i) for i, r in enumerate(results)])  # published
            assert await gather_async(results, timeout=10) == list(range(20))

    async def timing_out() -> None:  # however the call ends
        results = [infer.delay(f"unanswered {i}", model="toy") for i in range(20)]
        app.backend.store_many([(r.id, SUCCESS, i) for i, r in enumerate(results[1:])])
        with pytest.raises(CeleryTimeoutError):
            await gather_async(results, timeout=0.5)

    asyncio.run(rounds())
    asyncio.run(timing_out())
    pubsub = result_pubsub(app.backend.result_consumer)
    assert pubsub is not None and pubsub.connection is not None
    time.sleep(0.2)
    assert not pubsub.connection.can_read(timeout=0.2), "the loop thread's connection holds nothing unread"


def test_what_gather_collects_is_not_left_buffered_for_a_get_that_never_comes(
    clean_redis: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    # A gather that ends reads this thread's connection: messages of results sent here and not yet
    # collected are kept by Celery's consumer for a .get(); a later gather of them reads the store,
    # and the kept copies stayed for good (8,192 a thread at most). A .then() callback of another
    # result, fired by that read, that raises is logged: it is not the gather's own failure.
    from carpool.celery_edge.app import app
    from carpool.celery_edge.results import SUCCESS
    from carpool.producer.gather import gather, gather_async
    from carpool.tasks import infer

    buffered = app.backend._pending_messages
    fired: list[Any] = []

    def fail(value: Any) -> None:
        fired.append(value)
        raise ValueError("the callback of another result")

    for collect in ("gather", "gather_async"):
        results = [infer.delay(f"{collect} text {i}", model="toy") for i in range(40)]
        others = [infer.delay(f"{collect} with a callback {i}", model="toy") for i in range(2)]
        if collect == "gather_async":
            others[0].then(fail)
            others[1].then(fired.append)  # read in the same batch of messages, after the one raising
        entries = [(r.id, SUCCESS, i) for i, r in enumerate([*results, *others])]
        app.backend.store_many(entries)  # published

        # The second half's keys gone (expired, evicted, forgotten) once their messages are read:
        # the copies kept of those messages are the values.
        def forget(rs: list[Any]) -> None:
            for r in rs:
                app.backend.client.delete(app.backend.get_key_for_task(r.id))

        if collect == "gather":
            first = gather(results[:20], timeout=10)
            forget(results[20:])
            values = first + gather(results[20:], timeout=10)
        else:

            async def in_two(rs: list[Any]) -> list[Any]:
                first = await gather_async(rs[:20], timeout=10)
                forget(rs[20:])
                return [*first, *await gather_async(rs[20:], timeout=10)]

            values = asyncio.run(in_two(results))
        assert values == list(range(40)), collect
        assert not any(r.id in buffered and len(buffered[r.id]) for r in results), collect
    assert sorted(r.result for r in fired) == [40, 41], "both callbacks ran as the first gather_async read"
    assert any("callback of another result" in r.getMessage() for r in caplog.records)


def test_a_long_wait_passes_each_state_message_to_on_message_once(clean_redis: EmbeddedRedis) -> None:
    # The wait's once-a-second read of the store settles finished results only: a PROGRESS state
    # passed on at each read would repeat the progress callback of Celery's idiom (as in Celery,
    # the state stored when the wait starts is not passed on).
    import time

    from carpool.celery_edge.app import app

    app.backend.store_result("progressing", {"step": 0}, "PROGRESS")
    later = threading.Timer(2.5, app.backend.store_result, ("progressing", {"done": True}, "SUCCESS"))
    heard: list[str] = []
    later.start()
    try:
        t0 = time.monotonic()
        got = app.AsyncResult("progressing").get(
            timeout=20, on_message=lambda meta: heard.append(meta["status"])
        )
        assert got == {"done": True} and time.monotonic() - t0 > 2.0
    finally:
        later.join()
    assert heard == ["SUCCESS"], "the stored PROGRESS, read again each second, is not passed on"
