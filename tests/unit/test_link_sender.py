"""The coordinator's link thread (:class:`carpool.coordinator.outbox.LinkSender`): links sent off
the loop, in order; a stop that waits for them a while; errors that stop the coordinator or not."""

from __future__ import annotations

import logging
import threading

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
