"""``carpool simulate``: replay arrivals through the real batching policy on a simulated clock.

Data flow::

    arrivals: Poisson at a rate with token lengths (the seeded mixed workload, tokenized by a model's
              own tokenizer, or uniform), or a recorded trace file (JSON lines or CSV)
      -> Request objects whose times are simulated seconds
      -> carpool.batching.BatchPolicy, the coordinator's own policy object, polled at every event
         (arrival, batch report, the policy's own wake-up time) with free_workers, free_slots and
         ahead_s computed by the coordinator's capacity rules
      -> a simulated worker pool: dispatched batches queue first-in first-out and each runs for the
         latency model's prediction a + b * padded_tokens (x seeded noise) plus a per-batch overhead;
         members already past their deadline when a worker starts the batch fail there, as they do in
         carpool.gpu_worker.runtime
      -> reports back to the policy's latency model (the coordinator's online fit)
      -> SimResult per policy and offered rate: throughput, p50/p99 latency, padding ratio, mean batch
         size, deadline misses -> a rich table and a matplotlib PNG (the CLI glue at the bottom)

The core (``simulate`` and the arrival helpers) is pure: no Redis, Celery, torch or wall clock, and a
seed fixes every random draw, so the same inputs give the same numbers on any machine. Only
``calibrate`` (times ``run_padded`` in this process) and ``workload_lengths`` (a model's tokenizer)
touch a model.
"""

from __future__ import annotations

import argparse
import copy
import csv
import heapq
import io
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool.batching import Batch, BatchPolicy, LatencyModel, PolicyConfig, Request, padded_length
from carpool.batching.capacity import may_start, pool_capacity
from carpool.batching.policy import PolicyKind
from carpool.names import POLICY_NAMES
from carpool.tools.bench.measure import percentile

if TYPE_CHECKING:
    from rich.table import Table

POLICIES: tuple[PolicyKind, ...] = POLICY_NAMES
# Offered rates tried when none are given, as fractions of the ideal capacity (see capacity_bound):
# from light load to just past saturation, where the policies differ most.
DEFAULT_LOAD_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 0.95, 1.1)


# --- arrivals ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as offered to the coordinator.

    ``deadline_s`` is relative: seconds after ``arrival_s`` the request may take (its ``expires=``);
    None means the default deadline of the run.
    """

    arrival_s: float
    length: int
    priority: int = 0
    deadline_s: float | None = None


class TraceError(ValueError):
    """A trace file that cannot be read as arrivals; the message names the line."""


def burst_arrivals(lengths: Sequence[int], deadline_s: float | None = None) -> list[Arrival]:
    """Every request at time 0, like ``carpool demo``'s burst with an infinitely fast producer."""
    return [Arrival(0.0, n, 0, deadline_s) for n in lengths]


def poisson_arrivals(
    lengths: Sequence[int], rate_per_s: float, seed: int = 0, deadline_s: float | None = None
) -> list[Arrival]:
    """One arrival per length, exponential gaps of mean ``1 / rate_per_s``, the first at time 0.

    The same ``seed`` gives the same gaps scaled to any rate, so curves across rates compare like
    with like (common random numbers) instead of adding sampling noise between points.
    """
    if not rate_per_s > 0:
        raise ValueError("rate_per_s must be > 0")
    if math.isinf(rate_per_s):
        return burst_arrivals(lengths, deadline_s)
    rng = random.Random(f"arrivals:{seed}")
    t = 0.0
    out = []
    for i, n in enumerate(lengths):
        if i:
            t += rng.expovariate(1.0) / rate_per_s
        out.append(Arrival(t, n, 0, deadline_s))
    return out


def offered_rate(arrivals: Sequence[Arrival]) -> float:
    """Requests per second the arrivals offer: (n - 1) gaps over their span; inf for a burst."""
    if len(arrivals) < 2:
        return math.inf
    times = [a.arrival_s for a in arrivals]
    span = max(times) - min(times)
    return (len(arrivals) - 1) / span if span > 0 else math.inf


def scale_to_rate(arrivals: Sequence[Arrival], rate_per_s: float) -> list[Arrival]:
    """The same arrivals with time stretched so that they offer ``rate_per_s`` (deadlines kept)."""
    current = offered_rate(arrivals)
    if math.isinf(current) or math.isinf(rate_per_s):
        raise ValueError("a burst (all arrivals at one instant) has no rate to scale")
    factor = current / rate_per_s
    start = min(a.arrival_s for a in arrivals)
    return [replace(a, arrival_s=(a.arrival_s - start) * factor) for a in arrivals]


