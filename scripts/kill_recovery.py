"""How long a burst takes to be answered when its worker is SIGKILLed mid-burst and restarted at once.

    python scripts/kill_recovery.py [--requests 300] [--kill-at 1.5] [--batch-s 0.2] [--rounds 2]
                                    [--set CARPOOL_X=value ...] [--json out.json]

One coordinator and one worker (``carpool.tools.harness``, an embedded redis-server) serve
``kill_recovery.sleepy``, a ``@batched`` task (``scripts/kill_recovery_tasks.py``) whose batches of
up to 16 sleep ``--batch-s`` each, whatever their size. ``--requests`` items are sent at once with
``submit_many``; ``--kill-at`` seconds later the worker is SIGKILLed (no fault of its requests) and
started again at once, as a supervisor would. The report gives, per round: when every request was
answered, how many were claimed by the worker at the kill, and how many were counted as having died
with it (the peak of ``inflight:deaths``; each runs alone afterwards). Every answer is checked.

The leases are short (``CARPOOL_RECOVERY_TIMEOUT_S=2``) so that recovery, not the lease, dominates.
To measure another checkout's tree, run it from that tree's folder (``cd /tmp/main &&
PYTHONPATH=$PWD python /path/to/scripts/kill_recovery.py``): the processes it starts import carpool
from the current folder first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def one_round(args: argparse.Namespace, overrides: dict[str, str]) -> dict[str, Any]:
    import redis

    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from carpool.redis_edge.keys import Keys
    from carpool.tools.harness import Harness, release_result_consumer

    env = {
        "CARPOOL_MODEL": "null",
        "CARPOOL_MODELS": "null",
        "CARPOOL_METRICS_PORT": "0",
        "CARPOOL_IMPORTS": "kill_recovery_tasks",
        "CARPOOL_MAX_WAIT_S": "0.2",
        "CARPOOL_RECOVERY_TIMEOUT_S": "2",
        "KILL_RECOVERY_BATCH_S": str(args.batch_s),
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(HERE)) if p),
    } | overrides
    keys = Keys("carpool.requests")
    with Harness(loglevel="warning") as harness:
        harness.start_stack(1, wait=True, **env)
        app = create_app(
            load_settings(
                broker_url=harness.broker_url,
                result_backend=harness.result_backend,
                imports=["kill_recovery_tasks"],
            )
        )
        sys.path.insert(0, str(HERE))
        import kill_recovery_tasks

        client = redis.Redis.from_url(harness.broker_url)
        peak_deaths = [0]
        done = threading.Event()

        def watch_deaths() -> None:
            while not done.wait(0.02):
                peak_deaths[0] = max(peak_deaths[0], client.hlen(keys.inflight_deaths))

        watcher = threading.Thread(target=watch_deaths, daemon=True)
        items = [f"item-{i}" for i in range(args.requests)]
        try:
            t0 = time.monotonic()
            results = submit_many(items, task=kill_recovery_tasks.sleepy, app=app)
            watcher.start()
            time.sleep(args.kill_at)
            claimed = max(0, client.hlen(keys.inflight_claimed) - 1)  # less the field that keeps it a table
            harness.crash_restart("worker0")
            got = gather(results, timeout=300)
            answered_s = time.monotonic() - t0
        finally:
            done.set()
            release_result_consumer(app)
            client.close()
    wrong = sum(g != i.upper() for i, g in zip(items, got, strict=True))
    return {
        "answered_s": round(answered_s, 2),
        "claimed_at_kill": claimed,
        "counted_deaths": peak_deaths[0],
        "wrong": wrong,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--kill-at", type=float, default=1.5, help="seconds after the submit")
    parser.add_argument("--batch-s", type=float, default=0.2, help="what each batch sleeps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="CARPOOL_X=value")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    rounds = []
    for i in range(args.rounds):
        report = one_round(args, overrides)
        rounds.append(report)
        print(f"round {i + 1}: {json.dumps(report)}", flush=True)
    times = [r["answered_s"] for r in rounds]
    print(f"answered in {min(times):.1f}-{max(times):.1f} s (median {statistics.median(times):.1f})")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rounds": rounds}))
    if any(r["wrong"] for r in rounds):
        sys.exit("some answers were wrong")


if __name__ == "__main__":
    main()
