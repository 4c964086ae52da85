"""The pure batching policy under a fake clock: time is a number the test chooses."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.batching import (
    Batch,
    BatchPolicy,
    FlushReason,
    LatencyModel,
    PolicyConfig,
    Request,
    padded_length,
)
from carpool.names import PolicyName

_ids = itertools.count()


def req(
    length: int, at: float = 0.0, deadline: float = 100.0, priority: int = 0, model: str = "m"
) -> Request:
    return Request(
        id=f"r{next(_ids)}", model=model, length=length, arrival_s=at, deadline_s=deadline, priority=priority
    )


def policy(**kw: object) -> BatchPolicy:
    # A latency model that predicts from the prior set here until it is fed a batch's run time.
    latency = LatencyModel(prior_base_s=0.01, prior_per_token_s=1e-4)
    return BatchPolicy(PolicyConfig(**kw), latency)  # type: ignore[arg-type]


def observed(p: BatchPolicy, model: str = "m") -> BatchPolicy:
    """``p`` once a batch of ``model`` ran as its prior predicts (the predictions stay the same):
    only then may full batches take the room beyond the slots."""
    p.latency.observe(model, 32, p.latency.predict(model, 32))
    return p


def test_full_bin_leaves_at_once_even_without_waiting() -> None:
    p = policy(max_batch=4, bin_edges=(16, 64))
    reqs = [req(10) for _ in range(4)]
    for r in reqs:
        p.add(r)
    plan = p.poll(0.0, free_workers=1, free_slots=2)
    assert len(plan.batches) == 1
    assert plan.batches[0].flush_reason is FlushReason.FULL
    assert set(plan.batches[0].requests) == set(reqs)


def test_bins_keep_lengths_apart_and_pad_to_multiple_of_8() -> None:
    p = policy(max_batch=2, bin_edges=(16, 64))
    short = [req(5), req(12)]
    long = [req(40), req(63)]
    for r in (short[0], long[0], short[1], long[1]):
        p.add(r)
    plan = p.poll(0.0, free_workers=2, free_slots=2)
    batches = {b.bin_label: b for b in plan.batches}
    assert set(batches) == {"1-16", "17-64"}
    assert set(batches["1-16"].requests) == set(short)
    assert set(batches["17-64"].requests) == set(long)
    assert batches["1-16"].padded_len == 16
    assert batches["17-64"].padded_len == 64


def test_fifo_has_one_bin_and_pads_to_the_longest() -> None:
    p = policy(kind="fifo", max_batch=3)
    rs = [req(5), req(200), req(7)]
    for r in rs:
        p.add(r)
    plan = p.poll(0.0, free_workers=1, free_slots=1)
    assert [b.requests for b in plan.batches] == [tuple(rs)]
    assert plan.batches[0].padded_len == 200


def test_token_budget_cuts_the_batch() -> None:
    p = policy(kind="fifo", max_batch=100, max_tokens=64)
    rs = [req(16) for _ in range(6)]  # 16 padded tokens each: four fit in 64
    for r in rs:
        p.add(r)
    plan = p.poll(0.0, free_workers=1, free_slots=1)
    assert len(plan.batches) == 1
    assert plan.batches[0].size == 4
    assert plan.batches[0].padded_tokens <= 64
    assert plan.batches[0].flush_reason is FlushReason.FULL


def test_a_request_longer_than_the_budget_still_runs_alone() -> None:
    p = policy(max_batch=8, max_tokens=16, bin_edges=())
    big = req(100)
    p.add(big)
    plan = p.poll(1.0, free_workers=1, free_slots=1)
    assert [b.requests for b in plan.batches] == [(big,)]
    # With max_batch 1 it is a full batch: it leaves for a free slot with no worker idle.
    p = policy(max_batch=1, max_tokens=16, bin_edges=())
    p.add(big)
    plan = p.poll(1.0, free_workers=0, free_slots=1)
    assert [(b.requests, b.flush_reason) for b in plan.batches] == [((big,), FlushReason.FULL)]


def test_a_bin_under_max_batch_is_cut_at_the_token_budget_from_its_oldest_request() -> None:
    # Four fit by count (max_batch 8) but not by tokens: 4 x 32 padded > 64. The oldest leaves with
    # the nearest widths that fit, 3 x 16 = 48; the wide one waits for the next batch.
    p = policy(max_batch=8, max_tokens=64, bin_edges=())
    rs = [req(16, at=0.0), req(32, at=0.1), req(16, at=0.2), req(16, at=0.3)]
    for r in rs:
        p.add(r)
    plan = p.poll(1.0, free_workers=1, free_slots=1)
    assert [b.requests for b in plan.batches] == [(rs[0], rs[2], rs[3])]
    assert plan.batches[0].flush_reason is FlushReason.FULL
    # Exactly at the budget the whole bin is one batch, in arrival order, still partial by count.
    p = policy(max_batch=8, max_tokens=64, max_wait_s=0.0, bin_edges=())
    rs = [req(16, at=0.0), req(9, at=0.1), req(3, at=0.2), req(16, at=0.3)]
    for r in rs:
        p.add(r)
    plan = p.poll(1.0, free_workers=1, free_slots=1)
    assert [b.requests for b in plan.batches] == [tuple(rs)]
    assert plan.batches[0].flush_reason is FlushReason.WAIT


def test_the_wait_is_a_share_of_the_whole_partial_batch_predicted_run_time() -> None:
    p = policy(max_batch=32, max_wait_s=1.0, wait_factor=0.3, bin_edges=())
    p.add(req(8, at=10.0))
    first = p.poll(10.0, free_workers=1, free_slots=1).wake_at_s
    assert first == pytest.approx(10.0 + 0.3 * (0.01 + 8 * 1e-4))
    p.add(req(20, at=10.0))  # the batch is now 2 x 24 padded tokens: a longer predicted run
    plan = p.poll(10.0, free_workers=1, free_slots=1)
    assert plan.batches == []
    assert plan.wake_at_s == pytest.approx(10.0 + 0.3 * (0.01 + 2 * 24 * 1e-4))
    # A batch report that changes the fit changes the next poll's prediction at once.
    fresh = LatencyModel(prior_base_s=0.01, prior_per_token_s=1e-4)
    for model in (p.latency, fresh):
        model.observe("m", 100, 0.5)
        model.observe("m", 200, 1.0)
    base, slope = fresh.coefficients("m")
    assert slope == pytest.approx(0.005)
    assert p.poll(10.0, free_workers=1, free_slots=1).wake_at_s == pytest.approx(
        10.0 + min(1.0, 0.3 * (base + slope * 48))
    )


def test_partial_batch_waits_its_adaptive_share_then_leaves_when_a_worker_is_free() -> None:
    p = policy(max_batch=32, max_wait_s=1.0, wait_factor=0.3, bin_edges=())
    r = req(8, at=10.0)
    p.add(r)
    # predicted run time of the batch: 0.01 + 8 * 1e-4 = 0.0108 s -> wait 0.3 * that
    wait = 0.3 * (0.01 + 8 * 1e-4)
    plan = p.poll(10.0, free_workers=1, free_slots=1)
    assert plan.batches == []
    assert plan.wake_at_s == pytest.approx(10.0 + wait)
    plan = p.poll(10.0 + wait, free_workers=1, free_slots=1)
    assert [b.requests for b in plan.batches] == [(r,)]
    assert plan.batches[0].flush_reason is FlushReason.WAIT


def test_partial_batches_ready_while_a_worker_is_idle_leave_together_as_far_as_the_slots_go() -> None:
    # The tail of a burst: a partial batch in each of three bins, all past their wait.
    def tails() -> tuple[BatchPolicy, list[Request]]:
        p = policy(max_batch=32, max_wait_s=0.01, bin_edges=(16, 64))
        reqs = [req(8, at=0.0), req(40, at=0.0), req(100, at=0.0)]
        for r in reqs:
            p.add(r)
        return p, reqs

    p, reqs = tails()
    plan = p.poll(1.0, free_workers=1, free_slots=3)
    assert {b.requests for b in plan.batches} == {(r,) for r in reqs}
    assert {b.flush_reason for b in plan.batches} == {FlushReason.WAIT}
    p, _ = tails()
    assert len(p.poll(1.0, free_workers=1, free_slots=2).batches) == 2, "never past the free slots"
    p, _ = tails()
    assert p.poll(1.0, free_workers=0, free_slots=3).batches == [], "no worker idle: they keep filling"
    # With requests on their way in, company may come: one partial batch per idle worker, as before.
    p, _ = tails()
    assert len(p.poll(1.0, free_workers=1, free_slots=3, incoming=True).batches) == 1


def test_max_wait_caps_the_adaptive_wait() -> None:
    p = policy(max_batch=32, max_wait_s=0.001, wait_factor=10.0, bin_edges=())
    p.add(req(8, at=0.0))
    assert p.poll(0.0005, free_workers=1, free_slots=1).batches == []
    assert len(p.poll(0.001, free_workers=1, free_slots=1).batches) == 1


def test_partial_batch_keeps_filling_while_every_worker_is_busy() -> None:
    p = policy(max_batch=4, max_wait_s=0.01, bin_edges=())
    p.add(req(8, at=0.0, deadline=100.0))
    plan = p.poll(5.0, free_workers=0, free_slots=1)
    assert plan.batches == []
    for _ in range(3):
        p.add(req(8, at=5.0))
    plan = p.poll(5.0, free_workers=0, free_slots=1)
    assert len(plan.batches) == 1 and plan.batches[0].size == 4


def test_under_overload_a_partial_batch_takes_a_slot_in_place_of_a_full_one_it_outranks() -> None:
    """No worker is ever idle under overload, and full batches of a busy bin would take every freed
    slot: a partial batch that waited its window competes with them by priority, then age."""
    p = policy(max_batch=4, max_wait_s=0.01, bin_edges=(16,))
    for i in range(40):  # a backlog of short texts, the oldest from t=1
        p.add(req(8, at=1.0 + i * 0.001))
    lone_urgent = req(100, at=2.0, priority=9)
    p.add(lone_urgent)
    plan = p.poll(2.5, free_workers=0, free_slots=1)
    assert [b.requests for b in plan.batches] == [(lone_urgent,)]
    assert plan.batches[0].flush_reason is FlushReason.WAIT
    # Same priority: the oldest request goes first, whichever bin holds it.
    lone = req(100, at=2.0)
    p.add(lone)
    for i in range(8):  # and the backlog goes on growing
        p.add(req(8, at=2.6 + i * 0.001))
    order = []
    while batches := p.poll(3.0, free_workers=0, free_slots=1).batches:
        order.append(batches[0].requests)
    assert order.index((lone,)) == 10, "after the 40 short texts sent before it, before the 8 after"
    assert all(len(batch) == 4 for batch in order if batch != (lone,))
    # Nothing to take a slot from: a partial batch keeps filling while every worker is busy.
    q = policy(max_batch=4, max_wait_s=0.01, bin_edges=(16,))
    q.add(req(100, at=0.0, priority=9))
    assert q.poll(5.0, free_workers=0, free_slots=1).batches == []
    # Nor before its window: a partial batch that just started waiting does not cut in.
    fresh = policy(max_batch=4, max_wait_s=1.0, wait_factor=100.0, bin_edges=(16,))
    for _ in range(8):
        fresh.add(req(8, at=4.9))  # company keeps coming: the adaptive wait is not cut short
    young = req(100, at=5.0, priority=9)
    fresh.add(young)
    assert [b.requests[0].length for b in fresh.poll(5.1, free_workers=0, free_slots=1).batches] == [8]


@pytest.mark.parametrize(
    "capacity",
    [
        {"free_workers": 1, "free_slots": 1},  # CARPOOL_PREFETCH_BATCHES=0: each freed slot an idle worker
        {"free_workers": 0, "free_slots": 0, "queue_room": 4, "ahead_s": 0.001},  # a fast device's room
    ],
    ids=["idle-worker", "queue-room"],
)
def test_a_ready_partial_batch_outranks_a_full_one_however_the_slot_came_free(
    capacity: dict[str, Any],
) -> None:
    """Once starving: a slot that is an idle worker, or the room beyond the slots, is what a burst's
    full batches fill, and partial batches taking them at once cut a burst into smaller batches."""
    from carpool.batching.policy import STARVING_AFTER_S

    p = observed(policy(max_batch=4, max_wait_s=0.01, bin_edges=(16,), prefetch_s=0.03))
    for i in range(40):  # more full batches than either poll lets leave
        p.add(req(8, at=1.0 + i * 0.001))
    urgent = req(100, at=2.0, priority=9)
    p.add(urgent)
    first = p.poll(2.0 + STARVING_AFTER_S / 2, **capacity).batches[0]
    assert first.flush_reason is FlushReason.FULL and urgent not in first.requests
    assert [b.requests for b in p.poll(2.0 + STARVING_AFTER_S, **capacity).batches][:1] == [(urgent,)]
    q = observed(policy(max_batch=4, max_wait_s=0.01, bin_edges=(16,), prefetch_s=0.03))
    for i in range(8):
        q.add(req(8, at=1.0 + i * 0.001))
    young = req(100, at=2.5)  # same priority, younger than the full batches: they go first
    q.add(young)
    first = q.poll(2.6, **capacity).batches[0]
    assert first.flush_reason is FlushReason.FULL and young not in first.requests


def test_batches_dispatched_in_one_poll_add_their_work_per_worker_to_the_work_ahead() -> None:
    """``ahead_s`` is the work queued per worker: a batch a poll puts behind busy workers adds its
    run time over all of them, so a second urgent bin is not judged hopeless in the same poll."""

    def two_urgent_bins() -> tuple[BatchPolicy, list[Request], Request]:
        p = policy(max_batch=32, max_wait_s=10.0, bin_edges=(192,))
        # Ten of 190 tokens (1,920 padded: 0.202 s predicted), due first; one of 300 (0.0404 s).
        a = [req(190, at=9.9, deadline=10.0 + 0.1 + 0.202 + 0.001) for _ in range(10)]
        b = req(300, at=9.9, deadline=10.0 + 0.1 + 0.0404 + 0.005)
        for r in [*a, b]:
            p.add(r)
        return p, a, b

    p, a, b = two_urgent_bins()
    plan = p.poll(10.0, free_workers=0, free_slots=0, ahead_s=0.1, workers=8)
    assert [x.requests for x in plan.batches] == [tuple(a), (b,)]
    assert all(x.flush_reason is FlushReason.DEADLINE for x in plan.batches)
    # One worker: the first batch's whole run time is ahead of the second, which cannot make it.
    p, a, b = two_urgent_bins()
    plan = p.poll(10.0, free_workers=0, free_slots=0, ahead_s=0.1, workers=1)
    assert [x.requests for x in plan.batches] == [tuple(a)]


def test_shortest_first_reads_past_any_number_of_revoked_requests() -> None:
    p = policy(kind="shortest", max_batch=32)
    p.add(req(1))
    revoked = [req(2) for _ in range(10)]
    for r in revoked:
        p.add(r)
    for _ in range(40):
        p.add(req(3))
    p.discard({r.id for r in revoked})
    plan = p.poll(1.0, free_workers=0, free_slots=2, ahead_s=0.01)
    assert [(b.size, b.flush_reason) for b in plan.batches] == [(32, FlushReason.FULL)]
    assert [r.length for r in plan.batches[0].requests] == [1] + [3] * 31


def test_full_batches_queue_past_the_slots_while_the_work_ahead_is_short_of_prefetch_s() -> None:
    # Each full batch of 4 x 8 tokens is predicted at 10 ms + 32 x 0.1 ms = 13.2 ms.
    p = policy(max_batch=4, bin_edges=(), prefetch_s=0.03)
    for _ in range(40):
        p.add(req(8))
    # Until a batch of its key has run, its prior's predictions are not trusted with the room: the
    # policy review saw a cold coordinator commit a whole backlog, and a request with expires=
    # that a warm one answered in time answered REVOKED 3 s late.
    assert p.poll(0.0, free_workers=0, free_slots=0, ahead_s=0.005, queue_room=16).batches == []
    assert p.quiet_until(0.0, free_slots=0, ahead_s=0.005, queue_room=16) is not None
    observed(p)
    assert p.quiet_until(0.0, free_slots=0, ahead_s=0.005, queue_room=16) is None
    # No slot free and 5 ms queued per worker: batches leave until the work ahead reaches 30 ms.
    plan = p.poll(0.0, free_workers=0, free_slots=0, ahead_s=0.005, queue_room=16)
    assert len(plan.batches) == 2  # 5 -> 18.2 -> 31.4 ms ahead
    assert all(b.flush_reason is FlushReason.FULL and b.size == 4 for b in plan.batches)
    assert p.poll(0.0, free_workers=0, free_slots=0, ahead_s=0.03, queue_room=16).batches == []
    # ...never past the room left for queued batches
    assert len(p.poll(0.0, free_workers=0, free_slots=0, ahead_s=0.0, queue_room=1).batches) == 1
    # ...and only full ones: a partial batch still waits for an idle worker
    q = observed(policy(max_batch=4, bin_edges=(), prefetch_s=0.03))
    q.add(req(8))
    assert q.poll(5.0, free_workers=0, free_slots=0, ahead_s=0.0, queue_room=16).batches == []
    # With prefetch_s 0 (the default of the pure policy) the slots alone decide, as before.
    r = policy(max_batch=4, bin_edges=())
    for _ in range(8):
        r.add(req(8))
    assert r.poll(0.0, free_workers=0, free_slots=0, ahead_s=0.0, queue_room=16).batches == []


def test_the_pool_leaves_room_for_queued_batches_up_to_a_bound_per_worker() -> None:
    from carpool.batching.capacity import MAX_QUEUED_PER_WORKER, pool_capacity

    cap = pool_capacity(2, 2, [0.01] * 7)
    assert (cap.free_slots, cap.queue_room) == (0, 2 * MAX_QUEUED_PER_WORKER - 7)
    assert pool_capacity(1, 2, [0.0] * 40).queue_room == 0


def test_deadline_flush_happens_before_the_deadline_even_with_workers_busy() -> None:
    p = policy(max_batch=32, max_wait_s=10.0, bin_edges=())
    r = req(8, at=0.0, deadline=1.0)
    p.add(r)
    predicted = 0.01 + 8 * 1e-4
    plan = p.poll(0.5, free_workers=0, free_slots=0)
    assert plan.batches == []
    assert plan.wake_at_s is not None and plan.wake_at_s < 1.0 - predicted
    plan = p.poll(plan.wake_at_s, free_workers=0, free_slots=0)
    assert [b.requests for b in plan.batches] == [(r,)]
    assert plan.batches[0].flush_reason is FlushReason.DEADLINE


def test_deadline_accounts_for_work_already_ahead() -> None:
    p = policy(max_batch=32, max_wait_s=10.0, bin_edges=())
    p.add(req(8, at=0.0, deadline=1.0))
    # Without work ahead it could wait; with 0.9 s ahead it must leave now, at t=0.08, far before 1.0.
    assert p.poll(0.08, free_workers=0, free_slots=0, ahead_s=0.0).batches == []
    assert len(p.poll(0.08, free_workers=0, free_slots=0, ahead_s=0.9).batches) == 1


def test_a_batch_that_cannot_make_its_deadline_is_not_forced_into_a_busy_pool() -> None:
    p = policy(max_batch=32, max_wait_s=10.0, bin_edges=())
    r = req(8, at=0.0, deadline=1.0)
    p.add(r)
    # 2 s of work ahead: hopeless. No slot: it stays, then expires and fails fast.
    assert p.poll(0.5, free_workers=0, free_slots=0, ahead_s=2.0).batches == []
    assert p.poll(1.0, free_workers=0, free_slots=0, ahead_s=2.0).expired == [r]


def test_expired_requests_are_never_dispatched() -> None:
    p = policy(max_batch=2, bin_edges=())
    late = req(8, at=0.0, deadline=1.0)
    fine = req(8, at=0.0, deadline=50.0)
    p.add(late)
    p.add(fine)
    plan = p.poll(2.0, free_workers=0, free_slots=0)
    assert plan.expired == [late]
    assert all(late not in b.requests for b in plan.batches)
    assert len(p) == 1


def test_higher_priority_first_within_a_bin() -> None:
    p = policy(max_batch=2, bin_edges=())
    low = [req(8, at=0.0, priority=0) for _ in range(2)]
    high = [req(8, at=1.0, priority=9) for _ in range(2)]
    for r in (*low, *high):
        p.add(r)
    plan = p.poll(1.0, free_workers=1, free_slots=1)
    assert set(plan.batches[0].requests) == set(high)


def test_models_never_share_a_batch() -> None:
    p = policy(max_batch=4, bin_edges=())
    a = [req(8, model="a") for _ in range(2)]
    b = [req(8, model="b") for _ in range(2)]
    for r in (*a, *b):
        p.add(r)
    plan = p.poll(10.0, free_workers=2, free_slots=2)
    assert plan.batches and all({r.model for r in batch.requests} == {batch.model} for batch in plan.batches)
    assert {frozenset(batch.requests) for batch in plan.batches} == {frozenset(a), frozenset(b)}


def test_shortest_first_serves_short_requests_first() -> None:
    p = policy(kind="shortest", max_batch=2)
    rs = [req(100, at=0.0), req(10, at=0.1), req(50, at=0.2), req(5, at=0.3)]
    for r in rs:
        p.add(r)
    plan = p.poll(1.0, free_workers=1, free_slots=1)
    assert [r.length for r in plan.batches[0].requests] == [5, 10]


def test_drain_hands_everything_back() -> None:
    p = policy()
    rs = [req(n) for n in (3, 30, 300)]
    for r in rs:
        p.add(r)
    assert set(p.drain()) == set(rs)
    assert len(p) == 0


# --- properties -----------------------------------------------------------------------------

arrival = st.tuples(
    st.floats(0, 5, allow_nan=False),  # arrival
    st.integers(1, 300),  # length
    st.floats(0.01, 3, allow_nan=False),  # time to deadline
    st.integers(0, 9),  # priority
    st.sampled_from(["a", "b"]),  # model
)


def simulated(
    cfg: PolicyConfig, arrivals: list[tuple[float, int, float, int, str]]
) -> tuple[BatchPolicy, LatencyModel, list[Request]]:
    """A policy under ``cfg`` with a latency prior of its own, and ``arrivals`` (arrival, length,
    time to deadline, priority, model) as requests in arrival order, to add as the clock reaches them."""
    latency = LatencyModel(prior_base_s=0.005, prior_per_token_s=1e-5)
    pending = sorted(
        (req(n, at=t, deadline=t + d, priority=pr, model=m) for t, n, d, pr, m in arrivals),
        key=lambda r: r.arrival_s,
    )
    return BatchPolicy(cfg, latency), latency, pending


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=80),
    kind=st.sampled_from(["binned", "fifo", "shortest"]),
    max_batch=st.integers(1, 16),
    max_tokens=st.integers(8, 2048),
    workers=st.integers(1, 3),
    step=st.floats(0.001, 0.2),
    tight=st.booleans(),
    prefetch_s=st.sampled_from([0.0, 0.02, 1.0]),
)
def test_simulated_runs_keep_every_invariant(
    arrivals: list[tuple[float, int, float, int, str]],
    kind: PolicyName,
    max_batch: int,
    max_tokens: int,
    workers: int,
    step: float,
    tight: bool,
    prefetch_s: float,
) -> None:
    """Drive the policy with a fake clock and a fake pool of workers; check the invariants."""
    cfg = PolicyConfig(
        kind=kind,
        max_batch=max_batch,
        max_tokens=max_tokens,
        max_wait_s=0.05,
        bin_edges=(16, 64),
        tight_backlog=tight,
        prefetch_s=prefetch_s,
    )
    p, latency, pending = simulated(cfg, arrivals)
    all_ids = {r.id for r in pending}
    emitted: list[str] = []
    expired: list[str] = []
    busy_until = [0.0] * workers
    now = 0.0
    while pending or len(p):
        while pending and pending[0].arrival_s <= now:
            p.add(pending.pop(0))
        free = sum(1 for b in busy_until if b <= now)
        ahead = sum(max(0.0, b - now) for b in busy_until) / workers
        plan = p.poll(now, free_workers=free, free_slots=free, ahead_s=ahead, queue_room=4 * workers)
        for r in plan.expired:
            assert r.deadline_s <= now  # only what really expired
            expired.append(r.id)
        for batch in plan.batches:
            assert 1 <= batch.size <= max_batch
            assert batch.size == 1 or batch.padded_tokens <= max_tokens
            assert batch.padded_len == padded_length(max(r.length for r in batch.requests))
            assert len({r.model for r in batch.requests}) == 1
            if kind == "binned":
                assert len({p.bins_for(r.model).label_for(r.length) for r in batch.requests}) == 1
            for r in batch.requests:
                assert r.deadline_s > now  # expired requests never dispatched
            emitted.extend(r.id for r in batch.requests)
            i = min(range(workers), key=lambda k: busy_until[k])
            busy_until[i] = max(busy_until[i], now) + latency.predict(batch.model, batch.padded_tokens)
        now += step
    # each request exactly once: in one batch or expired
    assert len(emitted) == len(set(emitted))
    assert set(emitted) | set(expired) == all_ids
    assert not set(emitted) & set(expired)


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=60),
    kind=st.sampled_from(["binned", "fifo", "shortest"]),
    max_batch=st.integers(1, 16),
    max_tokens=st.integers(8, 2048),
    tight=st.booleans(),
    prefetch_s=st.sampled_from([0.0, 0.02, 1.0]),
    pad_multiple=st.sampled_from([1, 8, 16]),
    data=st.data(),
)
def test_quiet_until_is_said_only_when_a_poll_would_let_nothing_leave(
    arrivals: list[tuple[float, int, float, int, str]],
    kind: PolicyName,
    max_batch: int,
    max_tokens: int,
    tight: bool,
    prefetch_s: float,
    pad_multiple: int,
    data: st.DataObject,
) -> None:
    """Whenever quiet_until answers a time, a poll with the same capacities (on a copy) dispatches
    nothing, expires nothing and wakes no earlier than that time; the policy's own polls go on."""
    cfg = PolicyConfig(
        kind=kind,
        max_batch=max_batch,
        max_tokens=max(max_tokens, pad_multiple),
        bin_edges=(16, 64),
        tight_backlog=tight,
        prefetch_s=prefetch_s,
        pad_multiple=pad_multiple,
    )
    p, latency, pending = simulated(cfg, arrivals)
    now = 0.0
    for _ in range(60):  # polls: a bounded number of draws, well inside hypothesis's data budget
        if not (pending or len(p)):
            break
        while pending and pending[0].arrival_s <= now:
            p.add(pending.pop(0))
        free_slots = data.draw(st.sampled_from([0, 0, 0, 1, 2]))
        queue_room = data.draw(st.sampled_from([0, 0, 3]))
        ahead_s = data.draw(st.floats(0, 0.5))
        quiet = p.quiet_until(now, free_slots, ahead_s, queue_room)
        if quiet is not None:
            plan = copy.deepcopy(p).poll(now, 0, free_slots, ahead_s, queue_room)
            assert plan.batches == [] and plan.expired == []
            assert plan.wake_at_s is not None and quiet <= plan.wake_at_s
        p.poll(now, min(free_slots, 1), free_slots, ahead_s, queue_room)
        if data.draw(st.booleans()):
            latency.observe(arrivals[0][4], data.draw(st.integers(8, 4096)), data.draw(st.floats(0.0, 0.05)))
        now += data.draw(st.floats(0.01, 0.3))


