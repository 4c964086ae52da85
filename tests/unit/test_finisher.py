"""The worker's finisher: a batch's results are stored beside the next batch, never more than one
batch behind, in order, and a failure leaves the requests to lease recovery."""

from __future__ import annotations

import threading
import time

import pytest

from carpool.gpu_worker.stage import Finisher


def test_jobs_run_in_order_and_a_new_one_waits_for_the_previous() -> None:
    finisher = Finisher()
    release = threading.Event()
    done: list[str] = []

    def first() -> None:
        release.wait(5)
        done.append("first")

    finisher.submit(first, ["a", "b"])
    assert finisher.pending_ids() == ["a", "b"]  # still held: the heartbeat keeps renewing them
    second_submitted = threading.Event()

    def submit_second() -> None:
        finisher.submit(lambda: done.append("second"), ["c"])
        second_submitted.set()

    threading.Thread(target=submit_second).start()
    assert not second_submitted.wait(0.2)  # blocked: one batch at most waits to be stored
    release.set()
    assert second_submitted.wait(5)
    assert finisher.drain(5)
    assert done == ["first", "second"] and finisher.pending_ids() == []


def test_a_failing_job_is_logged_and_the_finisher_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    finisher = Finisher()

    def broken() -> None:
        raise ConnectionError("redis went away for good")

    finisher.submit(broken, ["x"])
    assert finisher.drain(5)
    assert "lease recovery" in caplog.text and finisher.pending_ids() == []
    ran = threading.Event()
    finisher.submit(ran.set, ["y"])
    assert ran.wait(5)


def test_drain_reports_a_job_that_outlasts_it() -> None:
    finisher = Finisher()
    finisher.submit(lambda: time.sleep(0.5), ["slow"])
    assert finisher.drain(0.05) is False
    assert finisher.drain(5) is True