def uniform_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    if not 1 <= low <= high:
        raise ValueError("uniform lengths need 1 <= LO <= HI")
    rng = random.Random(f"lengths:{seed}")
    return [rng.randint(low, high) for _ in range(n)]


def workload_lengths(n: int, seed: int = 0, model: str = "minilm") -> list[int]:
    """Token lengths of ``carpool.tools.workload.mixed_texts(n, seed)`` under ``model``'s own tokenizer.

    The coordinator bins by exactly these lengths (encode truncates to the model's window), so the
    simulated padding is the padding the real coordinator would produce for the same texts.
    """
    from carpool.models import get_model
    from carpool.tools.workload import mixed_texts

    return [len(ids) for ids in get_model(model).encode(mixed_texts(n, seed))]


_TRACE_FIELDS = ("arrival_s", "length", "priority", "deadline_s")


def load_trace(path: str | Path) -> list[Arrival]:
    """Arrivals from JSON lines (objects with ``arrival_s``, ``length``, optional ``priority`` and
    ``deadline_s``) or CSV (``arrival_s,length[,priority,deadline_s]``, header optional).

    Blank lines and lines starting with ``#`` are skipped; the result is sorted by arrival (stable).
    """
    text = Path(path).read_text(encoding="utf-8")
    rows: list[tuple[int, dict[str, str]]] = []
    lines = [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)]
    lines = [(i, line) for i, line in lines if line and not line.startswith("#")]
    if not lines:
        raise TraceError(f"{path}: no arrivals")
    if lines[0][1].startswith("{"):
        for lineno, line in lines:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object")
            rows.append((lineno, {k: "" if v is None else str(v) for k, v in obj.items()}))
    else:
        parsed = list(csv.reader(io.StringIO("\n".join(line for _, line in lines))))
        names: Sequence[str] = _TRACE_FIELDS
        body = list(zip((i for i, _ in lines), parsed, strict=True))
        first = [c.strip() for c in body[0][1]]
        if first and not _is_number(first[0]):
            names = first
            unknown = set(names) - set(_TRACE_FIELDS)
            if unknown:
                raise TraceError(f"{path}:{body[0][0]}: unknown column(s) {', '.join(sorted(unknown))}")
            body = body[1:]
        for lineno, cells in body:
            if len(cells) > len(names):
                raise TraceError(f"{path}:{lineno}: {len(cells)} columns, expected at most {len(names)}")
            rows.append((lineno, {k: c.strip() for k, c in zip(names, cells, strict=False)}))
    arrivals = [_arrival(path, lineno, row) for lineno, row in rows]
    if not arrivals:
        raise TraceError(f"{path}: no arrivals")
    return sorted(arrivals, key=lambda a: a.arrival_s)


def write_trace(path: str | Path, arrivals: Sequence[Arrival]) -> None:
    """Arrivals as JSON lines, the format ``load_trace`` reads (for recording a real run)."""
    with open(path, "w", encoding="utf-8") as out:
        for a in arrivals:
            row: dict[str, float | int] = {"arrival_s": a.arrival_s, "length": a.length}
            if a.priority:
                row["priority"] = a.priority
            if a.deadline_s is not None:
                row["deadline_s"] = a.deadline_s
            out.write(json.dumps(row) + "\n")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _arrival(path: str | Path, lineno: int, row: dict[str, str]) -> Arrival:
    where = f"{path}:{lineno}"
    for required in ("arrival_s", "length"):
        if not row.get(required):
            raise TraceError(f"{where}: missing {required}")
    try:
        arrival_s = float(row["arrival_s"])
        length_f = float(row["length"])
        priority = int(row["priority"]) if row.get("priority") else 0
        deadline = float(row["deadline_s"]) if row.get("deadline_s") else None
    except ValueError as exc:
        raise TraceError(f"{where}: {exc}") from None
    if not math.isfinite(arrival_s) or arrival_s < 0:
        raise TraceError(f"{where}: arrival_s must be a finite number >= 0")
    if length_f != int(length_f) or length_f < 1:
        raise TraceError(f"{where}: length must be a whole number of tokens >= 1")
    if deadline is not None and not deadline > 0:
        raise TraceError(f"{where}: deadline_s (seconds after arrival) must be > 0")
    return Arrival(arrival_s, int(length_f), priority, deadline)


