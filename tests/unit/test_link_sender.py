"""The coordinator's link thread (:class:`carpool.coordinator.outbox.LinkSender`): links sent off
the loop, in order; a stop that waits for them a while; errors that stop the coordinator or not."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from carpool.coordinator.outbox import LinkSender

HANG_S = 10.0  # a bound that only a hang reaches


def test_jobs_run_in_order_on_a_thread_of_their_own() -> None:
    sender = LinkSender()
    ran: list[tuple[int, str]] = []
    for i in range(5):
        sender.submit(lambda i=i: ran.append((i, threading.current_thread().name)))  # type: ignore[misc]
    assert sender.flush(HANG_S) and not sender.busy
    assert [i for i, _ in ran] == [0, 1, 2, 3, 4]
    assert {name for _, name in ran} == {"carpool-links"}


def test_a_slow_job_does_not_hold_the_caller_and_a_failing_one_does_not_stop_the_next() -> None:
    sender = LinkSender()
    release = threading.Event()
    ran: list[str] = []

    def fails() -> None:
        raise RuntimeError("a defect in one request's links")

    sender.submit(lambda: release.wait(HANG_S))
    sender.submit(fails)
    sender.submit(lambda: ran.append("after"))
    assert sender.busy and ran == []  # submit returned while the first job still runs
    release.set()
    assert sender.flush(HANG_S) and ran == ["after"]
    assert sender.refused is None


def test_close_lets_queued_jobs_run_then_takes_no_more() -> None:
    sender = LinkSender()
    ran: list[int] = []
    gate = threading.Event()
    sender.submit(lambda: gate.wait(HANG_S))
    sender.submit(lambda: ran.append(1))
    threading.Timer(0.05, gate.set).start()
    sender.close(HANG_S)
    assert ran == [1]
    sender.submit(lambda: ran.append(2))  # after close: left to the outbox
    assert sender.flush(HANG_S) and ran == [1]


def test_close_gives_up_on_a_job_that_hangs_saying_where_its_links_are(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sender = LinkSender()
    release = threading.Event()
    sender.submit(lambda: release.wait(HANG_S))
    with caplog.at_level(logging.WARNING):
        sender.close(0.05)
    release.set()
    assert "they stay in the links outbox" in caplog.text


def test_an_acl_refusal_is_kept_for_the_loop_and_an_outage_is_not() -> None:
    sender = LinkSender()

    def away() -> None:
        raise redis.ConnectionError("Connection refused")

    def refused() -> None:
        raise redis.exceptions.NoPermissionError("this user has no permissions to run the 'zadd' command")

    sender.submit(away)
    assert sender.flush(HANG_S) and sender.refused is None
    sender.submit(refused)
    assert sender.flush(HANG_S) and isinstance(sender.refused, redis.exceptions.NoPermissionError)


def test_an_error_callback_that_exits_ends_no_thread_and_a_long_one_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """sys.exit() in an error callback run here ended the thread in silence, and every link after it
    waited for good; one that runs on is reported once, past the time given."""
    sender = LinkSender()
    ran: list[str] = []
    release = threading.Event()

    def exits() -> None:
        raise SystemExit(3)

    with caplog.at_level(logging.ERROR):
        sender.submit(exits)
        sender.submit(lambda: ran.append("after"))
        assert sender.flush(HANG_S) and ran == ["after"]
    assert "an error callback run in this coordinator raised" in caplog.text
    assert sender.overdue(0.0) is None, "nothing running"
    sender.submit(lambda: release.wait(HANG_S))
    deadline = time.monotonic() + HANG_S
    while (running := sender.overdue(0.05)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running is not None and running >= 0.05
    assert sender.overdue(0.05) is None, "said once a job"
    release.set()
    assert sender.flush(HANG_S)


def test_an_outbox_round_that_meets_an_outage_gives_back_the_tries_of_what_it_did_not_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from carpool.celery_edge import links
    from carpool.coordinator import outbox
    from carpool.redis_edge.store import LinksDue

    class Backend:
        def get_task_meta(self, request_id: str, cache: bool = True) -> dict[str, object]:
            if request_id == "b":
                raise redis.ConnectionError("Connection refused")
            return {"status": "SUCCESS", "result": 1}

    class Store:
        untried: list[str] = []
        emptied: list[str] = []

        def links_due(self, limit: int) -> LinksDue:
            entries = [(rid, links.outbox_entry("t", {"callbacks": []})) for rid in ("a", "b", "c")]
            return LinksDue(entries, [])

        def links_untried(self, ids: list[str]) -> None:
            self.untried.extend(ids)

        def links_sent(self, ids: list[str]) -> None:
            self.emptied.extend(ids)

    monkeypatch.setattr(outbox, "SEND_WINDOW_S", 0.05)
    store = Store()
    c = SimpleNamespace(
        app=SimpleNamespace(backend=Backend()),
        store=store,
        link_sender=LinkSender(),
        hostname="coordinator",
        metrics=SimpleNamespace(links_resent=SimpleNamespace(inc=lambda n: None)),
    )
    with pytest.raises(redis.ConnectionError):
        outbox.send_due_links(c)  # type: ignore[arg-type]
    assert store.emptied == ["a"] and store.untried == ["b", "c"]
    assert c.link_sender.held() == [], "released whatever happened"
