"""Where a lone request's time goes: ``.delay().get()`` one at a time on the ``null`` model, per hop.

    python scripts/light_latency.py [--requests 300] [--pause-ms 20] [--rounds 1] [--no-trace]
                                    [--set CARPOOL_X=value ...] [--json out.json]

One coordinator and one worker (``carpool.tools.harness``, an embedded redis-server), the ``null``
model; ``--requests`` calls of ``infer.delay(short text).get()``, each after a pause, so every
request finds the coordinator and the worker idle. With tracing (the default) the coordinator and
the worker import ``scripts/hoptrace.py``, which timestamps each hop on one clock, and the report
gives each hop's median and p99 over the requests:

    send -> c_wake       .delay()'s LPUSH reaches Redis, whose reply to the coordinator's BLMOVE wakes it
                         (the last wake before the take: a wait that Redis, idle, let overrun is timed
                         out by the request's first command and takes nothing)
    c_wake -> c_taken    the take script (requests into flight); run in Redis behind the wait, it is
                         done when the coordinator wakes (both marks at once)
    c_taken -> c_planned decoding, intake and the policy's decision
    c_planned -> w_wake  the dispatch script (batch message LPUSH), then the worker's BRPOP reply wakes it
    w_wake -> w_task     Celery's consumer: message, strategy, request, the solo pool calls the task
    w_task -> w_claimed  the claim script
    w_claimed -> w_ran   the model and the outcome bookkeeping
    w_ran -> w_finish    on to the finish (the Finisher thread's wake-up, when it is on)
    w_finish -> p_result the finish script (results SET + PUBLISH), then the producer's pub/sub wakes
    p_result -> got      ``.get()`` returns the value

Side figures: ``.delay()`` alone (send -> sent), the dispatch and finish scripts' own round trips.
``--set`` passes settings to the coordinator and worker (A/B runs); run it from another checkout's
tree (``PYTHONPATH=/tmp/main python scripts/light_latency.py``) to measure that tree's service with
the same probe. ``--rounds`` repeats the whole run (a fresh stack each time) and reports each round.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TEXT = "The quick brown fox jumps over the lazy dog."
CHAIN = (
    "send",
    "c_wake",
    "c_taken",
    "c_planned",
    "w_wake",
    "w_task",
    "w_claimed",
    "w_ran",
    "w_finish",
    "p_result",
    "got",
)
SIDE = (("send", "sent"), ("c_dispatch", "c_dispatched"), ("w_finish", "w_finished"))
WARM_UP = 20


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_round(args: argparse.Namespace, overrides: dict[str, str]) -> dict[str, Any]:
    import hoptrace

    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings
    from carpool.tools.bench.procstat import process_cpu_s
    from carpool.tools.harness import Harness, release_result_consumer

    trace_dir = tempfile.mkdtemp(prefix="hoptrace-")
    env = {
        "CARPOOL_MODEL": "null",
        "CARPOOL_MODELS": "null",
        "CARPOOL_METRICS_PORT": "0",
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(HERE)) if p),
    }
    if not args.no_trace:
        env |= {"CARPOOL_IMPORTS": "hoptrace", "CARPOOL_HOPTRACE_DIR": trace_dir}
    env |= overrides
    marks: list[tuple[str, int]] = []  # this process's hops, kept in memory
    with Harness(loglevel="warning") as harness:
        harness.start_stack(1, **env)
        app = create_app(
            load_settings(
                broker_url=harness.broker_url,
                result_backend=harness.result_backend,
                model="null",
                models=["null"],
            )
        )
        import carpool.tasks  # noqa: F401  (registers carpool.infer on every app)

        infer = app.tasks["carpool.infer"]
        try:
            for _ in range(WARM_UP):
                infer.delay(TEXT).get(timeout=30)
            if not args.no_trace:
                hoptrace.open_trace(trace_dir)
                hoptrace.install_producer()
            pause_s = args.pause_ms / 1000
            pids = {**harness.pids(), "producer": os.getpid()}
            cpu_before = {name: process_cpu_s(pid) for name, pid in pids.items()}
            for _ in range(args.requests):
                time.sleep(pause_s)
                t0 = time.perf_counter_ns()
                result = infer.delay(TEXT)
                t1 = time.perf_counter_ns()
                result.get(timeout=30)
                t2 = time.perf_counter_ns()
                marks += [("send", t0), ("sent", t1), ("got", t2)]
            cpu_us = {
                name: 1e6 * (process_cpu_s(pid) - cpu_before[name]) / args.requests
                for name, pid in pids.items()
            }
        finally:
            release_result_consumer(app)
        load = os.getloadavg()
    traced = [] if args.no_trace else read_traces(Path(trace_dir))
    report = analyse(marks, traced, load)
    report["cpu_us_per_request"] = cpu_us
    return report


def read_traces(directory: Path) -> list[tuple[str, int]]:
    out = []
    for path in directory.glob("*.trace"):
        for line in path.read_text().splitlines():
            hop, ns = line.split()
            out.append((hop, int(ns)))
    return out


def analyse(
    marks: list[tuple[str, int]], traced: list[tuple[str, int]], load: tuple[float, ...]
) -> dict[str, Any]:
    """Per request (between its send and its got): each hop's first time after the previous hop."""
    events = sorted(marks + traced, key=lambda e: e[1])
    sends = [t for hop, t in marks if hop == "send"]
    gots = [t for hop, t in marks if hop == "got"]
    totals = [(g - s) / 1e6 for s, g in zip(sends, gots, strict=True)]
    hops: dict[str, list[float]] = {}
    side: dict[str, list[float]] = {}
    i = 0
    for start, end in zip(sends, gots, strict=True):
        while i < len(events) and events[i][1] < start:
            i += 1
        window: list[tuple[str, int]] = []
        j = i
        while j < len(events) and events[j][1] <= end:
            window.append(events[j])
            j += 1
        if traced:
            at: dict[str, int] = {}
            previous = start
            for hop in CHAIN:
                t = next((t for h, t in window if h == hop and t >= previous), None)
                if t is None:
                    break
                at[hop] = previous = t
            if len(at) == len(CHAIN):
                # The wake that took the request: an earlier one (a wait Redis timed out when the
                # request's first command woke it) took nothing.
                at["c_wake"] = max(t for h, t in window if h == "c_wake" and t <= at["c_taken"])
                for a, b in itertools.pairwise(CHAIN):
                    hops.setdefault(f"{a} -> {b}", []).append((at[b] - at[a]) / 1e6)
        for a, b in SIDE:
            ta = next((t for h, t in window if h == a), None)
            tb = next((t for h, t in window if h == b and ta is not None and t >= ta), None)
            if ta is not None and tb is not None:
                side.setdefault(f"{a} -> {b}", []).append((tb - ta) / 1e6)
    return {
        "requests": len(totals),
        "load_average": load,
        "round_trip_ms": summary(totals),
        "hops_ms": {k: summary(v) for k, v in hops.items()},
        "side_ms": {k: summary(v) for k, v in side.items()},
    }


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": statistics.median(values),
        "p90": quantile(values, 0.90),
        "p99": quantile(values, 0.99),
        "mean": statistics.fmean(values),
    }


