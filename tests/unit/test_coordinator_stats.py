"""The coordinators' stats: counters go as running totals to ``stats.lua`` (which adds them to one
hash, coordinators summing up; tests/integration/test_observability.py runs it), gauges into a hash
per coordinator that expires unless rewritten, emptied bins as 0."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.coordinator.stats import COORDINATORS_KEPT_S, GAUGES_TTL_S, CoordinatorStats, StatsWriter
from carpool.redis_edge.keys import Keys

KEYS = Keys("q")
WALL_S = 1_700_000_000.0


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def pipeline(self, transaction: bool = True) -> RecordingClient:
        return self

    def __enter__(self) -> RecordingClient:
        return self

    def __exit__(self, *_: Any) -> None:
        pass

    def register_script(self, source: str) -> Any:
        def call(keys: list[str], args: list[Any], client: Any = None) -> None:
            self.calls.append(("stats.lua", tuple(keys), {"args": tuple(args)}))

        return call

    def __getattr__(self, command: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((command, args, kwargs))

    def execute(self) -> None:
        pass


def writer(client: RecordingClient, hostname: str) -> StatsWriter:
    return StatsWriter(client, KEYS, hostname, lambda: WALL_S)


def totals_sent(client: RecordingClient) -> list[tuple[tuple[Any, ...], tuple[Any, ...]]]:
    return [(keys, kw["args"]) for command, keys, kw in client.calls if command == "stats.lua"]


def test_counters_go_as_the_totals_that_moved_and_emptied_bins_as_zero() -> None:
    client = RecordingClient()
    w = writer(client, "c1")
    stats = CoordinatorStats(taken=5, batches=1)
    stats.failed["invalid"] += 1
    w.write(stats, {("toy", "1-16"): 3}, {"pending": 3})
    [(keys, args)] = totals_sent(client)
    assert keys[0] == KEYS.stats and keys[1].startswith(KEYS.stats_applied_of("c1:"))
    assert args == (COORDINATORS_KEPT_S, "taken", 5, "batches", 1, "failed:invalid", 1)
    gauges = [c for c in client.calls if c[0] == "hset"]
    assert gauges == [("hset", (KEYS.gauges_of("c1"),), {"mapping": {"pending": 3, "depth:toy:1-16": 3}})]

    client.calls.clear()
    stats.taken += 2
    w.write(stats, {}, {"pending": 0})
    assert totals_sent(client) == [(keys, (COORDINATORS_KEPT_S, "taken", 7))]
    assert [c for c in client.calls if c[0] == "hset"] == [
        ("hset", (KEYS.gauges_of("c1"),), {"mapping": {"pending": 0, "depth:toy:1-16": 0}}),
    ]

    client.calls.clear()
    w.write(stats, {}, {"pending": 0})
    assert totals_sent(client) == []  # nothing moved: no script call

    stats.prepare_cpu_ns += 12_345_000
    stats.prepared += 7
    w.write(stats, {}, {"pending": 0})
    assert totals_sent(client) == [(keys, (COORDINATORS_KEPT_S, "prepare_cpu_ns", 12_345_000, "prepared", 7))]


def test_a_failed_write_sends_its_totals_again_with_the_next() -> None:
    class FailingOnce(RecordingClient):
        failures = 1

        def execute(self) -> None:
            if self.failures:
                self.failures -= 1
                raise ConnectionError("reply lost")

    client = FailingOnce()
    w = writer(client, "c1")
    stats = CoordinatorStats(taken=5, batches=1)
    with pytest.raises(ConnectionError):
        w.write(stats, {}, {"pending": 0})
    stats.taken += 1
    client.calls.clear()
    w.write(stats, {}, {"pending": 0})
    [(_, args)] = totals_sent(client)
    assert args == (COORDINATORS_KEPT_S, "taken", 6, "batches", 1)


def test_each_run_of_a_coordinator_keeps_its_own_applied_totals() -> None:
    client = RecordingClient()
    writer(client, "c1").write(CoordinatorStats(taken=1), {}, {})
    writer(client, "c1").write(CoordinatorStats(taken=1), {}, {})
    first, second = (keys[1] for keys, _ in totals_sent(client))
    assert first != second


def test_each_coordinator_writes_gauges_of_its_own_that_expire() -> None:
    client = RecordingClient()
    one, two = writer(client, "c1"), writer(client, "c2")
    one.write(CoordinatorStats(taken=4), {}, {"pending": 4})
    two.write(CoordinatorStats(taken=6), {}, {"pending": 6})
    calls = client.calls
    # Counters add up in the one shared hash; the gauges stay apart, one hash each.
    assert [(keys[0], args[1:]) for keys, args in totals_sent(client)] == [
        (KEYS.stats, ("taken", 4)),
        (KEYS.stats, ("taken", 6)),
    ]
    assert [(c[1][0], c[2]["mapping"]) for c in calls if c[0] == "hset"] == [
        (KEYS.gauges_of("c1"), {"pending": 4}),
        (KEYS.gauges_of("c2"), {"pending": 6}),
    ]
    # Each gauge hash expires unless rewritten, and its writer is listed for readers to find it; each
    # run's applied totals are kept while it writes.
    (one_applied, _), (two_applied, _) = totals_sent(client)
    assert [c[1] for c in calls if c[0] == "expire"] == [
        (KEYS.gauges_of("c1"), GAUGES_TTL_S),
        (one_applied[1], COORDINATORS_KEPT_S),
        (KEYS.gauges_of("c2"), GAUGES_TTL_S),
        (two_applied[1], COORDINATORS_KEPT_S),
    ]
    now_ms = int(WALL_S * 1000)
    assert [c[1] for c in calls if c[0] == "zadd"] == [
        (KEYS.coordinators, {"c1": now_ms}),
        (KEYS.coordinators, {"c2": now_ms}),
    ]
    # Names long gone leave the list.
    assert ("zremrangebyscore", (KEYS.coordinators, "-inf", now_ms - COORDINATORS_KEPT_S * 1000), {}) in calls


def test_a_coordinator_that_leaves_withdraws_its_gauges_at_once() -> None:
    client = RecordingClient()
    w = writer(client, "c1")
    w.write(CoordinatorStats(taken=1), {}, {"pending": 1})
    [(keys, _)] = totals_sent(client)
    client.calls.clear()
    w.leave()
    assert client.calls == [
        ("delete", (KEYS.gauges_of("c1"), keys[1]), {}),
        ("zrem", (KEYS.coordinators, "c1"), {}),
    ]


def test_carpool_status_shows_the_task_of_each_queue() -> None:
    from rich.console import Console

    from carpool.tools.status import Snapshot, render

    client = RecordingClient()
    writer(client, "c1").write(
        CoordinatorStats(),
        {("toy", "1-16"): 2, ("app.shout", "1-8"): 1},
        {"pending": 3},
        lambda key: "carpool.infer" if key == "toy" else key,
    )
    [(_, _, kwargs)] = [c for c in client.calls if c[0] == "hset"]
    assert (
        kwargs["mapping"]["task:toy"] == "carpool.infer"
        and kwargs["mapping"]["task:app.shout"] == "app.shout"
    )

    snap = Snapshot(
        taken_at=0.0,
        redis_time=0.0,
        queued={},
        workers=[],
        in_flight=3,
        dead_letter=0,
        stats={"pending": 3, "depth:toy:1-16": 2, "depth:app.shout:1-8": 1},
        tasks={"toy": "carpool.infer", "app.shout": "app.shout"},
    )
    console = Console(width=120, record=True)
    console.print(render(snap, None, "q", "redis://localhost"))
    lines = console.export_text().splitlines()
    assert any("carpool.infer" in line and "model=toy" in line and "1-16: 2" in line for line in lines)
    assert any("app.shout" in line and "model=" not in line and "1-8: 1" in line for line in lines)


def test_carpool_status_names_a_batch_queue_no_worker_consumes() -> None:
    from rich.console import Console

    from carpool.tools.status import Snapshot, render

    def shown(snap: Snapshot) -> list[str]:
        console = Console(width=160, record=True)
        console.print(render(snap, None, "q", "redis://localhost"))
        return console.export_text().splitlines()

    base: dict[str, Any] = {
        "taken_at": 0.0, "redis_time": 0.0, "queued": {}, "workers": ["w1"], "in_flight": 0,
        "dead_letter": 0, "stats": {},
    }  # fmt: skip
    served = shown(Snapshot(**base, batch_queues={"carpool.batches": ["w1"]}))
    assert not any("no worker" in line or "batch queues" in line for line in served)
    lines = shown(Snapshot(**base, batch_queues={"big": [], "carpool.batches": ["w1"]}, unserved=["big"]))
    assert any("batch queues" in line and "big=0" in line and "carpool.batches=1" in line for line in lines)
    assert any("no worker" in line and "big" in line for line in lines)
    lines = shown(Snapshot(**{**base, "stats": {"pending": 2, "deferred": 5}}))
    assert any("pending in coordinator" in line and "2  +5 held for countdown/eta" in line for line in lines)
    lines = shown(Snapshot(**base, batch_queues={"carpool.batches": []}, unsaid=["w1"]))
    assert any("batch queues" in line and "1 worker(s) of an earlier release" in line for line in lines)
    assert not any("no worker" in line for line in lines)


def test_requests_put_back_count_apart_and_a_leaving_coordinator_writes_its_last_counts() -> None:
    """Each request handed back at shutdown (or returned by a reap) is taken, and counted taken,
    again: its own counter says so. The hand-back comes after the last write: leaving adds it."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from carpool.coordinator.admission import count_requeued
    from carpool.coordinator.metrics import CoordinatorMetrics

    client = RecordingClient()
    w = writer(client, "c1")
    registry = CollectorRegistry()
    c = SimpleNamespace(stats=CoordinatorStats(taken=5), metrics=CoordinatorMetrics(registry))
    w.write(c.stats, {}, {"pending": 5})
    [(keys, _)] = totals_sent(client)
    client.calls.clear()
    count_requeued(c, "shutdown", 5)  # type: ignore[arg-type]
    count_requeued(c, "lease_expired", 0)  # type: ignore[arg-type]
    w.leave()
    assert client.calls == [
        ("stats.lua", tuple(keys), {"args": (COORDINATORS_KEPT_S, "requeued:shutdown", 5)}),
        ("delete", (KEYS.gauges_of("c1"), keys[1]), {}),
        ("zrem", (KEYS.coordinators, "c1"), {}),
    ]
    assert registry.get_sample_value("carpool_requeued_total", {"reason": "shutdown"}) == 5
    assert registry.get_sample_value("carpool_requeued_total", {"reason": "lease_expired"}) is None