# --- the simulation ---------------------------------------------------------------------------------


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
    rng = random.Random(f"noise:{seed}")
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
    worker_free = [ordered[0].arrival_s] * workers  # min-heap of the times each worker frees up
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
        plan = policy.poll(now, cap.free_workers, cap.free_slots, cap.ahead_s)
        wake = plan.wake_at_s
        for req in plan.expired:
            result.missed_in_queue += 1
            result.missed_ids.append(req.id)
        for batch in plan.batches:
            seq += 1
            outstanding[seq] = learner.predict(model, batch.padded_tokens)
            heapq.heappush(
                done,
                _run(
                    batch,
                    now,
                    seq,
                    worker_free,
                    latency,
                    model,
                    batch_overhead_s,
                    noise,
                    rng,
                    policy_config.pad_multiple,
                    result,
                ),
            )
    else:
        raise RuntimeError("simulation did not converge: the policy kept asking to be woken without progress")
    if len(policy):
        raise RuntimeError(f"simulation ended with {len(policy)} requests still queued")
    return result


def _run(
    batch: Batch,
    now: float,
    seq: int,
    worker_free: list[float],
    truth: LatencyModel,
    model: str,
    overhead_s: float,
    noise: float,
    rng: random.Random,
    pad_multiple: int,
    result: SimResult,
) -> _Done:
    """Hand ``batch`` to the first worker to free up; record what it runs and when it finishes."""
    # Batches leave the coordinator in order and workers are alike, so the earliest-free worker takes
    # each one in turn: the start time is known at dispatch (an ideal shared Celery queue).
    start = max(now, heapq.heappop(worker_free))
    ran = [r for r in batch.requests if may_start(r.deadline_s, start)]
    run_s = 0.0
    padded_ran = 0
    if ran:
        padded_ran = padded_length(max(r.length for r in ran), pad_multiple) * len(ran)
        run_s = truth.predict(model, padded_ran)
        if noise:
            # Lognormal with mean 1: run times stay positive and the mean throughput is unbiased.
            run_s *= rng.lognormvariate(-noise * noise / 2, noise)
    end = start + run_s + overhead_s
    heapq.heappush(worker_free, end)
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


def compare(
    policy_config: PolicyConfig,
    latency: LatencyModel,
    arrivals: Sequence[Arrival],
    policies: Sequence[PolicyKind] = POLICIES,
    **kwargs: Any,
) -> dict[str, SimResult]:
    """``simulate`` once per policy kind on the same arrivals (other settings unchanged)."""
    return {
        kind: simulate(replace(policy_config, kind=kind), latency, arrivals, **kwargs) for kind in policies
    }


# --- calibration ------------------------------------------------------------------------------------

# (rows, width) shapes timed by calibrate, spanning 16 to 2048 padded tokens (one short text to a full
# batch of medium ones). The first three already span the range, so a budget cut short still fits a
# line over the whole of it instead of extrapolating from small batches.
CALIBRATION_SHAPES = ((1, 16), (8, 64), (32, 64), (4, 32), (16, 64), (8, 32), (32, 32), (16, 128))


def fit_linear(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b * x, both clipped at 0 like the coordinator's fit."""
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        raise ValueError("need at least two distinct x values to fit a line")
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x)
    return max(0.0, mean_y - slope * mean_x), slope


def calibrate(
    model_name: str, device: str = "cpu", budget_s: float = 10.0, repeats: int = 3, threads: int = 0
) -> tuple[float, float]:
    """Fit (a, b) of t = a + b * padded_tokens by timing ``run_padded`` in this process.

    Each shape runs once to warm up, then ``repeats`` times; the median counts (a worker meets
    interference too, so the minimum would flatter it). Timing stops once ``budget_s`` is spent
    (loading the model comes on top: about 3 s for minilm on CPU), keeping at least three shapes.
    ``threads`` > 0 times with that many torch threads, as a worker with ``CARPOOL_TORCH_THREADS``
    runs; torch's own setting is restored afterwards.
    """
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _calibrate(model_name, device, budget_s, repeats)
    finally:
        torch.set_num_threads(previous)


