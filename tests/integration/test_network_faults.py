"""Network faults between each role and Redis: connections reset, stalled, or left half-open.

The coordinator, the worker and the producer (this test process) each reach Redis through a TCP
proxy of their own (:mod:`tests.integration.tcpproxy`), so a fault hits one role at a time. One
stack serves every case, and its processes must outlive them all: recovering means without a
restart. In each case requests are in flight when the fault hits and more are sent while it lasts
and after it is lifted; every one must then have exactly its right result, and nothing may be left
queued or in flight. A producer whose Redis stalls or goes silent must get Celery's TimeoutError
from ``.get(timeout=...)``, not hang.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError

from carpool.redis_edge.keys import Keys
from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.harness import Harness, release_result_consumer
from carpool.tools.workload import mixed_texts
from tests.integration.conftest import wait_for
from tests.integration.models import SLOW
from tests.integration.tcpproxy import TcpProxy
from tests.integration.test_reliability import expected, record
from tests.tolerances import VECTOR_ATOL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROLES = ("coordinator", "worker", "producer")
FAULTS = ("reset", "stall", "half-open")
SOCKET_TIMEOUT_S = 2.0  # CARPOOL_REDIS_SOCKET_TIMEOUT_S here (its lowest)
HEALTH_CHECK_S = 1.0  # CARPOOL_REDIS_HEALTH_CHECK_S here
RECOVERY_S = 3.0  # CARPOOL_RECOVERY_TIMEOUT_S here
STALL_S = 4.0  # longer than the socket timeout: clients give up on the stalled connections
GET_TIMEOUT_S = 1.0
# How far past its timeout a .get() may return while Redis does not answer: the reads it makes
# each wait up to the socket timeout (and retry once), so a few of those. A hang fails this.
GET_OVERRUN_S = 5 * SOCKET_TIMEOUT_S
ENV = {
    "CARPOOL_MODEL": SLOW,
    "CARPOOL_MODELS": SLOW,
    "CARPOOL_MAX_BATCH": "8",
    "SLOW_TOY_DELAY_S": "0.05",
    "CARPOOL_RECOVERY_TIMEOUT_S": str(RECOVERY_S),
    "CARPOOL_REDIS_SOCKET_TIMEOUT_S": str(SOCKET_TIMEOUT_S),
    "CARPOOL_REDIS_HEALTH_CHECK_S": str(HEALTH_CHECK_S),
}
KEYS = Keys("carpool.requests")


@dataclass
class Stack:
    harness: Harness
    proxies: dict[str, TcpProxy]
    producer: Celery
    pids: dict[str, int]

    def admin(self, db: int = 0) -> redis.Redis:
        """A client straight to Redis, past every proxy."""
        assert self.harness.server is not None
        return redis.Redis(port=self.harness.server.port, db=db)


@pytest.fixture(scope="module")
def stack(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings

    redis.Redis(port=redis_server.port).flushall()
    proxies = {role: TcpProxy(redis_server.port).start() for role in ROLES}
    harness = Harness(redis_server, Path(tmp_path_factory.mktemp("netfaults")))
    producer = None
    try:
        started = {}
        for role in ("coordinator", "worker"):
            via = proxies[role]
            started[role] = harness.start(
                role, role, CARPOOL_BROKER_URL=via.url(0), CARPOOL_RESULT_BACKEND=via.url(1), **ENV
            )
        harness.wait_coordinator(started["coordinator"].pid)  # the first fault must meet a serving one
        harness.wait_workers(1)
        via = proxies["producer"]
        producer = create_app(
            load_settings(
                broker_url=via.url(0),
                result_backend=via.url(1),
                redis_socket_timeout_s=SOCKET_TIMEOUT_S,
                redis_health_check_s=HEALTH_CHECK_S,
            )
        )
        yield Stack(harness, proxies, producer, dict(harness.pids()))
    finally:
        if producer is not None:
            release_result_consumer(producer)
        harness.close()
        for proxy in proxies.values():
            proxy.close()


def send(stack: Stack, texts: Sequence[str]) -> list[Any]:
    from carpool.producer.submit import submit_many

    return submit_many(texts, model=SLOW, app=stack.producer)


def collect(stack: Stack, results: Sequence[Any], timeout_s: float = 60) -> list[Any]:
    """Every result, or a failure that shows the end of both processes' logs."""
    try:
        return [r.get(timeout=timeout_s) for r in results]
    except Exception as exc:
        logs = "\n".join(f"--- {name}:\n{stack.harness.log(name)}" for name in ("coordinator", "worker"))
        raise AssertionError(f"{exc!r}\n{logs}") from exc


def start_fault(proxy: TcpProxy, fault: str) -> None:
    if fault == "reset":
        proxy.reset_all()
    elif fault == "stall":
        proxy.stall()
    else:
        proxy.blackhole()


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("role", ROLES)
def test_a_network_fault_loses_nothing_and_restarts_nothing(stack: Stack, role: str, fault: str) -> None:
    proxy = stack.proxies[role]
    texts = mixed_texts(120, seed=10 * ROLES.index(role) + FAULTS.index(fault))
    results = send(stack, texts[:60])  # in flight when the fault hits
    t_fault = time.monotonic()
    start_fault(proxy, fault)
    get_raised_s = None
    if role == "producer" and fault != "reset":
        # A result nobody computes: .get() can only wait, on connections that do not answer.
        never = stack.producer.AsyncResult(str(uuid.uuid4()))
        t0 = time.monotonic()
        with pytest.raises(CeleryTimeoutError):
            never.get(timeout=GET_TIMEOUT_S)
        get_raised_s = time.monotonic() - t0
        assert get_raised_s < GET_TIMEOUT_S + GET_OVERRUN_S, "a .get() outlived its timeout by far"
    else:
        results += send(stack, texts[60:90])  # through the fault (the producer's own path is sound)
    if fault == "stall":
        time.sleep(max(0.0, t_fault + STALL_S - time.monotonic()))
        proxy.restore()
    t_lifted = time.monotonic()
    results += send(stack, texts[len(results) :])  # after it

    got = collect(stack, results)
    answered_s = time.monotonic() - t_lifted
    want = expected(texts)
    wrong = [
        i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not np.allclose(g, w, atol=VECTOR_ATOL)
    ]
    assert not wrong, f"requests {wrong} have wrong results"
    # One answer each, and nothing left behind to be answered again.
    admin = stack.admin()
    # A lease that ran out during the fault puts its request back in a list before it is taken again.
    wait_for(
        "no request left in flight or queued",
        lambda: (
            admin.zcard(KEYS.inflight_lease) == 0 and all(admin.llen(key) == 0 for key in KEYS.request_lists)
        ),
        10,
    )
    assert stack.admin(1).exists(*[f"celery-task-meta-{r.id}" for r in results]) == len(results)
    # The same processes throughout, all still serving.
    stack.harness.check_alive()
    assert stack.harness.pids() == stack.pids, "a process was restarted"
    record(
        f"network {fault}: {role}",
        requests=len(results),
        lost=0,
        all_done_after_lifted_s=round(answered_s, 2),
        fault_lasted_s=round(t_lifted - t_fault, 2),
        get_timeout_raised_after_s=None if get_raised_s is None else round(get_raised_s, 2),
    )