def show(report: dict[str, Any]) -> None:
    rt = report["round_trip_ms"]
    load = ", ".join(f"{x:.2f}" for x in report["load_average"])
    n = report["requests"]
    print(f"round trip, {n} requests: p50 {rt['p50']:.2f} ms, p99 {rt['p99']:.2f} ms (load {load})")
    cpu = ", ".join(f"{name} {us:.0f}" for name, us in report["cpu_us_per_request"].items())
    print(f"  CPU per request (us, the producer's pause included): {cpu}")
    for title, table in (("hop", report["hops_ms"]), ("side", report["side_ms"])):
        if not table:
            continue
        print(f"  {title:<24} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
        for name, s in table.items():
            figures = " ".join(f"{s[k]:>8.3f}" for k in ("p50", "p90", "p99", "mean"))
            print(f"  {name:<24} {s['n']:>4} {figures}")
    if report["hops_ms"]:
        p50_sum = sum(s["p50"] for s in report["hops_ms"].values())
        print(f"  sum of hop medians {p50_sum:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--pause-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-trace", action="store_true", help="round trips only, no hop timestamps")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a setting for both")
    parser.add_argument("--json", help="also write the reports here")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    overrides = dict(kv.split("=", 1) for kv in args.set)
    reports = []
    for n in range(args.rounds):
        report = one_round(args, overrides)
        report["settings"] = overrides
        reports.append(report)
        print(f"round {n + 1}/{args.rounds}")
        show(report)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
