"""Redis CPU per request of the coordinator's take, whole and in parts, on a redis-server of its own.

    python scripts/take_cost.py [--requests 20000] [--count 32]

Queues ``--requests`` real ``carpool.infer`` messages (``submit_many`` of the accelerator bench's
mixed texts), then drains them ``--count`` at a time with three scripts, twice each, and prints
Redis's own CPU (INFO cpu) per request: ``rpop``, the pop and the reply alone (the floor of any
take that hands the messages over); ``rpop+hset``, plus keeping each raw message in a hash (what
crash recovery needs); ``take``, carpool's ``take.lua`` (also the task id found in each message,
the lease set and any origin recorded). On an embedded redis-server (as the tests start one).
"""

from __future__ import annotations

import argparse

import redis

from carpool.celery_edge.app import create_app
from carpool.config import Settings
from carpool.producer.submit import submit_many
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.lua import source
from carpool.redis_edge.store import RequestStore
from carpool.tools.bench.procstat import redis_cpu_s
from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.workload import ACCELERATOR_MIX, mixed_texts

_RPOP = "local got = redis.call('RPOP', KEYS[#KEYS], ARGV[1]) or {}\nreturn {got, {}}"
_RPOP_HSET = """local got = redis.call('RPOP', KEYS[#KEYS], ARGV[1]) or {}
local pairs_ = {}
for i, raw in ipairs(got) do pairs_[#pairs_ + 1] = redis.sha1hex(raw); pairs_[#pairs_ + 1] = raw end
if #pairs_ > 0 then redis.call('HSET', KEYS[2], unpack(pairs_)) end
return {got, {}}"""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--count", type=int, default=32, help="requests per take")
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url(0))
        settings = Settings(
            broker_url=server.url(0), result_backend=server.url(1), model="null", models=("null",)
        )
        keys = Keys(settings.request_queue)
        base = keys.request_lists[-1]
        submit_many(
            mixed_texts(args.requests, mix=ACCELERATOR_MIX), app=create_app(settings), subscribe=False
        )
        messages = client.lrange(base, 0, -1)
        print(
            f"{len(messages)} messages, {sum(map(len, messages)) / len(messages):.0f} bytes each on average"
        )
        # The take's own KEYS and ARGV, as the coordinator sends them (no reports).
        take_keys, take_args = RequestStore(client, keys, 30.0)._take_call(args.count, None, 0)
        for name, text in (("rpop", _RPOP), ("rpop+hset", _RPOP_HSET), ("take", source("take"))):
            sha = client.script_load(text)
            for _ in range(2):
                client.delete(base, keys.inflight_lease, keys.inflight_raw, keys.inflight_origin)
                for first in range(0, len(messages), 1000):
                    client.lpush(base, *reversed(messages[first : first + 1000]))
                before = redis_cpu_s(client)
                while client.evalsha(sha, len(take_keys), *take_keys, *take_args)[0]:
                    pass
                per_request_us = (redis_cpu_s(client) - before) / len(messages) * 1e6
                print(f"{name:10s} Redis CPU {per_request_us:5.2f} µs per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
