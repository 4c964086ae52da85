"""Per-core cost of each carpool process on the ``null`` model, measured one at a time.

    python scripts/pipeline_components.py [--requests 5000]

1. Producer: ``submit_many`` of N texts (validation, messages, one MULTI/EXEC), CPU per request.
2. Coordinator: the N requests are waiting in Redis; a coordinator in this process (real code, real
   Redis, a fake live worker so it dispatches, reports fed back as a worker would send them) takes,
   decodes, batches and dispatches all of them. CPU per request = its one core's share.
3. Worker: the N requests' batches are waiting in the batch queue; one real ``carpool worker``
   process runs them all (claims, null model, results, acks, reports, events). CPU per request from
   /proc, and the wall time it took.
4. Producer again: ``gather`` of the N results.

Each figure is one core's work for one stage, with nothing else competing, which is what the issue's
"20,000 requests per second through each on one core" asks about. The end-to-end rate on a shared
2-core machine is lower: producer, Redis, coordinator and worker then share two cores
(``carpool bench --model null``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    n = parser.parse_args().requests

    from carpool.embedded import EmbeddedRedis

    server = EmbeddedRedis()
    server.start()
    os.environ.update(
        CARPOOL_BROKER_URL=server.url(0),
        CARPOOL_RESULT_BACKEND=server.url(1),
        CARPOOL_MODEL="null",
        CARPOOL_PREFETCH_BATCHES="64",
        CARPOOL_METRICS_PORT="0",
    )
    import redis

    from carpool.celery_app import app, settings_of
    from carpool.client import gather, submit_many
    from carpool.coordinator.service import Coordinator
    from carpool.demo import release_result_consumer
    from carpool.workload import mixed_texts

    client = redis.Redis.from_url(server.url(0))
    texts = mixed_texts(n, seed=0)
    out: dict[str, float] = {}
    worker = None
    try:
        submit_many(texts[:10], subscribe=False)  # warm: connections, template paths
        client.flushall()

        t = time.process_time()
        results = submit_many(texts, subscribe=False)
        out["producer_submit_us"] = (time.process_time() - t) / n * 1e6

        coordinator = Coordinator(settings_of(app), app)
        for i in range(4):
            coordinator.store.heartbeat(f"stand-in-worker-{i}", 600)
        reports = coordinator.keys.reports_for(coordinator.hostname)
        batches: list[bytes] = []
        t, w = time.process_time(), time.perf_counter()
        while coordinator.stats.dispatched < n:
            coordinator.step()
            if coordinator.outstanding:
                # Stand in for the workers: take the batch messages away, report each batch done.
                with client.pipeline() as pipe:
                    pipe.lrange(settings_of(app).batch_queue, 0, -1)
                    pipe.delete(settings_of(app).batch_queue)
                    got, _ = pipe.execute()
                batches.extend(reversed(got))
                client.lpush(
                    reports,
                    *[json.dumps({"batch_id": b, "model": "null", "padded_tokens": 64, "run_s": 1e-4})
                      for b in coordinator.outstanding],
                )
        out["coordinator_us"] = (time.process_time() - t) / n * 1e6
        out["coordinator_wall_rps"] = n / (time.perf_counter() - w)
        out["batches"] = coordinator.stats.batches
        client.delete(*[k for k in client.keys("carpool:*workers*")])

        # The batches go back, oldest first, for a real worker to run.
        client.rpush(settings_of(app).batch_queue, *reversed(batches))
        worker = subprocess.Popen(
            [sys.executable, "-m", "carpool", "worker", "--loglevel", "warning"],
            env=dict(os.environ),
        )
        backend = app.backend
        keys = [backend.get_key_for_task(r.id) for r in results]
        start_cpu = None
        t0 = None
        while True:
            if worker.poll() is not None:
                raise RuntimeError("the worker exited")
            if start_cpu is None and client.llen(settings_of(app).batch_queue) < len(batches):
                start_cpu, t0 = cpu_seconds(worker.pid), time.perf_counter()  # it started on them
            done = sum(1 for v in backend.client.mget(keys[-50:]) if v is not None)
            if done == min(50, n) and not client.llen(settings_of(app).batch_queue):
                stored = sum(1 for i in range(0, n, 5000) for v in backend.client.mget(keys[i : i + 5000]) if v)
                if stored == n:
                    break
            time.sleep(0.01)
        assert start_cpu is not None and t0 is not None
        out["worker_us"] = (cpu_seconds(worker.pid) - start_cpu) / n * 1e6
        out["worker_wall_rps"] = n / (time.perf_counter() - t0)

        t = time.process_time()
        values = gather(results, timeout=60)
        out["producer_gather_us"] = (time.process_time() - t) / n * 1e6
        assert len(values) == n
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)
        release_result_consumer(app)
        server.stop()
    for key, value in out.items():
        print(f"{key:24s} {value:10.1f}")
    per_core = {k: round(1e6 / v) for k, v in out.items() if k.endswith("_us")}
    print("requests/s on one core:", per_core)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