def test_a_deep_queue_with_every_slot_taken_is_quiet_until_its_deadline_nears() -> None:
    p = observed(policy(max_batch=4, bin_edges=(16, 64), prefetch_s=0.02))
    for i in range(40):
        p.add(req(8 + i % 50, at=0.0, deadline=60.0))
    quiet = p.quiet_until(1.0, free_slots=0, ahead_s=0.05)
    assert quiet is not None and 59.0 < quiet < 60.0
    assert p.quiet_until(1.0, free_slots=1, ahead_s=0.05) is None  # a slot: a batch leaves
    assert p.quiet_until(1.0, free_slots=0, ahead_s=0.01, queue_room=2) is None  # room under prefetch_s
    assert p.quiet_until(59.99, free_slots=0, ahead_s=0.05) is None  # a deadline flush may be due
    assert p.poll(1.0, 0, 0, 0.05).batches == []


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 256), min_size=1, max_size=60))
def test_an_idle_worker_never_sees_a_request_wait_past_its_deadline(lengths: list[int]) -> None:
    """With a worker free and polled as the policy asks, nothing expires that could have run."""
    p = BatchPolicy(PolicyConfig(max_batch=8, max_wait_s=0.5), LatencyModel(0.001, 1e-5))
    for n in lengths:
        p.add(req(n, at=0.0, deadline=0.2))
    now = 0.0
    for _ in range(1000):
        plan = p.poll(now, free_workers=1, free_slots=1)
        assert plan.expired == []
        if not len(p):
            break
        now = plan.wake_at_s if plan.wake_at_s is not None else now + 0.001
    assert len(p) == 0