def _calibrate(model_name: str, device: str, budget_s: float, repeats: int) -> tuple[float, float]:
    from carpool.gpu_worker.runner import loaded_model, run_padded

    model = loaded_model(model_name, device)
    t_start = time.perf_counter()
    # Real token ids of the model's own tokenizer, cut to each width (ids from the vocabulary).
    from carpool.tools.workload import mixed_texts

    source = max(model.encode(mixed_texts(50, seed=1)), key=len)
    points: list[tuple[float, float]] = []
    for rows, width in CALIBRATION_SHAPES:
        width = min(width, model.max_length, len(source))
        if len(points) >= 3 and time.perf_counter() - t_start > budget_s:
            break
        row = source[:width] if model.needs_token_ids else None
        batch = [row] * rows
        lengths = [width] * rows
        run_padded(model, batch, lengths)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_padded(model, batch, lengths)
            times.append(time.perf_counter() - t0)
        points.append((float(rows * padded_length(width)), sorted(times)[len(times) // 2]))
    return fit_linear(points)


# --- CLI glue ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Sweep:
    """Results of one CLI run: per offered rate, per policy."""

    rates: list[float]  # offered requests/s of each run, as realised by its arrivals
    results: list[dict[str, SimResult]]
    bound: float
    latency: tuple[float, float]
    workers: int
    description: str


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``carpool simulate`` on the top-level CLI's subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="replay arrivals through each batching policy on a simulated clock, no accelerator",
        description="Discrete-event simulation of the coordinator's batching policies. Policy knobs default "
        "to the CARPOOL_* settings. See docs/SIMULATOR.md.",
    )
    _add_arguments(p)
    p.set_defaults(func=run_cli)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    arr = p.add_argument_group("arrivals")
    arr.add_argument(
        "--trace",
        metavar="FILE",
        help="recorded arrivals: JSON lines or CSV of arrival_s,length[,priority,deadline_s] "
        "(deadline_s = seconds after arrival); replaces --lengths and --requests",
    )
    arr.add_argument(
        "--rates",
        metavar="R,R,...",
        type=_floats,
        help="offered requests/s (Poisson; a trace is time-scaled to each rate); default: "
        f"{', '.join(f'{f:g}' for f in DEFAULT_LOAD_FRACTIONS)} x the capacity bound, "
        "or the trace as recorded",
    )
    arr.add_argument("--requests", type=int, default=2000, help="requests per run (default 2000)")
    arr.add_argument(
        "--lengths",
        default="workload",
        help="'workload' (carpool.tools.workload.mixed_texts tokenized by --model) or uniform:LO-HI",
    )
    arr.add_argument("--model", default="minilm", help="tokenizer for --lengths workload (default minilm)")
    arr.add_argument(
        "--deadline-s",
        type=float,
        help="deadline, seconds after arrival (default CARPOOL_DEFAULT_DEADLINE_S)",
    )
    arr.add_argument("--seed", type=int, default=0)
    lat = p.add_argument_group("latency model").add_mutually_exclusive_group()
    lat.add_argument(
        "--latency",
        metavar="A,B",
        type=_floats,
        help="batch seconds = A + B * padded tokens (default: the coordinator's prior)",
    )
    lat.add_argument(
        "--calibrate",
        metavar="MODEL",
        help="fit A,B by timing MODEL's forward here, in-process (minilm, toy, ...)",
    )
    p.add_argument(
        "--calibrate-threads",
        type=int,
        default=0,
        metavar="N",
        help="torch threads while calibrating (default: torch's own); match CARPOOL_TORCH_THREADS",
    )
    p.add_argument(
        "--overhead-s",
        type=float,
        default=0.0,
        help="pipeline seconds per batch on top of the model (hand-off, result writes)",
    )
    p.add_argument("--noise", type=float, default=0.0, help="log-sd of multiplicative run-time noise")
    pol = p.add_argument_group("pool and policy (default: CARPOOL_* settings)")
    pol.add_argument(
        "--policies",
        type=_policies,
        default=POLICIES,
        metavar="P,P,...",
        help="of fifo, shortest, binned (default all three)",
    )
    pol.add_argument("--workers", type=int, default=1)
    pol.add_argument("--prefetch-batches", type=int)
    pol.add_argument("--max-batch", type=int)
    pol.add_argument("--max-tokens", type=int)
    pol.add_argument("--max-wait-s", type=float)
    pol.add_argument("--wait-factor", type=float)
    pol.add_argument("--bin-edges", metavar="E,E,...", help="upper bin edges, or auto (as CARPOOL_BIN_EDGES)")
    pol.add_argument("--auto-bins", type=int, help="> 0: fit that many bins to recent lengths")
    p.add_argument("--out", default="simulate.png", help="PNG plot path (default simulate.png)")


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _policies(text: str) -> tuple[PolicyKind, ...]:
    kinds = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [k for k in kinds if k not in POLICIES]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"policies are {', '.join(POLICIES)}; got {text!r}")
    return kinds  # type: ignore[return-value]


def run_cli(args: argparse.Namespace) -> int:
    """``carpool simulate``: build arrivals, sweep rates x policies, print the table, write the PNG."""
    from rich.console import Console

    from carpool.errors import ConfigError

    console = Console()
    if not console.is_terminal:
        # Piped or captured output has no width to fit; 80 columns would wrap every row in two.
        console = Console(width=150)
    try:
        sweep = run_sweep(args, console)
    except (ConfigError, TraceError, ValueError, OSError) as exc:
        console.print(f"[red]carpool simulate:[/] {exc}")
        return 2
    console.print(results_table(sweep))
    out = Path(args.out)
    plot(sweep, out)
    console.print(f"plot written to {out}")
    return 0


def run_sweep(args: argparse.Namespace, console: Any = None) -> Sweep:
    from carpool.config import load_settings
    from carpool.coordinator import policy_config

    knobs = ("max_batch", "max_tokens", "max_wait_s", "wait_factor", "prefetch_batches", "auto_bins")
    overrides: dict[str, object] = {k: getattr(args, k) for k in knobs if getattr(args, k) is not None}
    if args.bin_edges is not None:
        overrides["bin_edges"] = args.bin_edges
    settings = load_settings(**overrides)
    config = policy_config(settings)
    if args.workers < 1 or args.requests < 1:
        raise ValueError("--workers and --requests must be >= 1")
    deadline = args.deadline_s if args.deadline_s is not None else settings.default_deadline_s

    if args.calibrate:
        if console is not None:
            console.print(f"calibrating {args.calibrate} in this process...")
        a, b = calibrate(args.calibrate, threads=args.calibrate_threads)
    elif args.latency:
        if len(args.latency) != 2 or min(args.latency) < 0:
            raise ValueError("--latency takes A,B: two numbers >= 0")
        a, b = args.latency
    else:
        prior = LatencyModel()
        a, b = prior.prior_base_s, prior.prior_per_token_s
    latency = LatencyModel(prior_base_s=a, prior_per_token_s=b)

    if args.trace:
        base = load_trace(args.trace)
        lengths = [x.length for x in base]
        what = f"trace {args.trace} ({len(base)} requests)"
    else:
        lengths = _lengths(args.lengths, args.requests, args.seed, args.model)
        base = []
        what = f"{len(lengths)} requests, lengths {args.lengths}" + (
            f" ({args.model} tokens)" if args.lengths == "workload" else ""
        )
    bound = capacity_bound(latency, lengths, config, args.workers, batch_overhead_s=args.overhead_s)
    if args.rates:
        rates = list(args.rates)
        if any(not (r > 0 and math.isfinite(r)) for r in rates):
            raise ValueError("--rates must be finite and > 0")
    elif base:
        rates = [offered_rate(base)]
    else:
        rates = [round(f * bound, 3) for f in DEFAULT_LOAD_FRACTIONS]
    results = []
    offered = []  # what each run's arrivals really offer: a Poisson draw is off its nominal rate
    for rate in rates:
        if base:
            arrivals = base if not args.rates else scale_to_rate(base, rate)
            arrivals = [x if x.deadline_s is not None else replace(x, deadline_s=deadline) for x in arrivals]
        else:
            arrivals = poisson_arrivals(lengths, rate, args.seed, deadline)
        results.append(
            compare(
                config,
                latency,
                arrivals,
                args.policies,
                workers=args.workers,
                prefetch_batches=settings.prefetch_batches,
                default_deadline_s=deadline,
                batch_overhead_s=args.overhead_s,
                noise=args.noise,
                seed=args.seed,
            )
        )
        offered.append(offered_rate(arrivals))
    description = (
        f"{what}; {args.workers} worker(s), t = {a * 1000:.3g} ms + {b * 1e6:.3g} us/token"
        + (f" + {args.overhead_s * 1000:.3g} ms/batch" if args.overhead_s else "")
        + f"; max_batch {config.max_batch}, bins {_bins(config)}"
    )
    return Sweep(offered, results, bound, (a, b), args.workers, description)


def _bins(config: PolicyConfig) -> str:
    edges = ",".join(map(str, config.bin_edges)) or "-"
    return f"{config.auto_bins} fitted to traffic (seeded {edges})" if config.auto_bins else edges


def _lengths(spec: str, n: int, seed: int, model: str) -> list[int]:
    if spec == "workload":
        return workload_lengths(n, seed, model)
    kind, _, rest = spec.partition(":")
    low, sep, high = rest.partition("-")
    if kind == "uniform" and sep:
        try:
            return uniform_lengths(n, int(low), int(high), seed)
        except ValueError:
            pass
    raise ValueError(f"--lengths must be 'workload' or uniform:LO-HI, got {spec!r}")


def results_table(sweep: Sweep) -> Table:
    from rich.table import Table

    table = Table(
        title=f"carpool simulate: {sweep.description}\n"
        f"capacity bound {sweep.bound:.1f} req/s (full batches, no padding)"
    )
    for name, justify in (
        ("offered/s", "right"),
        ("policy", "left"),
        ("throughput/s", "right"),
        ("p50 ms", "right"),
        ("p99 ms", "right"),
        ("padding", "right"),
        ("mean batch", "right"),
        ("batches", "right"),
        ("misses", "right"),
        ("util", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for i, (rate, by_policy) in enumerate(zip(sweep.rates, sweep.results, strict=True)):
        if i:
            table.add_section()
        for kind, r in by_policy.items():
            table.add_row(
                f"{rate:.1f}",
                kind,
                f"{r.throughput:.1f}",
                _ms(r.p50_s),
                _ms(r.p99_s),
                f"{r.padding_ratio:.2f}",
                f"{r.mean_batch_size:.1f}",
                str(len(r.batches)),
                str(r.missed),
                f"{r.utilisation:.0%}",
            )
    return table


def _ms(seconds: float) -> str:
    # Whole milliseconds hide a cheap model's sub-millisecond latencies as "0".
    return f"{seconds * 1000:.0f}" if seconds >= 0.01 else f"{seconds * 1000:.2f}"


def plot(sweep: Sweep, out: Path) -> None:
    """p50/p99 latency, throughput and padding ratio per policy across offered rates, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    kinds = list(sweep.results[0])
    # A burst offers an infinite rate, which no axis holds: put such runs one step past the others.
    finite = [r for r in sweep.rates if math.isfinite(r)]
    past = max(finite, default=1.0) * 1.15
    xs = [r if math.isfinite(r) else past for r in sweep.rates]
    fig, (ax_lat, ax_thr, ax_pad) = plt.subplots(1, 3, figsize=(15, 4.6))
    colors = {"fifo": "tab:red", "shortest": "tab:orange", "binned": "tab:blue"}
    for kind in kinds:
        rs = [by[kind] for by in sweep.results]
        c = colors.get(kind)
        ax_lat.plot(xs, [r.p50_s * 1000 for r in rs], "o-", color=c, label=f"{kind} p50")
        ax_lat.plot(xs, [r.p99_s * 1000 for r in rs], "s--", color=c, label=f"{kind} p99")
        ax_thr.plot(xs, [r.throughput for r in rs], "o-", color=c, label=kind)
        ax_pad.plot(xs, [r.padding_ratio for r in rs], "o-", color=c, label=kind)
    if finite:
        top = max(finite)
        ax_thr.plot([0, top], [0, top], ":", color="grey", label="offered")
    ax_thr.axhline(sweep.bound, color="black", linestyle="-.", linewidth=1, label="capacity bound")
    ax_lat.set_yscale("log")
    xlabel = "offered requests/s" + (f" (burst at {past:.0f})" if len(finite) < len(xs) else "")
    ax_lat.set(title="latency", xlabel=xlabel, ylabel="ms (log)")
    ax_thr.set(title="throughput", xlabel=xlabel, ylabel="completed requests/s")
    ax_pad.set(title="padding ratio (padded / real tokens)", xlabel=xlabel, ylabel="ratio")
    for ax in (ax_lat, ax_thr, ax_pad):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(sweep.description, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m carpool.tools.simulate ...``: the same command without the top-level CLI."""
    parser = argparse.ArgumentParser(
        prog="carpool simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
