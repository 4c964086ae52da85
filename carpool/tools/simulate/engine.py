"""The simulated coordinator and worker pool: arrivals in, the real ``BatchPolicy`` in the middle.

Every event (an arrival, a batch report, the policy's own wake-up time) polls the coordinator's own
policy object with ``free_workers``, ``free_slots`` and ``ahead_s`` from the coordinator's capacity
rules (``carpool.batching.capacity``). Dispatched batches queue first-in first-out on a pool of
alike workers; each runs for the latency model's prediction (times seeded noise) plus a per-batch
overhead, and members already past their deadline when a worker starts the batch fail there, by the
rule the real worker applies. Reports go back to the policy's latency model, as the coordinator's
online fit does. No Redis, Celery, torch or wall clock.
"""

from __future__ import annotations

import copy
import heapq
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from carpool.batching import Batch, BatchPolicy, LatencyModel, PolicyConfig, Request, padded_length
from carpool.batching.capacity import may_start, pool_capacity
from carpool.batching.policy import PolicyKind
from carpool.names import POLICY_NAMES
from carpool.tools.simulate.trace import Arrival, offered_rate
from carpool.tools.stats import percentile

POLICIES: tuple[PolicyKind, ...] = POLICY_NAMES


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One simulated batch: what the coordinator dispatched and what the worker ran."""

    dispatched_s: float
    start_s: float
    end_s: float
    flush: str
    request_ids: tuple[str, ...]  # every member, as dispatched
    ran_ids: tuple[str, ...]  # members still within their deadline when the worker started
    padded_tokens: int  # as dispatched (what the coordinator counts)
    real_tokens: int


@dataclass(slots=True)
class SimResult:
    """What one policy did with one set of arrivals."""

    policy: str
    requests: int
    offered_rate: float
    completed: int = 0
    missed_in_queue: int = 0  # expired in the policy before any batch took them
    missed_at_worker: int = 0  # dispatched, but past the deadline when a worker started the batch
    late: int = 0  # completed after their deadline (the real worker still answers them)
    first_arrival_s: float = 0.0
    last_done_s: float = 0.0
    busy_s: float = 0.0  # summed worker busy time
    workers: int = 1
    latencies_s: list[float] = field(default_factory=list)
    padded_tokens: int = 0
    real_tokens: int = 0
    device_s: float = 0.0  # the latency model's time for the batches as dispatched, without noise or overhead
    flush: Counter[str] = field(default_factory=Counter)
    batches: list[BatchRecord] = field(default_factory=list)
    missed_ids: list[str] = field(default_factory=list)

    @property
    def missed(self) -> int:
        return self.missed_in_queue + self.missed_at_worker

    @property
    def makespan_s(self) -> float:
        return max(0.0, self.last_done_s - self.first_arrival_s)

    @property
    def throughput(self) -> float:
        """Completed requests per second, from the first arrival to the last completion."""
        span = self.makespan_s
        return self.completed / span if span > 0 else 0.0

    @property
    def padding_ratio(self) -> float:
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0

    @property
    def mean_batch_size(self) -> float:
        return sum(len(b.request_ids) for b in self.batches) / len(self.batches) if self.batches else 0.0

    @property
    def utilisation(self) -> float:
        span = self.makespan_s
        return self.busy_s / (self.workers * span) if span > 0 else 0.0

    def latency_percentile(self, q: float) -> float:
        return percentile(self.latencies_s, q)

    @property
    def p50_s(self) -> float:
        return self.latency_percentile(50)

    @property
    def p99_s(self) -> float:
        return self.latency_percentile(99)


@dataclass(order=True, slots=True)
class _Done:
    end_s: float
    seq: int
    padded_tokens: int = field(compare=False)
    run_s: float = field(compare=False)


@dataclass(slots=True)
class _Pool:
    """The simulated workers and how a batch runs on them (the truth the policy only predicts)."""

    truth: LatencyModel
    model: str
    overhead_s: float
    noise: float
    rng: random.Random
    pad_multiple: int
    free_at: list[float]  # min-heap of the times each worker frees up


def simulate(
    policy_config: PolicyConfig,
    latency: LatencyModel,
    arrivals: Sequence[Arrival],
    workers: int = 1,
    prefetch_batches: int = 1,
    *,
    model: str = "sim",
    default_deadline_s: float = 60.0,
    batch_overhead_s: float = 0.0,
    noise: float = 0.0,
    seed: int = 0,
    policy_latency: LatencyModel | None = None,
) -> SimResult:
    """Run ``arrivals`` through ``BatchPolicy(policy_config)`` and a pool of ``workers``.

    ``latency`` is the truth: a batch of P padded tokens runs for ``latency.predict(model, P)``
    seconds, times a lognormal factor of mean 1 and log-sd ``noise`` (seeded), plus
    ``batch_overhead_s`` for the pipeline around the model (hand-off, result writes) which, as in the
    real worker's reports, the coordinator's fit never sees. ``policy_latency`` is what the policy
    predicts with and keeps fitting from reports; by default a copy of the truth (a warmed-up
    coordinator). Neither argument is modified unless ``policy_latency`` is passed in.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if prefetch_batches < 0 or batch_overhead_s < 0 or noise < 0:
        raise ValueError("prefetch_batches, batch_overhead_s and noise must be >= 0")
    ordered = sorted(arrivals, key=lambda a: a.arrival_s)
    learner = policy_latency if policy_latency is not None else copy.deepcopy(latency)
    policy = BatchPolicy(policy_config, learner)
    result = SimResult(
        policy=policy_config.kind, requests=len(ordered), offered_rate=offered_rate(ordered), workers=workers
    )
    if not ordered:
        return result
    result.first_arrival_s = ordered[0].arrival_s
    requests = [
        Request(
            id=f"r{i}",
            model=model,
            length=a.length,
            arrival_s=a.arrival_s,
            priority=a.priority,
            deadline_s=a.arrival_s + (a.deadline_s if a.deadline_s is not None else default_deadline_s),
        )
        for i, a in enumerate(ordered)
    ]
    pool = _Pool(
        truth=latency,
        model=model,
        overhead_s=batch_overhead_s,
        noise=noise,
        rng=random.Random(f"noise:{seed}"),
        pad_multiple=policy_config.pad_multiple,
        free_at=[ordered[0].arrival_s] * workers,
    )
    done: list[_Done] = []  # reports still to reach the coordinator, by time
    outstanding: dict[int, float] = {}  # dispatched, unreported batches -> predicted seconds (as dispatched)

    seq = 0
    next_arrival = 0
    wake: float | None = None
    now = ordered[0].arrival_s
    # Each pass handles one event time; arrivals, reports and dispatches bound the count, so a
    # runaway loop means a bug in the policy's wake times, not a long simulation.
    for _ in range(20 * len(requests) + 100):
        times = [
            t
            for t in (
                requests[next_arrival].arrival_s if next_arrival < len(requests) else None,
                done[0].end_s if done else None,
                wake,
            )
            if t is not None
        ]
        if not times:
            break
        now = max(now, min(times))
        # Reports first, as the coordinator reads them before taking new requests.
        while done and done[0].end_s <= now:
            report = heapq.heappop(done)
            outstanding.pop(report.seq, None)
            if report.padded_tokens:
                learner.observe(model, report.padded_tokens, report.run_s)
        while next_arrival < len(requests) and requests[next_arrival].arrival_s <= now:
            policy.add(requests[next_arrival])
            next_arrival += 1
        cap = pool_capacity(workers, prefetch_batches, outstanding.values())
        plan = policy.poll(
            now, cap.free_workers, cap.free_slots, cap.ahead_s, cap.queue_room, workers=workers
        )
        wake = plan.wake_at_s
        for req in plan.expired:
            result.missed_in_queue += 1
            result.missed_ids.append(req.id)
        for batch in plan.batches:
            seq += 1
            outstanding[seq] = learner.predict(model, batch.padded_tokens)
            heapq.heappush(done, _run(batch, now, seq, pool, result))
    else:
        raise RuntimeError("simulation did not converge: the policy kept asking to be woken without progress")
    if len(policy):
        raise RuntimeError(f"simulation ended with {len(policy)} requests still queued")
    return result