def test_auto_bins_follow_the_length_mix() -> None:
    from carpool.batching import AutoBins

    bins = AutoBins(count=4, window=400, refit_every=100)
    for n in [10, 20, 30, 40] * 100:  # short traffic
        bins.observe(n)
    short_edges = bins.edges
    assert short_edges and max(short_edges) <= 40
    assert all(e % 8 == 0 for e in short_edges)
    for n in [100, 150, 200, 250] * 100:  # the mix shifts long
        bins.observe(n)
    assert min(bins.edges) > 40
    assert bins.label_for(250).endswith("+") or bins.index(250) == len(bins.edges)


def test_auto_binned_policy_keeps_every_request() -> None:
    p = policy(max_batch=8, auto_bins=3)
    rs = [req(n, at=0.0) for n in [5, 9, 60, 70, 200, 210] * 60]
    for r in rs:
        p.add(r)
    seen: list[Request] = []
    for _ in range(200):
        plan = p.poll(10.0, free_workers=4, free_slots=4)
        seen.extend(r for b in plan.batches for r in b.requests)
        if not len(p):
            break
    assert sorted(r.id for r in seen) == sorted(r.id for r in rs)


def test_auto_bins_are_labelled_by_index_so_refits_add_no_labels() -> None:
    """Every refit moves the spans; labels named after them would add metric series and gauge fields
    without end (a drifting length mix made 60 labels in 9000 requests). Fixed edges keep theirs."""
    p = policy(max_batch=16, auto_bins=4, bin_edges=(16, 32, 64))
    labels: set[str] = set()
    for phase in range(30):  # the length mix drifts longer, refitting every 256 requests
        low = 10 + 37 * phase
        for k in range(300):
            p.add(req(low + (k * 7) % 61, at=float(phase)))
        labels |= {label for _, label in p.depth_by_bin()}
        while len(p):
            labels |= {b.bin_label for b in p.poll(float(phase) + 10, free_workers=64, free_slots=64).batches}
    assert labels <= {"b0", "b1", "b2", "b3"}, sorted(labels)
    spans = p.bin_spans()
    assert sorted(label for _, label in spans) == sorted(p.bins_for("m").spans())
    assert spans[("m", "b0")].startswith("1-") and next(iter(reversed(spans.values()))).endswith("+")
    assert policy(bin_edges=(16, 64)).bins_for("m").spans() == {
        "1-16": "1-16",
        "17-64": "17-64",
        "65+": "65+",
    }


