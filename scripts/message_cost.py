"""CPU per request of a request message's two ends: the producer building and sending it, the
coordinator decoding and admitting it.

    python scripts/message_cost.py [--requests 20000] [--rounds 5]

On a redis-server of its own: ``submit_many`` of the accelerator bench's mixed texts (the ``null``
model, no result subscription), this process's CPU per request; one ``.delay()``'s message and its
task-sent event as its kept builder makes them (``TaskMessageBuilder.build`` of one call with its
sent-at header, 3,000 times, no I/O); then the coordinator's intake
(``take_in``: decoding each Celery message, binding and validating its arguments, the ``null``
model's lengths, the policy's requests) over the same messages in chunks of 64, as its intake
threads take them. Least and median of ``--rounds``. Run it from two trees to compare them
(``cd $TREE && PYTHONPATH=$TREE python scripts/message_cost.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import orjson
import redis

from carpool.celery_edge.app import create_app
from carpool.celery_edge.task_messages import TaskMessageBuilder
from carpool.config import Settings
from carpool.coordinator.intake import take_in
from carpool.models.task import InferSpec
from carpool.names import SENT_AT_HEADER
from carpool.producer.submit import submit_many
from carpool.redis_edge.keys import Keys
from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.workload import ACCELERATOR_MIX, mixed_texts


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    texts = mixed_texts(args.requests, mix=ACCELERATOR_MIX)
    submit_us: list[float] = []
    delay_us: list[float] = []
    intake_us: list[float] = []
    with EmbeddedRedis() as server:
        settings = Settings(
            broker_url=server.url(0), result_backend=server.url(1), model="null", models=("null",)
        )
        app = create_app(settings)
        client = redis.Redis(port=server.port)
        submit_many(texts[:100], app=app, subscribe=False)  # warm: connections, message template
        specs = {"carpool.infer": InferSpec("carpool.infer")}
        delay_builder = TaskMessageBuilder(
            "carpool.infer",
            app=app,
            queue=settings.request_queue,
            sent_events=True,
            per_build_headers=(SENT_AT_HEADER,),
        )
        one_call = [((texts[0], "null"), {})]
        queue = Keys(settings.request_queue).request_lists[-1]
        for _ in range(args.rounds):
            client.flushall()
            started = time.process_time()
            submit_many(texts, app=app, subscribe=False)
            submit_us.append((time.process_time() - started) / len(texts) * 1e6)
            started = time.process_time()
            for _ in range(3000):
                delay_builder.build(one_call, header_values={SENT_AT_HEADER: time.time()})
            delay_us.append((time.process_time() - started) / 3000 * 1e6)
            raws = client.lrange(queue, 0, -1)
            taken = [(orjson.loads(raw)["headers"]["id"], raw) for raw in raws]
            started = time.process_time()
            for first in range(0, len(taken), 64):
                take_in(
                    taken[first : first + 64],
                    settings=settings,
                    specs=specs,
                    room=len(taken),
                    now=time.monotonic(),
                    wall_now=time.time(),
                )
            intake_us.append((time.process_time() - started) / len(taken) * 1e6)
        app.close()
        client.close()
    print(f"{args.requests} requests, {args.rounds} rounds; CPU µs per request, least / median")
    print(f"producer submit_many   {min(submit_us):6.1f} / {statistics.median(submit_us):6.1f}")
    print(f"one .delay() message   {min(delay_us):6.1f} / {statistics.median(delay_us):6.1f}")
    print(f"coordinator intake     {min(intake_us):6.1f} / {statistics.median(intake_us):6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
