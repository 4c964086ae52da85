"""Requests the coordinator holds until their eta, driven with numbers."""

from __future__ import annotations

from carpool.batching import Request
from carpool.coordinator.deferred import Deferred


def request(request_id: str, arrival_s: float = 0.0) -> Request:
    return Request(id=request_id, model="toy", length=4, arrival_s=arrival_s, deadline_s=arrival_s + 60)


def test_requests_come_due_at_their_time_soonest_first() -> None:
    held = Deferred()
    assert held.next_due_s() is None and held.due(1e9) == []
    held.add(request("late"), 30.0)
    held.add(request("soon"), 10.0)
    held.add(request("also-soon"), 10.0)
    assert len(held) == 3 and held.next_due_s() == 10.0
    assert held.due(9.999) == []
    assert [r.id for r in held.due(10.0)] == ["soon", "also-soon"]  # ties keep arrival order
    assert held.next_due_s() == 30.0
    assert [r.id for r in held.due(100.0)] == ["late"]
    assert len(held) == 0 and held.next_due_s() is None


def test_discarded_requests_never_come_due() -> None:
    held = Deferred()
    for i, due in enumerate((5.0, 1.0, 3.0)):
        held.add(request(f"r{i}"), due)
    assert held.discard({"nobody"}) == []
    assert {r.id for r in held.discard({"r1", "r2"})} == {"r1", "r2"}
    assert len(held) == 1
    assert held.next_due_s() == 5.0
    assert [r.id for r in held.due(10.0)] == ["r0"]


def test_drain_hands_back_everything_soonest_first() -> None:
    held = Deferred()
    held.add(request("b"), 2.0)
    held.add(request("a"), 1.0)
    assert [r.id for r in held.drain()] == ["a", "b"]
    assert len(held) == 0