def test_a_queue_under_old_edges_drains_apart_from_the_new_bin_of_its_label() -> None:
    p = policy(max_batch=8, auto_bins=2, bin_edges=(16,))
    before = [req(20), req(30)]  # 17+: b1
    for r in before:
        p.add(r)
    p.bins_for("m").edges = (8,)  # a refit: b1 now holds 9+
    after = [req(12)]
    p.add(after[0])
    assert p.depth_by_bin() == {("m", "b1"): 3}
    assert p.bin_spans() == {("m", "b0"): "1-8", ("m", "b1"): "9+"}
    plan = p.poll(10.0, free_workers=4, free_slots=4)
    assert sorted(sorted(r.length for r in b.requests) for b in plan.batches) == [[12], [20, 30]]
    assert {b.bin_label for b in plan.batches} == {"b1"}
    assert len(p) == 0


def test_light_traffic_dispatches_at_once_when_a_worker_is_idle() -> None:
    p = policy(max_batch=32, max_wait_s=1.0, wait_factor=10.0, bin_edges=())
    # The very first request knows no rate yet: it waits its share.
    p.add(req(8, at=0.0))
    assert p.poll(0.0, free_workers=1, free_slots=1).batches == []
    assert len(p.poll(0.2, free_workers=1, free_slots=1).batches) == 1
    # Then one request a second: nothing would join a batch within the wait, so no waiting.
    for t in range(1, 10):
        p.add(req(8, at=float(t)))
        plan = p.poll(float(t), free_workers=1, free_slots=1)
        assert [b.size for b in plan.batches] == [1]
        assert plan.batches[0].flush_reason is FlushReason.WAIT
    # a burst: company is coming, so the partial batch waits its share
    for _ in range(3):
        p.add(req(8, at=10.0))
    assert p.poll(10.0, free_workers=1, free_slots=1).batches == []


