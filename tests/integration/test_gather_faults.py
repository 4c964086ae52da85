"""gather and gather_async when Redis cannot be reached as the call starts: down (connections
refused), the wait goes on and the results come once it is back; stalled (nothing answers),
Celery's TimeoutError, as from ``.get()``, not a Redis error; gather_async's at the deadline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError

from carpool.tools.embedded import EmbeddedRedis, free_port
from tests.integration.tcpproxy import TcpProxy

pytestmark = pytest.mark.integration

SOCKET_TIMEOUT_S = 2.0  # CARPOOL_REDIS_SOCKET_TIMEOUT_S here (its lowest)
GATHERS = ("gather", "gather_async")
# How far past its timeout a blocking gather may raise while Redis does not answer: its reads each
# wait up to the socket timeout (and retry), as .get()'s do (see test_network_faults).
GET_OVERRUN_S = 5 * SOCKET_TIMEOUT_S


def _producer(port: int) -> Celery:
    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings

    return create_app(
        load_settings(
            broker_url=f"redis://127.0.0.1:{port}/0",
            result_backend=f"redis://127.0.0.1:{port}/1",
            redis_socket_timeout_s=SOCKET_TIMEOUT_S,
        )
    )


def _gather(how: str, results: list[Any], timeout: float) -> list[Any]:
    from carpool.producer.gather import gather, gather_async

    if how == "gather":
        return gather(results, timeout=timeout)
    return asyncio.run(gather_async(results, timeout=timeout))


@pytest.fixture()
def stalled(redis_server: EmbeddedRedis) -> Iterator[Celery]:
    """A producer app whose Redis, behind a proxy, stalls before the test begins."""
    from carpool.tools.harness import release_result_consumer

    with TcpProxy(redis_server.port) as proxy:
        producer = _producer(proxy.port)
        proxy.stall()
        try:
            yield producer
        finally:
            proxy.restore()
            release_result_consumer(producer)


@pytest.mark.parametrize("how", GATHERS)
def test_a_redis_down_at_the_call_is_waited_for(how: str) -> None:
    from carpool.celery_edge.results import SUCCESS
    from carpool.tools.harness import release_result_consumer

    server = EmbeddedRedis(port=free_port())
    producer = _producer(server.port)
    results = [producer.AsyncResult(f"down-{how}-{i}") for i in range(2)]

    def come_back() -> None:  # a second after the call, with the results stored meanwhile
        time.sleep(1.0)
        server.start()
        producer.backend.store_many([(r.id, SUCCESS, i) for i, r in enumerate(results)])

    worker = threading.Thread(target=come_back)
    worker.start()
    try:
        t0 = time.monotonic()
        assert _gather(how, results, timeout=15) == [0, 1]
        assert time.monotonic() - t0 < 5
    finally:
        worker.join()
        release_result_consumer(producer)
        server.cleanup()


@pytest.mark.parametrize("how", GATHERS)
def test_a_stalled_redis_times_out_with_celerys_timeout_error(stalled: Celery, how: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(CeleryTimeoutError):
        _gather(how, [stalled.AsyncResult(f"stalled-{how}")], timeout=1.0)
    took = time.monotonic() - t0
    if how == "gather_async":  # its reads are awaited, so the deadline cuts them
        assert took < 1.0 + SOCKET_TIMEOUT_S / 2
    else:  # each blocking read waits up to the socket timeout first, as .get()'s do
        assert took < 1.0 + GET_OVERRUN_S


@pytest.mark.parametrize("how", GATHERS)
@pytest.mark.parametrize("timeout", [0.0, 0.0005])
def test_a_timeout_too_short_to_wait_still_collects_what_is_stored(
    redis_server: EmbeddedRedis, how: str, timeout: float
) -> None:
    """As ``.get()`` reads the stored result first whatever its timeout, a gather with no time to
    wait returns what is ready; the deadline then only ends the wait for the rest."""
    from carpool.celery_edge.results import SUCCESS
    from carpool.tools.harness import release_result_consumer

    producer = _producer(redis_server.port)
    try:
        ids = [f"ready-{how}-{timeout}-{i}" for i in range(3)]
        producer.backend.store_many([(task_id, SUCCESS, i) for i, task_id in enumerate(ids)])
        assert _gather(how, [producer.AsyncResult(t) for t in ids], timeout=timeout) == [0, 1, 2]
        with pytest.raises(CeleryTimeoutError):
            _gather(how, [producer.AsyncResult(t) for t in [*ids, f"never-{how}-{timeout}"]], timeout=timeout)
    finally:
        release_result_consumer(producer)
