"""Judging a soak from what it recorded: plain numbers in, verdicts out (no Redis, no processes).

- Windows: per ``window_s`` of the run, requests offered (by scheduled arrival), answered (by the
  time the producer read the answer), and the p50/p99 latency of the successes answered in it.
- Recovery: a window is healthy when its p99 is within ``p99_factor`` of the calm lead-in's p99
  and it answered at least half of what was offered in it. A fault has recovered once every
  window from then until the one holding the next fault (or the end of the load) is healthy; its
  recovery time is from the fault to the end of the last unhealthy window. A fault followed by
  another before it recovered and sooner than ``p99_recovery_s`` is *overlapped*: judged with the
  one that follows.
- Memory: a series is flat when, after its warm-up, the median of its last third is at most
  ``ratio`` above the median of its first third, or at most ``slack`` above it (small processes
  move by a few MiB for reasons that are no leak); too few samples is *not judged*.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from carpool.tools.stats import percentile

MIB = 1024 * 1024
MIN_MEMORY_SAMPLES = 6


def windows(
    arrivals_s: Sequence[float],
    answers: Sequence[tuple[float, float, bool]],
    end_s: float,
    window_s: float,
    min_requests: int,
) -> list[dict[str, Any]]:
    """Per window of ``[0, end_s)``: offered and answered counts, throughput, p50/p99 (ms) of the
    successes answered in it (None under ``min_requests``). ``answers``: (answered at s, latency s,
    success) per answered request."""
    count = max(1, int(end_s // window_s + (1 if end_s % window_s else 0)))
    offered = [0] * count
    answered = [0] * count
    latencies: list[list[float]] = [[] for _ in range(count)]
    for t in arrivals_s:
        if 0 <= t < end_s:
            offered[int(t // window_s)] += 1
    for t, latency, ok in answers:
        if 0 <= t < end_s:
            i = int(t // window_s)
            answered[i] += 1
            if ok:
                latencies[i].append(latency * 1000)
    out = []
    for i in range(count):
        enough = len(latencies[i]) >= min_requests
        out.append(
            {
                "t_s": round(i * window_s, 3),
                "offered": offered[i],
                "answered": answered[i],
                "throughput_rps": round(answered[i] / window_s, 2),
                "p50_ms": round(percentile(latencies[i], 50), 1) if enough else None,
                "p99_ms": round(percentile(latencies[i], 99), 1) if enough else None,
            }
        )
    return out


def healthy(window: dict[str, Any], bound_ms: float) -> bool:
    p99 = window["p99_ms"]
    if window["offered"] == 0:
        return p99 is None or p99 <= bound_ms
    return p99 is not None and p99 <= bound_ms and window["answered"] >= 0.5 * window["offered"]


def recoveries(
    faults: Sequence[dict[str, Any]],
    wins: Sequence[dict[str, Any]],
    window_s: float,
    bound_ms: float,
    within_s: float,
    end_s: float,
) -> list[dict[str, Any]]:
    """Each fault with ``recovery_s`` and a ``verdict``: recovered, slow, overlapped or not recovered."""
    out = []
    for k, fault in enumerate(faults):
        at = fault["at_s"]
        until = faults[k + 1]["at_s"] if k + 1 < len(faults) else end_s
        # Windows that end after this fault and no later than the next: one holding the next
        # fault belongs to that one.
        span = [w for w in wins if at < w["t_s"] + window_s <= until + 1e-9]
        bad = [w for w in span if not healthy(w, bound_ms)]
        last_bad_end = max((w["t_s"] + window_s for w in bad), default=at)
        settled = any(w["t_s"] >= last_bad_end for w in span)
        recovery = round(max(0.0, last_bad_end - at), 3) if settled else None
        if recovery is not None:
            verdict = "recovered" if recovery <= within_s else "slow"
        elif until - at < within_s and k + 1 < len(faults):
            verdict = "overlapped"
        else:
            verdict = "not recovered"
        out.append({**fault, "recovery_s": recovery, "verdict": verdict})
    return out


def memory_verdict(
    samples: Sequence[tuple[float, int]], from_s: float, ratio: float, slack_bytes: float
) -> dict[str, Any]:
    """Flatness of one (t, bytes) series after ``from_s``; see the module docstring."""
    kept = [(t, v) for t, v in samples if t >= from_s]
    if len(kept) < MIN_MEMORY_SAMPLES:
        return {"judged": False, "flat": None, "judged_samples": len(kept)}
    third = max(1, len(kept) // 3)
    early = percentile([v for _, v in kept[:third]], 50)
    late = percentile([v for _, v in kept[-third:]], 50)
    growth = late - early
    return {
        "judged": True,
        "flat": growth <= max(ratio * early, slack_bytes),
        "judged_samples": len(kept),
        "from_s": round(kept[0][0], 2),
        "to_s": round(kept[-1][0], 2),
        "early_mib": round(early / MIB, 2),
        "late_mib": round(late / MIB, 2),
        "growth_mib": round(growth / MIB, 2),
        "slope_mib_per_min": round(slope(kept) * 60 / MIB, 3),
    }


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points; 0 for fewer than two distinct x."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def incarnations(series: Sequence[tuple[float, int, int]]) -> list[tuple[int, list[tuple[float, int]]]]:
    """A process's (t, pid, bytes) samples split by pid, in order: one series per life."""
    out: list[tuple[int, list[tuple[float, int]]]] = []
    for t, pid, value in series:
        if not out or out[-1][0] != pid:
            out.append((pid, []))
        out[-1][1].append((t, value))
    return out