def _run(batch: Batch, now: float, seq: int, pool: _Pool, result: SimResult) -> _Done:
    """Hand ``batch`` to the first worker to free up; record what it runs and when it finishes."""
    # Batches leave the coordinator in order and workers are alike, so the earliest-free worker takes
    # each one in turn: the start time is known at dispatch (an ideal shared Celery queue).
    start = max(now, heapq.heappop(pool.free_at))
    ran = [r for r in batch.requests if may_start(r.deadline_s, start)]
    run_s = 0.0
    padded_ran = 0
    if ran:
        padded_ran = padded_length(max(r.length for r in ran), pool.pad_multiple) * len(ran)
        run_s = pool.truth.predict(pool.model, padded_ran)
        if pool.noise:
            # Lognormal with mean 1: run times stay positive and the mean throughput is unbiased.
            run_s *= pool.rng.lognormvariate(-pool.noise * pool.noise / 2, pool.noise)
    end = start + run_s + pool.overhead_s
    heapq.heappush(pool.free_at, end)
    ran_ids = {r.id for r in ran}
    for r in batch.requests:
        if r.id not in ran_ids:
            result.missed_at_worker += 1
            result.missed_ids.append(r.id)
            continue
        result.completed += 1
        result.latencies_s.append(end - r.arrival_s)
        if end > r.deadline_s:
            result.late += 1
    result.last_done_s = max(result.last_done_s, end)
    result.busy_s += end - start
    result.padded_tokens += batch.padded_tokens
    result.real_tokens += batch.real_tokens
    result.device_s += pool.truth.predict(pool.model, batch.padded_tokens)
    result.flush[batch.flush_reason.value] += 1
    result.batches.append(
        BatchRecord(
            dispatched_s=now,
            start_s=start,
            end_s=end,
            flush=batch.flush_reason.value,
            request_ids=tuple(r.id for r in batch.requests),
            ran_ids=tuple(r.id for r in ran),
            padded_tokens=batch.padded_tokens,
            real_tokens=batch.real_tokens,
        )
    )
    return _Done(end, seq, padded_ran, run_s)


