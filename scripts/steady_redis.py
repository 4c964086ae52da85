"""Redis's CPU per request under a steady open-loop stream, with the lease set's size and encoding.

    python scripts/steady_redis.py [--rate 2500] [--seconds 6] [--model sim-v100]

Starts a stack (one coordinator, one worker serving ``--model``, an embedded redis-server), warms
it with 300 requests, then sends the accelerator bench's mixed texts through ``submit_many`` in
chunks of 10 at ``--rate`` per second for ``--seconds``, and ``gather``s them. Prints Redis's own
CPU (``INFO cpu``) per request over the stream and, sampled every 25 chunks, how many leases the
lease set held (median, largest) and how Redis stored it. Under a steady stream the in-flight keys
stay small, unlike in a burst; compare trees by running it from each (``PYTHONPATH=$TREE``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

from carpool.celery_edge.app import create_app
from carpool.config import load_settings
from carpool.producer.gather import gather
from carpool.producer.submit import submit_many
from carpool.redis_edge.keys import Keys
from carpool.tools.bench.procstat import redis_cpu_s
from carpool.tools.harness import Harness, release_result_consumer
from carpool.tools.workload import ACCELERATOR_MIX, mixed_texts

WARM = 300
CHUNK = 10


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=2500.0)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--model", default="sim-v100")
    args = parser.parse_args()
    with Harness(loglevel="warning") as harness:
        harness.start_stack(1, CARPOOL_MODEL=args.model, CARPOOL_MODELS=args.model)
        settings = load_settings(
            broker_url=harness.broker_url,
            result_backend=harness.result_backend,
            model=args.model,
            models=(args.model,),
        )
        app = create_app(settings)
        try:
            n = int(args.rate * args.seconds)
            texts = mixed_texts(n + WARM, seed=3, mix=ACCELERATOR_MIX)
            gather(submit_many(texts[:WARM], app=app), timeout=60)
            client: Any = harness.redis_client()
            lease = Keys(settings.request_queue).inflight_lease
            sizes: list[int] = []
            encodings: Counter[str] = Counter()
            results = []
            cpu_before = redis_cpu_s(client)
            start = time.monotonic()
            for k, first in enumerate(range(WARM, WARM + n, CHUNK)):
                pause = start + k * CHUNK / args.rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                results += submit_many(texts[first : first + CHUNK], app=app)
                if k % 25 == 0:
                    sizes.append(int(client.zcard(lease)))
                    encodings[(client.object("encoding", lease) or b"-").decode()] += 1
            gather(results, timeout=120)
            cpu = redis_cpu_s(client) - cpu_before
            took = time.monotonic() - start
        finally:
            release_result_consumer(app)
            app.close()
    print(
        f"{n} requests at {args.rate:.0f}/s ({took:.1f} s): Redis {cpu / n * 1e6:.1f} µs per request; "
        f"leases held median {statistics.median(sizes):.0f}, largest {max(sizes)}; "
        f"stored as {dict(encodings)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
