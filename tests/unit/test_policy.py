"""The pure batching policy under a fake clock: time is a number the test chooses."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.batching import BatchPolicy, FlushReason, LatencyModel, PolicyConfig, Request, padded_length
from carpool.names import PolicyName

_ids = itertools.count()


def req(
    length: int, at: float = 0.0, deadline: float = 100.0, priority: int = 0, model: str = "m"
) -> Request:
    return Request(
        id=f"r{next(_ids)}", model=model, length=length, arrival_s=at, deadline_s=deadline, priority=priority
    )


def policy(**kw: object) -> BatchPolicy:
    # A latency model with a fixed, known prediction: 10 ms + 0.1 ms per padded token.
    latency = LatencyModel(prior_base_s=0.01, prior_per_token_s=1e-4)
    return BatchPolicy(PolicyConfig(**kw), latency)  # type: ignore[arg-type]


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


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=80),
    kind=st.sampled_from(["binned", "fifo", "shortest"]),
    max_batch=st.integers(1, 16),
    max_tokens=st.integers(8, 2048),
    workers=st.integers(1, 3),
    step=st.floats(0.001, 0.2),
)
def test_simulated_runs_keep_every_invariant(
    arrivals: list[tuple[float, int, float, int, str]],
    kind: PolicyName,
    max_batch: int,
    max_tokens: int,
    workers: int,
    step: float,
) -> None:
    """Drive the policy with a fake clock and a fake pool of workers; check the invariants."""
    cfg = PolicyConfig(
        kind=kind,
        max_batch=max_batch,
        max_tokens=max_tokens,
        max_wait_s=0.05,
        bin_edges=(16, 64),
    )
    latency = LatencyModel(prior_base_s=0.005, prior_per_token_s=1e-5)
    p = BatchPolicy(cfg, latency)
    pending = sorted(
        (req(n, at=t, deadline=t + d, priority=pr, model=m) for t, n, d, pr, m in arrivals),
        key=lambda r: r.arrival_s,
    )
    all_ids = {r.id for r in pending}
    emitted: list[str] = []
    expired: list[str] = []
    busy_until = [0.0] * workers
    now = 0.0
    while pending or len(p):
        while pending and pending[0].arrival_s <= now:
            p.add(pending.pop(0))
        free = sum(1 for b in busy_until if b <= now)
        plan = p.poll(now, free_workers=free, free_slots=free)
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