def test_carpool_status_shows_what_went_back_and_the_spans_of_automatic_bins() -> None:
    from rich.console import Console

    from carpool.tools.status import Snapshot, render
    from carpool.tools.status.snapshot import as_dict

    client = RecordingClient()
    w = writer(client, "c1")
    w.write(
        CoordinatorStats(),
        {("app.auto", "b0"): 2, ("app.auto", "b1"): 1},
        {"pending": 3},
        spans={("app.auto", "b0"): "1-40", ("app.auto", "b1"): "41+"},
    )
    [(_, _, kwargs)] = [c for c in client.calls if c[0] == "hset"]
    assert kwargs["mapping"]["span:app.auto:b0"] == "1-40" and kwargs["mapping"]["span:app.auto:b1"] == "41+"
    client.calls.clear()
    w.write(CoordinatorStats(), {}, {"pending": 0}, spans={("app.auto", "b0"): "1+"})  # a refit to one bin
    assert [c for c in client.calls if c[0] == "hdel"] == [
        ("hdel", (KEYS.gauges_of("c1"), "span:app.auto:b1"), {})
    ]

    snap = Snapshot(
        taken_at=0.0,
        redis_time=0.0,
        queued={},
        workers=[],
        in_flight=3,
        dead_letter=0,
        stats={
            "taken": 2000,
            "dispatched": 1000,
            "requeued:shutdown": 990,
            "requeued:lease_expired": 7,
            "pending": 3,
            "depth:app.auto:b0": 2,
            "depth:app.auto:b1": 1,
            "depth:app.auto:b10": 0,
        },
        tasks={"app.auto": "app.auto"},
        spans={("app.auto", "b0"): "1-40", ("app.auto", "b1"): "41+"},
    )
    console = Console(width=140, record=True)
    console.print(render(snap, None, "q", "redis://localhost"))
    text = console.export_text()
    assert "shutdown=990" in text and "lease_expired=7" in text
    assert "b0 (1-40): 2  b1 (41+): 1" in text
    data = as_dict(snap, None, "q")
    assert data["requeued"] == {"lease_expired": 7, "shutdown": 990}
    assert data["bin_spans"] == {"app.auto:b0": "1-40", "app.auto:b1": "41+"}
