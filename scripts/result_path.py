"""CPU per result of carpool's result path alone: the worker storing, Redis, the producer gathering.

    python scripts/result_path.py [--requests 6000] [--dim 384] [--rows numpy|list] [--rounds 3]
                                  [--inbox on|off|both] [--gather list|array|both]

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
floats grow this process's heap, and each new page is a fault), one full garbage collection right
after it (what the next one costs with the results held: Python lists of floats are walked, arrays
are not), and the bytes stored. ``--gather array``: ``gather(..., as_array=True)``; ``both``: rounds
alternate between it and the list. Least and median of the rounds; the machine is shared, read CPU,
not wall time.
"""

from __future__ import annotations

import argparse
import gc
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


def one_round(url: str, n: int, dim: int, rows: str, inbox: bool, as_array: bool) -> dict[str, float]:
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
    gc.collect()  # the round before left garbage in cycles (its AsyncResults): not this round's cost
    redis_before = redis_cpu_s(client)
    worker = multiprocessing.get_context("fork").Process(
        target=_worker, args=(url, ids, dim, rows, queue, channel)
    )
    worker.start()
    started, usage = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    values = gather(results, timeout=120, as_array=as_array)
    gather_s = time.process_time() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    collected = time.process_time()
    gc.collect()
    collect_s = time.process_time() - collected
    worker_s = queue.get(timeout=120)
    worker.join()
    redis_s = redis_cpu_s(client) - redis_before
    stored = client.strlen(app.backend.get_key_for_task(ids[0]))
    assert len(values) == n and len(values[0]) == dim
    del values  # the next round starts without them
    client.flushdb()
    app.backend.result_consumer.stop()
    return {
        "worker_us": worker_s / n * 1e6,
        "redis_us": redis_s / n * 1e6,
        "gather_us": gather_s / n * 1e6,
        "gather_kernel_us": (after.ru_stime - usage.ru_stime) / n * 1e6,
        "gather_page_faults": (after.ru_minflt - usage.ru_minflt) / n,
        "collect_after_us": collect_s / n * 1e6,
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
    parser.add_argument("--gather", choices=("list", "array", "both"), default="list")
    opts = parser.parse_args()
    inboxes = {"on": [True], "off": [False], "both": [False, True]}[opts.inbox]
    arrays = {"list": [False], "array": [True], "both": [False, True]}[opts.gather]
    modes = [(inbox, as_array) for inbox in inboxes for as_array in arrays]

    from carpool.tools.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    rounds: dict[tuple[bool, bool], list[dict[str, float]]] = {m: [] for m in modes}
    try:
        for _ in range(opts.rounds):
            for mode in modes:  # alternating, so that a shared machine's swings hit both alike
                r = one_round(server.url(1), opts.requests, opts.dim, opts.rows, *mode)
                print(f"round, {_label(mode)}:", {k: round(v, 1) for k, v in r.items()})
                rounds[mode].append(r)
    finally:
        server.stop()
    for mode, got in rounds.items():
        print(f"{_label(mode)}: {'per result':20s} {'min':>8s} {'median':>8s}")
        for key in got[0]:
            values = [r[key] for r in got]
            print(f"{'':11s}{key:20s} {min(values):8.1f} {statistics.median(values):8.1f}")
    return 0


def _label(mode: tuple[bool, bool]) -> str:
    inbox, as_array = mode
    return f"inbox {'on' if inbox else 'off'}, gather {'as_array' if as_array else 'list'}"


if __name__ == "__main__":
    raise SystemExit(main())