def test_each_key_batches_under_its_own_limits_and_bins_and_keys_never_mix() -> None:
    latency = LatencyModel(prior_base_s=0.01, prior_per_token_s=1e-4)
    p = BatchPolicy(
        PolicyConfig(max_batch=4, bin_edges=(16, 64)),
        latency,
        per_key={"rerank": PolicyConfig(max_batch=2, bin_edges=(8,))},
    )
    embeds = [req(10, model="embed") for _ in range(4)]
    reranks = [req(5, model="rerank") for _ in range(2)] + [req(30, model="rerank")]
    for r in (*embeds, *reranks):
        p.add(r)
    plan = p.poll(0.0, free_workers=4, free_slots=4)
    by_key = {(b.model, b.bin_label): b for b in plan.batches}
    assert set(by_key[("embed", "1-16")].requests) == set(embeds)  # the default max_batch 4
    assert set(by_key[("rerank", "1-8")].requests) == set(reranks[:2])  # its own max_batch 2, bin 1-8
    assert by_key[("rerank", "1-8")].padded_len == 8
    assert p.bins_for("rerank").label_for(30) == "9+"
    assert all(len({r.model for r in b.requests}) == 1 for b in plan.batches)


# --- a deep queue: tight batches --------------------------------------------------------------


def drain_burst(p: BatchPolicy, reqs: list[Request]) -> list[Batch]:
    """Every request at t=0 into a pool that takes one batch per poll; the batches, in order."""
    for r in reqs:
        p.add(r)
    batches: list[Batch] = []
    now = 0.0
    while len(p):
        plan = p.poll(now, free_workers=1, free_slots=1)
        assert not plan.expired
        batches += plan.batches
        now = plan.wake_at_s if not plan.batches and plan.wake_at_s is not None else now + 0.001
    return batches


