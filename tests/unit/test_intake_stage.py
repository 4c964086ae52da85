"""The intake stage's bookkeeping, its chunks run by hand, and the coordinator's use of it (Redis faked)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import pytest

from carpool.coordinator.intake import Intake
from carpool.coordinator.stage import MAX_AUTO_THREADS, IntakeStage, auto_threads
from carpool.coordinator.waiting import WaitFor
from carpool.errors import QueueFull
from tests.unit.messages import message
from tests.unit.test_coordinator_loop import Clocks, HeardRevokes, coordinator


class ByHand(Executor):
    """Runs each submitted chunk only when the test says so."""

    def __init__(self) -> None:
        self.waiting: list[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.waiting.append((future, fn, args))
        return future

    def run(self, count: int | None = None) -> None:
        todo, self.waiting = self.waiting[:count], self.waiting[len(self.waiting[:count]) :]
        for future, fn, args in todo:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as exc:
                    future.set_exception(exc)


def taken(n: int, prefix: str = "r") -> list[tuple[str, bytes]]:
    return [(f"{prefix}{i}", b"raw") for i in range(n)]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    def __call__(self, part: Sequence[tuple[str, bytes]], room: int) -> Intake:
        self.calls.append(([i for i, _ in part], room))
        if part[0][0] == "boom0":
            raise RuntimeError("tokenizer broke")
        return Intake()


def test_a_take_runs_in_chunks_each_with_its_share_of_the_room() -> None:
    run, pool = Recorder(), ByHand()
    stage = IntakeStage(run, 1, chunk=4, executor=pool)
    stage.submit(taken(10), room=6)
    assert len(stage) == 10 and stage.reserved == 6 and stage.busy
    pool.run()
    assert [(len(ids), room) for ids, room in run.calls] == [(4, 4), (4, 2), (2, 0)]


def test_finished_chunks_leave_the_stage_and_the_others_stay_held() -> None:
    pool = ByHand()
    stage = IntakeStage(Recorder(), 1, chunk=4, executor=pool)
    stage.submit(taken(10), room=100)
    assert not stage.ready.is_set()
    pool.run(1)
    assert stage.ready.is_set(), "a finished chunk wakes the loop"
    intakes, errors = stage.finished()
    assert len(intakes) == 1 and errors == [] and not stage.ready.is_set()
    assert stage.held_ids() == [f"r{i}" for i in range(4, 10)] and stage.reserved == 6


def test_a_failed_chunk_is_reported_and_no_longer_held() -> None:
    pool = ByHand()
    stage = IntakeStage(Recorder(), 1, chunk=2, executor=pool)
    stage.submit(taken(2, "boom"), room=100)
    stage.submit(taken(2), room=100)
    pool.run()
    intakes, errors = stage.finished()
    assert len(intakes) == 1 and [str(e) for e in errors] == ["tokenizer broke"]
    assert not stage.busy and stage.held_ids() == []


def test_drain_hands_back_every_request_not_admitted_and_cancels_the_chunks_not_started() -> None:
    pool = ByHand()
    stage = IntakeStage(Recorder(), 1, chunk=4, executor=pool)
    stage.submit(taken(6), room=100)
    assert sorted(stage.drain()) == sorted(f"r{i}" for i in range(6))
    assert not stage.busy and all(future.cancelled() for future, _, _ in pool.waiting)


def test_auto_threads_leaves_cores_to_the_loop_and_an_explicit_count_wins() -> None:
    assert auto_threads(3) == 3
    assert 1 <= auto_threads(0) <= MAX_AUTO_THREADS


# --- the coordinator with the stage ----------------------------------------------------------------
@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


def staged(clocks: Clocks, **overrides: Any) -> tuple[Any, ByHand]:
    c = coordinator(clocks, workers=0, max_batch=4, **overrides)
    pool = ByHand()
    c.stage = IntakeStage(c.take_chunk, 1, chunk=4, executor=pool)
    return c, pool


def test_a_small_take_is_admitted_in_the_step_that_took_it(clocks: Clocks) -> None:
    c, pool = staged(clocks)
    c.store.queue += [(i, message(i, "hello there")) for i in ("a", "b")]
    c.step()
    assert len(c.policy) == 2 and pool.waiting == [] and not c.stage.busy


def test_a_large_take_joins_the_policy_chunk_by_chunk_and_stays_leased_meanwhile(clocks: Clocks) -> None:
    c, pool = staged(clocks)
    ids = [f"r{i}" for i in range(10)]
    c.store.queue += [(i, message(i, "hello there")) for i in ids]
    wait = c.step()
    assert len(c.policy) == 0 and len(pool.waiting) == 3
    assert wait.block_on is WaitFor.INTAKE, "the loop waits for the next chunk"
    c._next_renewal = 0.0
    c.housekeeping(clocks.mono())
    assert sorted(c.store.renewed) == sorted(ids), "taken but not admitted: still renewed"
    pool.run(1)
    c.step()
    assert len(c.policy) == 4
    c.shutdown()
    assert sorted(c.store.requeued) == sorted(ids), "admitted or not, all handed back"


def test_room_is_shared_across_chunks_and_the_rest_is_refused_queue_full(clocks: Clocks) -> None:
    c, pool = staged(clocks, max_pending=6)
    c.store.queue += [(f"r{i}", message(f"r{i}", "hello there")) for i in range(10)]
    c.step()
    pool.run()
    c.step()
    assert len(c.policy) == 6
    refused = [i for i, _, error in c.backend.stored if isinstance(error, QueueFull)]
    assert refused == ["r6", "r7", "r8", "r9"]


def test_a_request_revoked_while_its_chunk_is_prepared_is_answered_revoked(clocks: Clocks) -> None:
    c, pool = staged(clocks)
    c.revokes = HeardRevokes()
    c.store.queue += [(f"r{i}", message(f"r{i}", "hello there")) for i in range(8)]
    c.step()
    c.revokes.heard.append("r5")
    c.step()
    pool.run()
    c.step()
    assert [(i, state) for i, state, _ in c.backend.stored] == [("r5", "REVOKED")]
    assert len(c.policy) == 7 and "r5" not in c.stage.held_ids()
