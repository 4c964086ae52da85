"""CPU per request of a GPU worker's work after the forward, in one process on a local Redis.

    python scripts/worker_store_cost.py [--batches 60] [--rounds 8] [--dim 384]

Per batch of 32 float32 rows (seeded unit vectors, as ``sim-h100`` returns them), the steps a worker
runs after its model, each timed in thread CPU: ``rows`` (the model's array split into the rows to
store), ``events`` (task-started and task-succeeded per request plus the batch's own, encoded into
one message), ``metas`` (each request's Celery result meta) and ``finish`` (the finish script:
results stored and published, acknowledgements, report and events, one round trip, no replicas).
Reported per request: the least of ``--rounds`` rounds of ``--batches`` batches, so that another
process's load on a shared machine inflates it as little as it can. Runs against any checkout (it
uses what each has): run it from two trees to compare them.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
import uuid
from functools import partial
from typing import Any

BATCH = 32
STEPS = ("rows", "events", "metas", "finish")


def measure(url: str, batches: int, rounds: int, dim: int) -> dict[str, float]:
    import numpy as np
    import redis

    from carpool.celery_edge.app import create_app
    from carpool.celery_edge.events import TaskEvents
    from carpool.celery_edge.results import SUCCESS
    from carpool.config import load_settings
    from carpool.gpu_worker.runner import output_rows
    from carpool.redis_edge.keys import Keys
    from carpool.redis_edge.store import RequestStore

    settings = load_settings(broker_url=url, result_backend=url)
    app = create_app(settings)
    client = redis.Redis.from_url(url)
    store = RequestStore(client, Keys("cost.requests"), 30.0)
    events = TaskEvents(app, "cost@host", client=client)
    outputs = np.random.default_rng(0).standard_normal((BATCH, dim)).astype(np.float32)
    outputs /= np.linalg.norm(outputs, axis=1, keepdims=True)
    # How the worker splits a forward's array for its result serializer (a checkout from before
    # output_rows took one splits it the same way whatever the serializer).
    split = partial(output_rows, serializer=getattr(settings, "result_serializer", "json"))
    if "serializer" not in inspect.signature(output_rows).parameters:
        split = output_rows
    report: dict[str, Any] = {"batch_id": "b", "size": BATCH, "run_s": 0.001, "done_at": time.time()}

    def one_batch(spent: list[float]) -> None:
        ids = [str(uuid.uuid4()) for _ in range(BATCH)]
        batch_events = events.fork()
        array = outputs.copy()  # a forward's fresh array
        t0 = time.thread_time()
        entries = [(i, SUCCESS, row) for i, row in zip(ids, split(array), strict=True)]
        t1 = time.thread_time()
        batch_events.started(ids)
        if hasattr(batch_events, "outcomes"):
            batch_events.outcomes(entries, 0.001)
        else:  # a checkout from before TaskEvents.outcomes
            for task_id, _, row in entries:
                batch_events.succeeded(task_id, row, 0.001)
        batch_events.succeeded("batch", report, 0.002, limit=1024)
        published = batch_events.take()
        t2 = time.thread_time()
        writes = app.backend.store_args(entries)
        t3 = time.thread_time()
        store.finish(
            results_db=0,
            broker_db=0,
            writes=writes,
            ack_ids=ids,
            report=report,
            coordinator="cost",
            events=published,
        )
        t4 = time.thread_time()
        for i, (start, end) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            spent[i] += end - start

    for _ in range(20):  # scripts loaded, connections open, caches warm
        one_batch([0.0] * len(STEPS))
    best = [float("inf")] * len(STEPS)
    for _ in range(rounds):
        spent = [0.0] * len(STEPS)
        for _ in range(batches):
            one_batch(spent)
        best = [min(b, s / batches / BATCH * 1e6) for b, s in zip(best, spent, strict=True)]
        client.flushdb()
    return dict(zip(STEPS, best, strict=True))


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dim", type=int, default=384)
    opts = parser.parse_args()
    from carpool.tools.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        cost = measure(server.url(0), opts.batches, opts.rounds, opts.dim)
    steps = " ".join(f"{k} {v:.2f}" for k, v in cost.items())
    print(f"{steps} | total {sum(cost.values()):.2f} µs per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