def sorted_pass_padded(lengths: list[int], max_batch: int) -> int:
    ordered = sorted(lengths)
    chunks = [ordered[i : i + max_batch] for i in range(0, len(ordered), max_batch)]
    return sum(padded_length(c[-1]) * len(c) for c in chunks)


def test_a_deep_bin_cuts_its_oldest_request_with_the_nearest_widths() -> None:
    p = policy(max_batch=4, bin_edges=())
    rs = [req(n, at=i * 0.001) for i, n in enumerate([30, 100, 7, 101, 20, 6, 98, 27, 5])]
    batches = drain_burst(p, rs)
    # The oldest (30, width 32) goes with its own width, then the widest narrower ones (24, then 8);
    # the next batch starts from the next oldest, 100. Arrival order would pad the first to 104.
    lengths = [sorted(r.length for r in b.requests) for b in batches]
    assert lengths == [[7, 20, 27, 30], [6, 98, 100, 101], [5]]
    assert [b.padded_len for b in batches] == [32, 104, 8]
    assert all(b.flush_reason is FlushReason.FULL for b in batches[:2])


def test_a_bin_that_fits_one_batch_decides_as_in_arrival_order() -> None:
    """Light load: the tight cut never runs, so the plans are the same with it on or off."""
    plans = []
    for tight in (True, False):
        p = policy(max_batch=8, bin_edges=(64,), tight_backlog=tight)
        rs = [req(n, i * 0.01, deadline=0.5 + i, priority=i % 2) for i, n in enumerate([5, 60, 30, 3, 120])]
        for r in rs:
            p.add(r)
        plan = p.poll(0.06, free_workers=1, free_slots=2)
        plans.append([(b.bin_label, [rs.index(r) for r in b.requests], b.flush_reason) for b in plan.batches])
    assert plans[0] == plans[1] and plans[0]