def capacity_bound(
    latency: LatencyModel,
    lengths: Sequence[int],
    config: PolicyConfig,
    workers: int = 1,
    model: str = "sim",
    batch_overhead_s: float = 0.0,
) -> float:
    """Requests per second no policy can beat on these lengths: the fewest batches (all full) and no
    padding beyond each request's own pad multiple, spread perfectly over ``workers``.

    Valid as a bound because predicted time is linear in padded tokens with non-negative
    coefficients: any real batching needs at least this much worker time (noise aside).
    """
    if not lengths:
        return math.inf
    base, per_token = latency.coefficients(model)
    batches = math.ceil(len(lengths) / config.max_batch)
    tokens = sum(padded_length(n, config.pad_multiple) for n in lengths)
    work = batches * (base + batch_overhead_s) + per_token * tokens
    return workers * len(lengths) / work if work > 0 else math.inf


def sorted_pass_s(
    latency: LatencyModel, lengths: Sequence[int], config: PolicyConfig, model: str = "sim"
) -> float:
    """Model seconds of the plain offline way to run ``lengths``: sorted by length and cut into
    batches of ``max_batch``, each padded to its longest (rounded up to the pad multiple)."""
    ordered = sorted(lengths)
    chunks = (ordered[i : i + config.max_batch] for i in range(0, len(ordered), config.max_batch))
    return sum(
        latency.predict(model, padded_length(chunk[-1], config.pad_multiple) * len(chunk)) for chunk in chunks
    )


def compare(
    policy_config: PolicyConfig,
    latency: LatencyModel,
    arrivals: Sequence[Arrival],
    policies: Sequence[PolicyKind] = POLICIES,
    **kwargs: Any,
) -> dict[str, SimResult]:
    """``simulate`` once per policy kind on the same arrivals (other settings unchanged)."""
    configs: dict[str, PolicyConfig] = {kind: replace(policy_config, kind=kind) for kind in policies}
    return compare_configs(configs, latency, arrivals, **kwargs)


def compare_configs(
    configs: Mapping[str, PolicyConfig], latency: LatencyModel, arrivals: Sequence[Arrival], **kwargs: Any
) -> dict[str, SimResult]:
    """``simulate`` once per named configuration on the same arrivals."""
    return {name: simulate(config, latency, arrivals, **kwargs) for name, config in configs.items()}
