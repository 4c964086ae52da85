"""What ``CARPOOL_WAIT_REPLICAS`` costs a producer: ``.delay()`` latency and ``submit_many`` rate.

    python scripts/wait_cost.py [--delays 2000] [--batches 20] [--batch-size 1000] [--json out.json]

A master and one replica (``--replicaof``) on loopback; for WAIT 0 and 1 in turn, ``--delays``
calls of ``infer.delay(text)`` one after another (the direct publish: one MULTI/EXEC, plus the WAIT
in the same round trip), then ``--batches`` calls of ``submit_many`` with ``--batch-size`` texts
each. Only the producer runs (no coordinator): the figures are the publish's own cost. Each setting
runs ``--rounds`` times alternately and the report keeps each figure's median round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def measure(app: Any, texts: list[str], delays: int, batches: int, batch_size: int) -> dict[str, float]:
    from carpool.producer.submit import submit_many

    task = app.tasks["carpool.infer"]
    latencies = []
    for i in range(delays):
        t0 = time.perf_counter()
        task.delay(texts[i % len(texts)], model="toy")
        latencies.append(time.perf_counter() - t0)
    latencies.sort()
    t0 = time.perf_counter()
    for b in range(batches):
        chunk = [texts[(b * batch_size + i) % len(texts)] for i in range(batch_size)]
        submit_many(chunk, model="toy", app=app, subscribe=False)
    elapsed = time.perf_counter() - t0
    return {
        "delay_p50_ms": 1000 * latencies[len(latencies) // 2],
        "delay_p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
        "submit_many_per_s": batches * batch_size / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delays", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()

    import carpool.tasks  # noqa: F401  (registers carpool.infer on every app)
    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings
    from carpool.tools.embedded import EmbeddedRedis
    from carpool.tools.harness import release_result_consumer
    from carpool.tools.workload import mixed_texts

    texts = mixed_texts(1000, seed=3)
    rounds: dict[int, list[dict[str, float]]] = {0: [], 1: []}
    with EmbeddedRedis() as master, EmbeddedRedis(replica_of=master.port) as replica:
        import redis

        with redis.Redis(port=replica.port) as r:
            while r.info("replication").get("master_link_status") != "up":
                time.sleep(0.05)
        apps = {
            n: create_app(
                load_settings(
                    broker_url=master.url(0), result_backend=master.url(1), wait_replicas=n, models="toy"
                )
            )
            for n in rounds
        }
        for _ in range(args.rounds):
            for n, app in apps.items():
                with redis.Redis(port=master.port) as r:
                    r.flushall()
                rounds[n].append(measure(app, texts, args.delays, args.batches, args.batch_size))
        for app in apps.values():
            release_result_consumer(app)
    report = {
        "setup": "redis-server master + 1 replica on loopback, producer only",
        "rounds": args.rounds,
        **{
            f"wait_replicas_{n}": {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
            for n, runs in rounds.items()
        },
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