def test_arrival_order_is_kept_when_tight_backlog_is_off() -> None:
    p = policy(max_batch=2, bin_edges=(), tight_backlog=False)
    rs = [req(n, at=i * 0.001) for i, n in enumerate([8, 200, 8, 200])]
    assert [b.requests for b in drain_burst(p, rs)] == [tuple(rs[:2]), tuple(rs[2:])]


def test_a_long_request_is_not_starved_by_a_stream_of_short_ones() -> None:
    """Overload: every poll finds the bin deep with fresh short requests; the long one still leaves
    once it is the oldest, and a long request alone in its own bin leaves by its deadline."""
    p = policy(max_batch=4, bin_edges=(128,), max_wait_s=0.01)
    for i in range(10):
        p.add(req(8, at=i * 0.001))
    long_same_bin = req(120, at=0.02)
    long_own_bin = req(250, at=0.02, deadline=2.0)
    p.add(long_same_bin)
    p.add(long_own_bin)
    left_at: dict[str, int] = {}
    for step in range(100):
        now = 0.03 + step * 0.03
        for _ in range(4):
            p.add(req(8, at=now))
        plan = p.poll(now, free_workers=0, free_slots=1, ahead_s=0.02)
        assert not plan.expired
        for b in plan.batches:
            left_at.update((r.id, step) for r in b.requests)
    # Ten older shorts, four per batch: the long one is the oldest by the fourth batch of its bin.
    assert left_at[long_same_bin.id] <= 3
    assert long_own_bin.id in left_at


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 256), st.integers(0, 3)), min_size=2, max_size=60),
    urgent_length=st.integers(1, 256),
    max_batch=st.integers(1, 8),
    tight=st.booleans(),
)
def test_an_urgent_request_leaves_first_from_a_deep_bin(
    lengths: list[tuple[int, int]], urgent_length: int, max_batch: int, tight: bool
) -> None:
    """With no slot free only a deadline flush may leave, and it takes the urgent request along,
    whatever its length or the priorities of the requests waiting with it."""
    p = policy(max_batch=max_batch, bin_edges=(), max_wait_s=10.0, tight_backlog=tight)
    for i, (n, prio) in enumerate(lengths):
        p.add(req(n, at=i * 0.001, deadline=100.0, priority=prio))
    urgent = req(urgent_length, at=0.5, deadline=1.0)
    p.add(urgent)
    now = 0.5
    for _ in range(10):
        plan = p.poll(now, free_workers=0, free_slots=0)
        if plan.batches or plan.wake_at_s is None:
            break
        now = plan.wake_at_s
    assert now < 1.0 and len(plan.batches) == 1
    assert plan.batches[0].flush_reason is FlushReason.DEADLINE
    assert urgent in plan.batches[0].requests


