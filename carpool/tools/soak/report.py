"""A soak's report: counts, the faults and their recoveries, windows, memory, and the verdicts.

What "answered exactly once" rests on (also in the report's ``checked``): the producer reads every
request's result key as soon as it lands and again ``recheck_after_s`` later, and the two reads
must be byte for byte the same (a second store would change at least ``date_done``); results are
written with SET NX, and a second run that write-once refused is counted by the workers in the
stats hash (``rejected_writes``) and reported; each success is compared with the toy model run
alone on the same text; a failure must be stored as a ``carpool.errors.CarpoolError`` subclass.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from carpool.tools.soak import analysis
from carpool.tools.soak.config import SoakConfig
from carpool.tools.soak.load import Request
from carpool.tools.stats import percentile

SCHEMA = "carpool-soak/1"
CHECKED = (
    "each request's result key read when it landed and re-read later: the same bytes (write-once held, "
    "no second answer); successes equal the toy model run alone (atol 1e-4); failures stored as "
    "carpool.errors.CarpoolError subclasses; second runs refused by write-once counted by the workers "
    "(stats rejected_writes); nothing left queued or in flight after the drain; every process not "
    "killed by a fault still running"
)


def build_report(
    config: SoakConfig,
    *,
    requests: list[Request],
    faults: list[dict[str, Any]],
    sampler: Any,
    start: float,
    counters: dict[str, Any],
    producer: dict[str, Any],
) -> dict[str, Any]:
    accepted = [r for r in requests if r.id]
    refused = Counter(r.send_error for r in requests if r.send_error)
    outcomes = Counter(r.outcome for r in accepted if r.seen is not None)
    failed = {k: v for k, v in outcomes.items() if k not in ("ok", "wrong")}
    named = Counter(r.outcome for r in accepted if r.seen is not None and r.named)
    unnamed = {k: v for k, v in failed.items() if k not in named}
    recheck = Counter(r.recheck for r in accepted if r.seen is not None)
    lost = sum(1 for r in accepted if r.seen is None)
    lags = [(r.sent - r.arrival) * 1000 for r in accepted if r.sent is not None]
    latencies = [r.latency_s for r in accepted if r.outcome == "ok" and r.latency_s is not None]
    counts = {
        "offered": len(requests),
        "accepted": len(accepted),
        "refused_at_send": dict(refused),
        "answered_ok": outcomes.get("ok", 0),
        "wrong_result": outcomes.get("wrong", 0),
        "failed_named": dict(named),
        "failed_unnamed": unnamed,
        "lost": lost,
        "reread_same": recheck.get("same", 0),
        "reread_changed": recheck.get("changed", 0),
        "reread_missing": recheck.get("missing", 0),
        "rejected_writes": counters["stats"].get("rejected_writes", 0),
        "dispatched": counters["stats"].get("dispatched", 0),
        "send_attempts_over_one": sum(1 for r in requests if r.attempts > 1),
        "batches": counters["stats"].get("batches", 0),
        **producer,
        "left_queued": counters["queued"],
        "left_in_flight": counters["in_flight"],
        "dead_letter": counters["dead_letter"],
    }
    end = config.duration_s
    answers = [
        (r.seen - start, r.latency_s, r.outcome == "ok")
        for r in accepted
        if r.seen is not None and r.latency_s is not None
    ]
    wins = analysis.windows(
        [r.arrival - start for r in requests], answers, end, config.window_s, config.min_window_requests
    )
    first_fault = faults[0]["at_s"] if faults else end
    calm = [lat * 1000 for t, lat, ok in answers if ok and config.warmup_s <= t < first_fault]
    baseline = percentile(calm, 99) if calm else None
    bound = baseline * config.p99_factor if baseline else float("inf")
    judged = analysis.recoveries(faults, wins, config.window_s, bound, config.p99_recovery_s, end)
    memory = _memory(config, sampler)
    invariants = _invariants(counts, judged, memory, sampler.exits)
    return {
        "schema": SCHEMA,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_at_end": [round(v, 2) for v in os.getloadavg()],
        },
        "config": config.to_dict(),
        "checked": CHECKED,
        "counts": counts,
        "latency_ms": {
            "p50": round(percentile([v * 1000 for v in latencies], 50), 1),
            "p99": round(percentile([v * 1000 for v in latencies], 99), 1),
            "max": round(max(latencies) * 1000, 1) if latencies else None,
            "calm_p99": round(baseline, 1) if baseline else None,
            "send_lag_p99": round(percentile(lags, 99), 1),
            "recovered_bound": round(bound, 1) if baseline else None,
        },
        "faults": judged,
        "fault_kinds": dict(Counter(f["kind"] for f in faults)),
        "windows": wins,
        "memory": memory,
        "unexpected_exits": sampler.exits,
        "invariants": invariants,
        "ok": all(v["ok"] for v in invariants.values()),
    }


def _memory(config: SoakConfig, sampler: Any) -> dict[str, Any]:
    """Each process life's RSS series and verdict, and Redis's ``used_memory``."""
    slack = config.memory_slack_mib * analysis.MIB
    processes: dict[str, list[dict[str, Any]]] = {}
    for name, series in sorted(sampler.rss.items()):
        for pid, points in analysis.incarnations(series):
            born = points[0][0]
            # A process started with the run warms up with it; one restarted by a fault, from its start.
            from_s = born + config.warmup_s
            if name == "redis-server":  # it holds every result for result_expires_s
                from_s = max(from_s, config.redis_warmup_s)
            verdict = analysis.memory_verdict(points, from_s, config.memory_ratio, slack)
            if name == "producer":
                verdict.update(judged=False, flat=None)  # it keeps every request's record by design
            processes.setdefault(name, []).append(
                {"pid": pid, "samples": [[t, v] for t, v in points], **verdict}
            )
    redis_verdict = analysis.memory_verdict(
        sampler.redis_used, config.redis_warmup_s, config.memory_ratio, slack
    )
    return {
        "processes": processes,
        "redis_used_memory": {"samples": [[t, v] for t, v in sampler.redis_used], **redis_verdict},
    }


def _invariants(
    counts: dict[str, Any], faults: list[dict[str, Any]], memory: dict[str, Any], exits: list[Any]
) -> dict[str, dict[str, Any]]:
    def rule(ok: bool, detail: str) -> dict[str, Any]:
        return {"ok": bool(ok), "detail": detail}

    growing = [
        f"{name} (pid {life['pid']}): +{life['growth_mib']} MiB"
        for name, lives in memory["processes"].items()
        for life in lives
        if life["judged"] and not life["flat"]
    ]
    redis_mem = memory["redis_used_memory"]
    if redis_mem["judged"] and not redis_mem["flat"]:
        growing.append(f"redis used_memory: +{redis_mem['growth_mib']} MiB")
    judged_lives = sum(1 for lives in memory["processes"].values() for life in lives if life["judged"])
    late = [
        f"{f['target']} at {f['at_s']:.0f}s: {f['verdict']}"
        for f in faults
        if f["verdict"] not in ("recovered", "overlapped")
    ]
    refused = sum(counts["refused_at_send"].values())
    return {
        "none_lost": rule(
            counts["lost"] == 0 and counts["left_queued"] == 0 and counts["left_in_flight"] == 0,
            f"{counts['lost']} accepted requests never answered; {counts['left_queued']} queued and "
            f"{counts['left_in_flight']} in flight after the drain",
        ),
        "answers_right": rule(counts["wrong_result"] == 0, f"{counts['wrong_result']} wrong results"),
        "failures_named": rule(
            not counts["failed_unnamed"] and refused == 0,
            f"unnamed failures {counts['failed_unnamed']}; sends given up {counts['refused_at_send']}",
        ),
        "answered_once": rule(
            counts["reread_changed"] == 0 and counts["reread_missing"] == 0,
            f"{counts['reread_changed']} results changed and {counts['reread_missing']} vanished between "
            f"two reads; {counts['rejected_writes']} second runs refused by write-once",
        ),
        "processes_ride_through": rule(not exits, f"{len(exits)} processes exited without being killed"),
        "memory_flat": rule(
            not growing and judged_lives > 0,
            "; ".join(growing) or f"{judged_lives} process lives and Redis judged flat",
        ),
        "p99_recovers": rule(
            not late and any(f["verdict"] == "recovered" for f in faults),
            "; ".join(late) or f"{sum(f['verdict'] == 'recovered' for f in faults)} faults recovered in time",
        ),
    }


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    """``soak.json`` and ``soak.png`` in ``out_dir``; the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        from carpool.tools.soak.plot import plot_soak

        report["plot"] = str(plot_soak(report, out_dir / "soak.png"))
    except Exception as exc:  # a plot failure must not lose the numbers
        report["plot_error"] = repr(exc)
    path = out_dir / "soak.json"
    path.write_text(json.dumps(report, indent=1))
    return path
