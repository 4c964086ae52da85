"""A worker's marks of the batches its device runs (carpool.redis_edge.marks), against real
redis-servers: sent without waiting, yet not lost to a connection the server closed; never raising
into the device's thread; back once Redis is."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from carpool.redis_edge import marks as marks_module
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.marks import DeviceMarks
from carpool.tools.embedded import EmbeddedRedis

KEY = Keys("carpool.requests").inflight_running


def marked(client: redis.Redis, want: set[bytes], timeout_s: float = 5.0) -> set[bytes]:
    """The batches marked, once they are ``want`` (the marks are not awaited), or after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = {m for m in client.zrange(KEY, 0, -1) if isinstance(m, bytes)}
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


@pytest.fixture()
def client(clean_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = redis.Redis(port=clean_redis.port)
    yield c
    c.close()


def test_an_unmark_goes_with_the_next_mark_or_the_flush_and_a_mark_again_cancels_it(
    client: redis.Redis,
) -> None:
    marks = DeviceMarks(redis.Redis(port=client.connection_pool.connection_kwargs["port"]), KEY)
    marks.begin("a")
    marks.begin("b")
    assert marked(client, {b"a", b"b"}) == {b"a", b"b"}
    marks.end("a")
    time.sleep(0.1)
    assert marked(client, {b"b"}, timeout_s=0.0) == {b"a", b"b"}, "not sent on its own"
    marks.begin("c")
    assert marked(client, {b"b", b"c"}) == {b"b", b"c"}, "sent with the next mark"
    marks.end("b")
    marks.begin("b")  # marked again before its unmark left (its results' store): stays marked
    marks.end("c")
    marks.flush()
    assert marked(client, {b"b"}) == {b"b"}
    marks.close()


def test_marks_from_two_threads_arrive_and_an_ended_batch_is_unmarked(client: redis.Redis) -> None:
    marks = DeviceMarks(redis.Redis(port=client.connection_pool.connection_kwargs["port"]), KEY)
    marks.check()

    def run(prefix: str) -> None:
        for i in range(200):
            marks.begin(f"{prefix}{i}")
            if i % 2:
                marks.end(f"{prefix}{i}")

    threads = [threading.Thread(target=run, args=(p,)) for p in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    marks.flush()  # the last unmarks go with the next mark, or the heartbeat's flush
    want = {f"{p}{i}".encode() for p in ("a", "b") for i in range(0, 200, 2)}
    assert marked(client, want) == want
    score = client.zscore(KEY, "a0")
    assert score is not None and abs(score / 1000 - time.time()) < 60, "marked with when, in ms"
    marks.close()


def test_a_mark_after_the_server_closed_the_connection_still_arrives(client: redis.Redis) -> None:
    marks = DeviceMarks(redis.Redis(port=client.connection_pool.connection_kwargs["port"]), KEY)
    marks.begin("first")
    assert marked(client, {b"first"}) == {b"first"}
    killed = client.client_kill_filter(_type="normal", skipme=True)  # the marks' connection among them
    assert killed >= 1
    time.sleep(0.1)  # the close reaches the marks' socket
    marks.end("first")
    marks.begin("second")
    assert marked(client, {b"second"}) == {b"second"}, "a mark written to the closed connection was lost"
    marks.close()


def test_marks_while_redis_is_down_are_dropped_with_one_warning_and_resume_after_it_returns(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(marks_module, "RETRY_AFTER_S", 0.2)
    with EmbeddedRedis() as server:
        client = redis.Redis(port=server.port, socket_connect_timeout=1)
        marks = DeviceMarks(client, KEY)
        marks.begin("before")
        assert marked(client, {b"before"}) == {b"before"}
        server.stop()
        caplog.set_level(logging.INFO, logger=marks_module.__name__)
        t0 = time.monotonic()
        for i in range(50):  # never raises into the device's thread
            marks.begin(f"down{i}")
        assert time.monotonic() - t0 < 5, "each mark waited on the connection"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "not counted" in warnings[0].getMessage()
        server.start()
        time.sleep(0.3)  # past the back-off
        marks.begin("after")
        assert marked(client, {b"after"}) == {b"after"}, "the server restarted empty"
        assert any("works again" in r.getMessage() for r in caplog.records)
        marks.close()
        client.close()


def test_a_mark_refused_for_memory_is_logged_as_itself_and_again_after_one_was_taken(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    marks = DeviceMarks(redis.Redis(port=client.connection_pool.connection_kwargs["port"]), KEY)
    caplog.set_level(logging.ERROR, logger=marks_module.__name__)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)  # every write refused
    try:
        marks.begin("full-1")
        time.sleep(0.1)
        marks.begin("full-2")  # reads back the first refusal
        client.config_set("maxmemory", 0)
        time.sleep(0.1)
        marks.begin("taken")  # reads back the second refusal: logged once
        time.sleep(0.1)
        client.config_set("maxmemory", 1)
        marks.begin("full-3")  # reads back the taken mark's reply
        time.sleep(0.1)
        marks.end("x")
        marks.flush()  # reads back the third refusal
    finally:
        client.config_set("maxmemory", 0)
        marks.close()
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2, refusals
    assert all("maxmemory" in m and "carpool acl" not in m for m in refusals), "not an ACL's refusal"


def test_an_acl_that_refuses_the_marks_fails_the_check_and_a_refused_mark_is_logged_once(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    client.acl_setuser(
        "old-worker", enabled=True, passwords=["+pw"], commands=["+@all"], keys=["~other:*"], reset=True
    )
    port = client.connection_pool.connection_kwargs["port"]
    marks = DeviceMarks(redis.Redis(port=port, username="old-worker", password="pw"), KEY)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            marks.check()
        caplog.set_level(logging.ERROR, logger=marks_module.__name__)
        for i in range(5):
            marks.begin(f"b{i}")
        time.sleep(0.1)
        marks.begin("b5")  # reads back the replies that arrived before it
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1
        assert (
            "no permissions" in refusals[0].getMessage()
            and "carpool acl --role worker" in refusals[0].getMessage()
        )
        assert not client.exists(KEY)
    finally:
        marks.close()
        client.acl_deluser("old-worker")
