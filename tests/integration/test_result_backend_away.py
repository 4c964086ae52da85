"""A producer whose result backend cannot be reached says so, once, instead of waiting in silence,
and says when it is back (plain Celery raises after its retries; carpool's reads retry each time,
so that ``.get(timeout=...)`` keeps its timeout)."""

from __future__ import annotations

import logging

import pytest
from celery.exceptions import TimeoutError as CeleryTimeoutError

from carpool.tools.embedded import EmbeddedRedis, free_port
from tests.integration.conftest import Processes

pytestmark = pytest.mark.integration


def test_a_result_backend_out_of_reach_is_named_once_and_its_return_too(
    processes: Processes, caplog: pytest.LogCaptureFixture
) -> None:
    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings
    from carpool.tools.harness import release_result_consumer

    port = free_port()
    backend_url = f"redis://127.0.0.1:{port}/1"
    app = create_app(load_settings(broker_url=processes.broker_url, result_backend=backend_url, model="null"))
    sent = app.send_task("carpool.infer", args=["nobody answers"])  # no coordinator: it stays queued
    server = None
    try:
        with caplog.at_level(logging.WARNING, logger="carpool.celery_edge.result_consumer"):
            for _ in range(2):
                with pytest.raises(CeleryTimeoutError):
                    sent.get(timeout=1)
            lost = [r for r in caplog.records if "lost the connection to the result backend" in r.message]
            assert len(lost) == 1, "said once for the outage, not at each read"
            assert f"CARPOOL_RESULT_BACKEND=redis://127.0.0.1:{port}/1" in lost[0].message
            server = EmbeddedRedis(port=port).start()
            with pytest.raises(CeleryTimeoutError):
                sent.get(timeout=2)  # reconnected, and still unanswered
            assert any("reconnected to the result backend" in r.message for r in caplog.records)
    finally:
        release_result_consumer(app)
        if server is not None:
            server.cleanup()