def test_higher_priority_first_in_a_deep_bin() -> None:
    p = policy(max_batch=3, bin_edges=())
    shorts = [req(8, at=i * 0.001) for i in range(9)]
    vip = req(100, at=1.0, priority=5)
    batches = drain_burst(p, [*shorts, vip])
    assert vip in batches[0].requests


def test_each_key_keeps_its_own_tight_backlog_setting() -> None:
    p = BatchPolicy(
        PolicyConfig(max_batch=2, bin_edges=()),
        LatencyModel(prior_base_s=0.01, prior_per_token_s=1e-4),
        per_key={"old": PolicyConfig(max_batch=2, bin_edges=(), tight_backlog=False)},
    )
    for model in ("new", "old"):
        for i, n in enumerate([8, 200, 8, 200]):
            p.add(req(n, at=i * 0.001, model=model))
    plan = p.poll(0.0, free_workers=2, free_slots=2)
    widths = {b.model: b.padded_len for b in plan.batches}
    assert widths == {"new": 8, "old": 200}


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1500, 3000), seed=st.integers(0, 10_000), max_batch=st.sampled_from([16, 32]))
def test_a_deep_burst_pads_about_as_little_as_a_sorted_pass(n: int, seed: int, max_batch: int) -> None:
    """On the mixed workload a burst's batches pad within 5 % of length-sorted batches (arrival
    order within today's bins pads about 10 % more), and every request leaves exactly once."""
    from carpool.tools.simulate import workload_lengths

    lengths = workload_lengths(n, seed, model="toy")
    rs = [req(length) for length in lengths]
    batches = drain_burst(policy(max_batch=max_batch), rs)
    ids = [r.id for b in batches for r in b.requests]
    assert len(ids) == len(set(ids)) == n
    assert all(b.size <= max_batch and b.padded_tokens <= 8192 for b in batches)
    assert sum(b.padded_tokens for b in batches) <= 1.05 * sorted_pass_padded(lengths, max_batch)


@pytest.mark.parametrize(
    "config",
    [
        {"kind": "binned"},  # tight backlog order
        {"kind": "binned", "tight_backlog": False},  # arrival order
        {"kind": "fifo"},
        {"kind": "shortest"},  # length order
    ],
)
@pytest.mark.parametrize("backlog", [3, 40])  # all fit in one batch; more than a batch
def test_a_request_that_runs_alone_leaves_in_a_batch_of_its_own(config: dict[str, Any], backlog: int) -> None:
    """A worker died running it in a batch: it runs alone, so that the others are not failed for it
    if it kills the next worker too; the others batch as ever."""
    p = policy(max_batch=8, bin_edges=(64,), **config)
    reqs = [req(10 + i % 5) for i in range(backlog)]
    lone = reqs[backlog // 2]
    lone.alone = True
    for r in reqs:
        p.add(r)
    batches: list[Batch] = []
    for step in range(100):
        plan = p.poll(float(step), free_workers=4, free_slots=4)
        batches += plan.batches
        if not len(p):
            break
    assert sorted(r.id for b in batches for r in b.requests) == sorted(r.id for r in reqs)
    (own,) = [b for b in batches if lone in b.requests]
    assert own.requests == (lone,) and own.flush_reason is FlushReason.ALONE  # its worker runs it alone
    assert max(b.size for b in batches if b is not own) == min(backlog - 1, 8)
    assert all(b.flush_reason is not FlushReason.ALONE for b in batches if b is not own)


@pytest.mark.parametrize(
    "config",
    [{"kind": "shortest"}, {"kind": "binned"}, {"kind": "binned", "tight_backlog": False}, {"kind": "fifo"}],
)
def test_a_request_that_runs_alone_leaves_next_whatever_keeps_arriving(config: dict[str, Any]) -> None:
    """Shorter requests (shortest first) or ones of a higher priority arriving all the time do not
    keep it waiting until its deadline: it has waited once already, and leaves next, on its own; the
    batches of the others fill as ever, none cut short for it."""
    p = policy(max_batch=8, bin_edges=(64,), **config)
    lone = req(40, deadline=60.0)
    lone.alone = True
    p.add(lone)
    batches: list[Batch] = []
    now = 0.0
    for step in range(200):
        now = step * 0.004
        p.add(req(5, at=now, deadline=now + 60.0, priority=1))
        batches += p.poll(now, free_workers=1, free_slots=1).batches
    (own,) = [b for b in batches if lone in b.requests]
    assert own.requests == (lone,) and batches.index(own) == 0, "it left first"
    full = [b for b in batches if b.flush_reason is FlushReason.FULL]
    assert all(b.size == 8 for b in full), "no batch counted full for leaving it out"


def test_a_batch_that_passes_over_a_request_running_alone_is_not_counted_full_for_it() -> None:
    from carpool.batching.binqueue import BinQueue

    cfg = PolicyConfig(max_batch=8)
    queue = BinQueue("tight", cfg.pad_multiple)
    urgent, lone, other = req(10, deadline=1.0), req(10), req(12)
    lone.alone = True
    for r in (urgent, lone, other):
        queue.add(r)
    members, limited = queue.select(cfg, first=[urgent])  # a deadline flush puts its most urgent first
    assert members == [urgent, other] and not limited
    assert queue.select(cfg) == ([lone], True)  # otherwise it leaves next, on its own
