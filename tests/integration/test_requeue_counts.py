"""`taken` counts a request each time a coordinator takes it: one handed back at shutdown, or
returned by a reap after its holder died, is taken again. `requeued:<reason>` counts those, so the
numbers of `carpool status` add up: taken = dispatched + failed in the coordinator + requeued +
pending (docs/OBSERVABILITY.md)."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from carpool.tools.embedded import EmbeddedRedis
from tests.integration.conftest import Processes, start_stack, wait_for
from tests.integration.test_observability import TOY, run_status, stats_hash

pytestmark = pytest.mark.integration


def send(n: int) -> list[Any]:
    from carpool.tasks import infer

    return [infer.delay(f"request number {i}", model="toy") for i in range(n)]


def pending(processes: Processes) -> int:
    proc = run_status(processes, "--json", "--interval", "0")
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["pending"])


def test_requests_a_coordinator_hands_back_at_shutdown_count_as_requeued(processes: Processes) -> None:
    n = 120
    coordinator = processes.start("coordinator", "coordinator", **TOY)
    processes.wait_coordinator(coordinator.pid)
    held = send(n)  # no worker: the coordinator holds them all
    wait_for("the coordinator holding every request", lambda: pending(processes) == n)
    processes.stop("coordinator", signal.SIGTERM)
    stats = stats_hash(processes)
    assert (stats.get("taken"), stats.get("requeued:shutdown")) == (n, n), stats

    # The next coordinator takes them again and a worker runs them: taken twice, dispatched once.
    start_stack(processes, 1, **TOY)
    for r in held:
        r.get(timeout=120)

    def settled() -> dict[str, object]:
        proc = run_status(processes, "--json", "--interval", "0")
        assert proc.returncode == 0, proc.stderr
        snap: dict[str, object] = json.loads(proc.stdout)
        return snap if snap["dispatched"] == n and snap["pending"] == 0 else {}

    snap = wait_for("the requests served", settled)
    assert snap["taken"] == 2 * n and snap["requeued"] == {"shutdown": n} and snap["failed"] == {}
    text = run_status(processes, "--once", "--interval", "0").stdout
    assert f"shutdown={n}" in text, text


def test_requests_a_reap_returns_count_as_requeued_after_their_lease(processes: Processes) -> None:
    n = 40
    env = {**TOY, "CARPOOL_RECOVERY_TIMEOUT_S": "2"}
    first = processes.start("first", "coordinator", **env)
    processes.wait_coordinator(first.pid)
    held = send(n)
    wait_for("the coordinator holding every request", lambda: pending(processes) == n)
    processes.kill("first")  # a crash: nothing handed back, its leases run out
    survivor = processes.start("coordinator", "coordinator", **env)
    processes.wait_coordinator(survivor.pid)
    processes.start("worker0", "worker", **env)
    for r in held:
        r.get(timeout=120)

    def counted() -> dict[str, float]:
        stats = stats_hash(processes)
        return stats if stats.get("dispatched") == n else {}

    stats = wait_for("the survivor's counts", counted)
    assert stats["requeued:lease_expired"] == n and stats["taken"] == 2 * n, stats
    assert "requeued:shutdown" not in stats


def test_status_reads_requeued_counts_and_the_spans_of_automatic_bins(clean_redis: EmbeddedRedis) -> None:
    import redis

    from carpool.coordinator.stats import CoordinatorStats, StatsWriter
    from carpool.redis_edge.keys import Keys
    from carpool.tools.status import as_dict, collect

    client = redis.Redis(port=clean_redis.port)
    keys = Keys("carpool.requests")
    one, two = (StatsWriter(client, keys, name, time.time) for name in ("c-one", "c-two"))
    depths = {("app.auto", "b0"): 2, ("app.auto", "b1"): 1}
    one_stats = CoordinatorStats(taken=10)
    one.write(
        one_stats, depths, {"pending": 3}, spans={("app.auto", "b0"): "1-40", ("app.auto", "b1"): "41+"}
    )
    # Each coordinator fits its own traffic: the same label may hold other lengths in another one.
    two.write(
        CoordinatorStats(taken=1),
        {},
        {"pending": 0},
        spans={("app.auto", "b0"): "1-24", ("app.auto", "b1"): "25+"},
    )
    snap = collect(client, keys)
    assert snap.spans == {("app.auto", "b0"): "1-24 | 1-40", ("app.auto", "b1"): "25+ | 41+"}
    assert snap.depth_by_bin == depths

    # Handed back after the last write: leaving adds it to the shared counters, once.
    one_stats.requeued["shutdown"] += 3
    one.leave()
    data = as_dict(collect(client, keys), None, "carpool.requests")
    assert data["requeued"] == {"shutdown": 3} and data["taken"] == 11
    assert data["bin_spans"] == {"app.auto:b0": "1-24", "app.auto:b1": "25+"}
