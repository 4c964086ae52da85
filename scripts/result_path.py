"""CPU per result of carpool's result path alone: the worker storing, Redis, the producer gathering.

    python scripts/result_path.py [--requests 6000] [--dim 384] [--rows numpy|list] [--rounds 3]
                                  [--inbox on|off|both]

Each round: N task ids, marked for this process's result inbox as ``submit_many`` marks them
(``--inbox off``: each subscribed on its own, as with ``CARPOOL_RESULT_INBOX=false``; ``both``:
rounds alternate, each side reported apart); a child process (the worker's part) turns (N/32) model
outputs of ``--dim`` float32 values per row into stored results, 32 at a time, through the result
backend's write-once store (the finish script, results only, each batch also published to the inbox
when there is one); meanwhile this process ``gather``s them. ``--rows numpy`` hands the store the
float32 rows as a model returns them (``MiniLM.forward``); ``list`` converts each batch with
``tolist()`` first, as models did before they returned arrays (that conversion is counted as the
worker's). Reported per result: the worker's CPU (its process), Redis's (``INFO cpu``), the
producer's ``gather`` (this process) with its kernel share and page faults (the results' Python
floats grow this process's heap, and each new page is a fault), and the bytes stored. Least and
median of the rounds; the machine is shared, read CPU, not wall time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import time
import uuid
from typing import Any

from carpool.tools.bench.procstat import redis_cpu_s

BATCH = 32


def _worker(url: str, ids: list[str], dim: int, rows: str, out: Any, inbox: str | None) -> None:
    """Store a result for every id, a batch at a time; put this process's CPU seconds on ``out``."""
    import numpy as np

    from carpool.celery_edge.app import create_app
    from carpool.celery_edge.results import SUCCESS
    from carpool.config import load_settings

    app = create_app(load_settings(broker_url=url, result_backend=url))
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((BATCH, dim)).astype(np.float32)
    batch /= np.linalg.norm(batch, axis=1, keepdims=True)
    app.backend.store_many([(str(uuid.uuid4()), SUCCESS, batch[0].tolist())])  # warm: script loaded
    started = time.process_time()
    for first in range(0, len(ids), BATCH):
        chunk = ids[first : first + BATCH]
        outputs: Any = batch if rows == "numpy" else batch.tolist()
        inboxes = dict.fromkeys(chunk, inbox) if inbox is not None else None
        app.backend.store_many([(t, SUCCESS, outputs[i]) for i, t in enumerate(chunk)], inboxes=inboxes)
    out.put(time.process_time() - started)


def one_round(url: str, n: int, dim: int, rows: str, inbox: bool) -> dict[str, float]:
    import redis
    from celery.result import AsyncResult

    from carpool.celery_edge.app import create_app
    from carpool.celery_edge.inbox import inbox_channel, mark
    from carpool.celery_edge.result_consumer import subscribe_results
    from carpool.config import load_settings
    from carpool.producer.gather import gather

    app = create_app(load_settings(broker_url=url, result_backend=url))
    client = redis.Redis.from_url(url)
    ids = [str(uuid.uuid4()) for _ in range(n)]
    results = [AsyncResult(t, app=app) for t in ids]
    channel = inbox_channel(app) if inbox else None
    if channel is not None:
        mark(results, channel)
    else:
        subscribe_results(app.backend, ids)
    queue: Any = multiprocessing.get_context("fork").Queue()
    redis_before = redis_cpu_s(client)
    worker = multiprocessing.get_context("fork").Process(
        target=_worker, args=(url, ids, dim, rows, queue, channel)
    )
    worker.start()
    started, usage = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    values = gather(results, timeout=120)
    gather_s = time.process_time() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    worker_s = queue.get(timeout=120)
    worker.join()
    redis_s = redis_cpu_s(client) - redis_before
    stored = client.strlen(app.backend.get_key_for_task(ids[0]))
    assert len(values) == n and len(values[0]) == dim
    client.flushdb()
    app.backend.result_consumer.stop()
    return {
        "worker_us": worker_s / n * 1e6,
        "redis_us": redis_s / n * 1e6,
        "gather_us": gather_s / n * 1e6,
        "gather_kernel_us": (after.ru_stime - usage.ru_stime) / n * 1e6,
        "gather_page_faults": (after.ru_minflt - usage.ru_minflt) / n,
        "bytes_per_result": float(stored),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--rows", choices=("numpy", "list"), default="numpy")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inbox", choices=("on", "off", "both"), default="on")
    opts = parser.parse_args()
    modes = {"on": [True], "off": [False], "both": [False, True]}[opts.inbox]

    from carpool.tools.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    rounds: dict[bool, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        for _ in range(opts.rounds):
            for mode in modes:  # alternating, so that a shared machine's swings hit both alike
                r = one_round(server.url(1), opts.requests, opts.dim, opts.rows, mode)
                print(f"round, inbox {'on' if mode else 'off'}:", {k: round(v, 1) for k, v in r.items()})
                rounds[mode].append(r)
    finally:
        server.stop()
    for mode, got in rounds.items():
        print(f"inbox {'on' if mode else 'off'}: {'per result':20s} {'min':>8s} {'median':>8s}")
        for key in got[0]:
            values = [r[key] for r in got]
            print(f"{'':11s}{key:20s} {min(values):8.1f} {statistics.median(values):8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
