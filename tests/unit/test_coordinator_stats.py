"""The coordinator's stats hash: counters go as deltas (coordinators sum up), emptied bins as 0."""

from __future__ import annotations

from typing import Any

from carpool.coordinator.stats import CoordinatorStats, StatsWriter


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def pipeline(self, transaction: bool = True) -> RecordingClient:
        return self

    def __enter__(self) -> RecordingClient:
        return self

    def __exit__(self, *_: Any) -> None:
        pass

    def hincrby(self, *args: Any) -> None:
        self.calls.append(("hincrby", args, {}))

    def hset(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("hset", args, kwargs))

    def execute(self) -> None:
        pass


def test_counters_are_written_as_what_changed_and_emptied_bins_as_zero() -> None:
    client = RecordingClient()
    writer = StatsWriter(client, "stats")
    stats = CoordinatorStats(taken=5, batches=1)
    stats.failed["invalid"] += 1
    writer.write(stats, {("toy", "1-16"): 3}, {"workers": 2})
    assert ("hincrby", ("stats", "taken", 5), {}) in client.calls
    assert ("hincrby", ("stats", "failed:invalid", 1), {}) in client.calls
    assert client.calls[-1] == ("hset", ("stats",), {"mapping": {"workers": 2, "depth:toy:1-16": 3}})

    client.calls.clear()
    stats.taken += 2
    writer.write(stats, {}, {"workers": 2})
    assert client.calls == [
        ("hincrby", ("stats", "taken", 2), {}),
        ("hset", ("stats",), {"mapping": {"workers": 2, "depth:toy:1-16": 0}}),
    ]
