"""What Redis says about one carpool deployment: one read of it, rates between two reads, plain data."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from carpool.redis_edge import reply_text
from carpool.redis_edge.connect import client_for
from carpool.redis_edge.keys import OUTSTANDING_ON, PRIORITY_SEP, SERVES_FIELD, Keys
from carpool.redis_edge.socket_options import client_options
from carpool.redis_edge.store import consumers


@dataclass(frozen=True)
class Snapshot:
    """What Redis says about one deployment at one moment."""

    taken_at: float  # monotonic seconds, for rates
    redis_time: float  # Redis clock, seconds
    queued: dict[str, int]  # request list label ("p0", "p3", ...) -> length
    workers: list[str]  # hostnames with a live heartbeat
    in_flight: int
    dead_letter: int
    stats: dict[str, float]  # the coordinators' counters, and their live gauges summed
    coordinators: list[str] = field(default_factory=list)  # hostnames whose gauges are live
    tasks: dict[str, str] = field(default_factory=dict)  # routing key (model) -> its task
    # (routing key, automatic bin label) -> the token lengths it holds now; coordinators that fitted
    # different edges give theirs joined by " | "
    spans: dict[tuple[str, str], str] = field(default_factory=dict)
    serves: dict[str, str] = field(default_factory=dict)  # coordinator -> what it serves
    # batch queue -> the live workers consuming it: those coordinators dispatch to and those workers
    # consume, as their gauges and heartbeats say
    batch_queues: dict[str, list[str]] = field(default_factory=dict)
    # the batch queues where coordinators' batches wait and no live worker consumes
    unserved: list[str] = field(default_factory=list)
    # live workers that do not say which batch queues they consume (a release before 2026-12-06)
    unsaid: list[str] = field(default_factory=list)

    @property
    def coordinators_disagree(self) -> bool:
        """Whether live coordinators serve different models or tasks (``CARPOOL_MODEL``...)."""
        return len(set(self.serves.values())) > 1

    # --- derived -----------------------------------------------------------------------------
    def counter(self, name: str) -> float:
        return self.stats.get(name, 0.0)

    @property
    def queued_total(self) -> int:
        return sum(self.queued.values())

    @property
    def pending(self) -> int:
        return int(self.counter("pending"))

    @property
    def has_coordinator_stats(self) -> bool:
        return bool(self.stats)

    def prefixed(self, prefix: str) -> dict[str, float]:
        return {k[len(prefix) :]: v for k, v in self.stats.items() if k.startswith(prefix)}

    @property
    def depth_by_bin(self) -> dict[tuple[str, str], int]:
        """``depth:<model>:<bin label>`` fields; a model name may itself contain ':' (module:Class)."""
        out: dict[tuple[str, str], int] = {}
        for key, value in self.prefixed("depth:").items():
            model, sep, label = key.rpartition(":")
            if sep:
                out[(model, label)] = int(value)
        return out

    @property
    def padding_ratio(self) -> float | None:
        real = self.counter("real_tokens")
        return self.counter("padded_tokens") / real if real else None

    @property
    def mean_batch_size(self) -> float | None:
        batches = self.counter("batches")
        return self.counter("dispatched") / batches if batches else None


@dataclass(frozen=True)
class Rates:
    """Per-second rates between two snapshots; None where a counter went back (stats hash reset)."""

    seconds: float
    values: dict[str, float | None] = field(default_factory=dict)
    padding_ratio: float | None = None


RATE_COUNTERS = ("taken", "dispatched", "batches", "real_tokens", "padded_tokens")


def rates(before: Snapshot, after: Snapshot) -> Rates:
    dt = after.taken_at - before.taken_at
    if dt <= 0:
        return Rates(0.0)
    values: dict[str, float | None] = {}
    for name in RATE_COUNTERS:
        delta = after.counter(name) - before.counter(name)
        values[name] = delta / dt if delta >= 0 else None
    failed_delta = sum(after.prefixed("failed:").values()) - sum(before.prefixed("failed:").values())
    values["failed"] = failed_delta / dt if failed_delta >= 0 else None
    real = after.counter("real_tokens") - before.counter("real_tokens")
    padded = after.counter("padded_tokens") - before.counter("padded_tokens")
    return Rates(dt, values, padded / real if real > 0 and padded >= 0 else None)


def _list_label(keys: Keys, name: str) -> str:
    if name == keys.request_queue:
        return "p0"
    return "p" + name.rsplit(PRIORITY_SEP, 1)[-1]


def collect(client: redis.Redis, keys: Keys) -> Snapshot:
    """One consistent-enough read: two round trips, read-only. Counters are the shared hash's; each
    gauge is the sum over the coordinators whose gauges have not expired."""
    with client.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.zrange(keys.coordinators, 0, -1)
        (secs, micros), listed = pipe.execute()
    now_ms = int(secs) * 1000 + int(micros) // 1000
    names = [reply_text(c) for c in listed]
    lists = keys.request_lists
    with client.pipeline(transaction=False) as pipe:
        for name in lists:
            pipe.llen(name)
        pipe.zrangebyscore(keys.workers, f"({now_ms}", "+inf")
        pipe.zcard(keys.inflight_lease)
        pipe.llen(keys.dead_letter)
        pipe.hgetall(keys.stats)
        pipe.hgetall(keys.worker_queues)
        for name in names:
            pipe.hgetall(keys.gauges_of(name))
        replies = pipe.execute()
    n = len(lists)
    queued = {_list_label(keys, name): int(length) for name, length in zip(lists, replies[:n], strict=True)}
    workers, in_flight, dead, raw_stats, declared = replies[n : n + 5]
    stats = _numbers(raw_stats)
    live = []
    tasks: dict[str, str] = {}
    spans: dict[tuple[str, str], set[str]] = {}
    serves: dict[str, str] = {}
    for name, raw_gauges in zip(names, replies[n + 5 :], strict=True):
        if raw_gauges:  # an expired coordinator's hash is gone
            live.append(name)
            gauges = {reply_text(k): v for k, v in raw_gauges.items()}
            if SERVES_FIELD in gauges:
                serves[name] = reply_text(gauges.pop(SERVES_FIELD))
            for key in [k for k in gauges if k.startswith("task:")]:
                tasks[key[len("task:") :]] = reply_text(gauges.pop(key))
            for key in [k for k in gauges if k.startswith("span:")]:
                model, sep, label = key[len("span:") :].rpartition(":")
                span = reply_text(gauges.pop(key))
                if sep:
                    spans.setdefault((model, label), set()).add(span)
            for key, value in _numbers(gauges).items():
                stats[key] = stats.get(key, 0.0) + value
    found = consumers([reply_text(w) for w in workers], declared)
    waiting = {k[len(OUTSTANDING_ON) :]: v for k, v in stats.items() if k.startswith(OUTSTANDING_ON)}
    by_queue = {queue: found.by_queue.get(queue, []) for queue in sorted(set(waiting) | set(found.by_queue))}
    return Snapshot(
        taken_at=time.monotonic(),
        redis_time=now_ms / 1000,
        queued=queued,
        workers=sorted(reply_text(w) for w in workers),
        in_flight=int(in_flight),
        dead_letter=int(dead),
        stats=stats,
        coordinators=sorted(live),
        tasks=tasks,
        spans={key: " | ".join(sorted(found, key=_span_order)) for key, found in spans.items()},
        serves=serves,
        batch_queues=by_queue,
        unserved=found.unserved(sorted(queue for queue, n in waiting.items() if n > 0)),
        unsaid=found.unknown,
    )


def _span_order(span: str) -> tuple[int, str]:
    head = span.split("-", 1)[0].rstrip("+")
    return (int(head), span) if head.isdigit() else (sys.maxsize, span)


def _numbers(raw: dict[Any, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in raw.items():
        try:
            out[reply_text(k)] = float(v)
        except ValueError:
            continue
    return out


def as_dict(snap: Snapshot, rate: Rates | None, queue: str) -> dict[str, Any]:
    s = snap.counter
    return {
        "request_queue": queue,
        "queued": snap.queued_total,
        "queued_by_priority": snap.queued,
        "pending": snap.pending,
        "held_for_eta": int(s("deferred")),
        "depth_by_bin": {f"{m}:{b}": n for (m, b), n in sorted(snap.depth_by_bin.items())},
        "task_of_model": dict(sorted(snap.tasks.items())),
        "bin_spans": {f"{m}:{b}": span for (m, b), span in sorted(snap.spans.items())},
        "in_flight": snap.in_flight,
        "outstanding_batches": int(s("outstanding")),
        "workers_online": len(snap.workers),
        "workers": snap.workers,
        "coordinators": snap.coordinators,
        "coordinators_serve": dict(sorted(snap.serves.items())),
        "coordinators_disagree": snap.coordinators_disagree,
        "batch_queue_workers": {queue: len(hosts) for queue, hosts in snap.batch_queues.items()},
        "batch_queues_unserved": snap.unserved,
        "workers_not_saying_queues": snap.unsaid,
        "dead_letter": snap.dead_letter,
        "taken": int(s("taken")),
        "batches": int(s("batches")),
        "dispatched": int(s("dispatched")),
        "padded_tokens": int(s("padded_tokens")),
        "real_tokens": int(s("real_tokens")),
        "padding_ratio": snap.padding_ratio,
        "mean_batch_size": snap.mean_batch_size,
        "batch_sizes": {k: int(v) for k, v in sorted(snap.prefixed("size:").items(), key=_num_key)},
        "flush": {k: int(v) for k, v in sorted(snap.prefixed("flush:").items())},
        "failed": {k: int(v) for k, v in sorted(snap.prefixed("failed:").items())},
        "requeued": {k: int(v) for k, v in sorted(snap.prefixed("requeued:").items())},
        "coordinator_seen": snap.has_coordinator_stats,
        "rates": None
        if rate is None
        else {"seconds": rate.seconds, **rate.values, "padding_ratio": rate.padding_ratio},
    }


def _num_key(item: tuple[str, float]) -> tuple[int, str]:
    key = item[0]
    return (int(key), key) if key.isdigit() else (sys.maxsize, key)


def snapshot_dict(settings: Any = None) -> dict[str, Any]:
    """One snapshot as plain data (no rates), for code that wants numbers rather than a view."""
    from carpool.config import load_settings

    settings = settings or load_settings()
    client = client_for(settings.broker_url, settings, **client_options(settings))
    try:
        return as_dict(collect(client, Keys(settings.request_queue)), None, settings.request_queue)
    finally:
        client.close()


def dead_letters(client: redis.Redis, keys: Keys, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` dead letters, newest first, as the coordinator wrote them (``id``,
    ``reason``, ``at``, ``bytes``, ``raw``, ``truncated``; entries an earlier release wrote lack
    ``at`` and ``bytes``, and one that is not a JSON object is given as its ``raw`` text)."""
    out: list[dict[str, Any]] = []
    for item in client.lrange(keys.dead_letter, 0, max(limit, 1) - 1):
        text = item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
        try:
            entry = json.loads(text)
        except ValueError:
            entry = None
        out.append(entry if isinstance(entry, dict) else {"raw": text})
    return out
