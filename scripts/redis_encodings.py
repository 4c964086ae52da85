"""How Redis stores carpool's in-flight keys, and what a small key's flat encoding costs.

    python scripts/redis_encodings.py probe [--profile v100]   # encodings and sizes over a bench burst
    python scripts/redis_encodings.py micro [--batches 3000]   # flat list against hash table / skiplist

``probe`` runs ``carpool bench --accelerator PROFILE --pipeline 0 --light 0`` and, while its
redis-server is up, reads every key's type, ``OBJECT ENCODING`` and length every ~20 ms (result
keys left out), then prints each key's encodings (how many reads saw each) and its median and
largest length. Redis keeps a hash or sorted set of up to 128 entries of up to 64 bytes as one flat
list (``listpack``; ``ziplist`` before 7.0) that every read and write scans end to end.

``micro`` measures Redis's own CPU (``INFO cpu``) per request of a batch cycle on a key that holds
about 100 request ids (three batches of 32 resident, one more coming and the oldest going, as in a
burst): a hash (HSET 32, HMGET 32, HDEL 32: the owner hash's dispatch, claim and ack) and a sorted
set (ZADD 32, ZMSCORE 32 twice, ZREM 32: the lease set's take, dispatch, claim and ack), each as
Redis stores it by default and kept a table by one long entry (what carpool does for the owner and
claimed hashes: ``keep_as_table`` in ``carpool/redis_edge/scripts/_chunked.lua``). On an embedded
redis-server (as the tests start one).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from typing import Any

import redis

from carpool.tools.bench.procstat import child_redis_port, redis_cpu_s
from carpool.tools.embedded import EmbeddedRedis

LONG = "x" * 100  # past the 64-byte limit of a flat entry: the key becomes a table and stays one


def probe(profile: str) -> int:
    command = [sys.executable, "-m", "carpool", "bench", "--accelerator", profile, "--pipeline", "0"]
    command += ["--light", "0", "--out", "/tmp/redis-encodings-bench"]
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port = None
    while port is None and bench.poll() is None:
        port = child_redis_port(bench.pid)
        time.sleep(0.05)
    seen: dict[tuple[int, str, str], Counter[str]] = defaultdict(Counter)
    sizes: dict[tuple[int, str, str], list[int]] = defaultdict(list)
    lengths = {"hash": "hlen", "zset": "zcard", "list": "llen", "set": "scard"}
    while port is not None and bench.poll() is None:
        for db in (0, 1):
            client: Any = redis.Redis(port=port, db=db)
            try:
                for key in client.scan_iter(count=1000):
                    if key.startswith(b"celery-task-meta"):
                        continue
                    kind = client.type(key).decode()
                    encoding = client.object("encoding", key)
                    length = getattr(client, lengths[kind])(key) if kind in lengths else 0
                    name = (db, key.decode(errors="replace")[:60], kind)
                    seen[name][(encoding or b"-").decode()] += 1
                    sizes[name].append(int(length))
            except redis.RedisError:
                break  # the bench stopped its server
        time.sleep(0.02)
    for name, encodings in sorted(seen.items()):
        got = sizes[name]
        print(f"{name}: {dict(encodings)}  length median {statistics.median(got):.0f}, max {max(got)}")
    return bench.wait()


def _cycle(
    client: Any, key: str, kind: str, table: bool, batches: int, resident: int = 3
) -> tuple[float, str]:
    client.delete(key)
    if table:
        if kind == "hash":
            client.hset(key, "", LONG)
        else:
            client.zadd(key, {LONG: float("inf")})
    ids = [[str(uuid.uuid4()) for _ in range(32)] for _ in range(batches + resident)]
    pipe = client.pipeline(transaction=False)

    def add(b: int) -> None:
        if kind == "hash":
            pipe.hset(key, mapping={i: "b" * 36 for i in ids[b]})
        else:
            pipe.zadd(key, {i: 1_700_000_000_000 + b for i in ids[b]})

    for b in range(resident):
        add(b)
    pipe.execute()
    before = redis_cpu_s(client)
    for b in range(resident, batches + resident):
        add(b)
        if kind == "hash":
            pipe.hmget(key, ids[b - 1])
            pipe.hdel(key, *ids[b - resident])
        else:
            pipe.zmscore(key, ids[b - 1])
            pipe.zmscore(key, ids[b - 2])
            pipe.zrem(key, *ids[b - resident])
        if b % 50 == 0:
            pipe.execute()
    pipe.execute()
    encoding = (client.object("encoding", key) or b"-").decode()
    return (redis_cpu_s(client) - before) / (batches * 32) * 1e6, encoding


def micro(batches: int, rounds: int) -> int:
    with EmbeddedRedis() as server:
        client: Any = redis.Redis.from_url(server.url())
        print(f"redis {client.info('server')['redis_version']}; Redis CPU µs per request, {rounds} rounds:")
        for kind in ("hash", "zset"):
            for table in (False, True):
                figures = [_cycle(client, "k", kind, table, batches) for _ in range(rounds)]
                us = sorted(f for f, _ in figures)
                label = "kept a table" if table else "as Redis stores it"
                median = statistics.median(us)
                print(f"  {kind} {label:20s} ({figures[0][1]}): least {us[0]:.2f}, median {median:.2f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--profile", default="v100")
    m = sub.add_parser("micro")
    m.add_argument("--batches", type=int, default=3000)
    m.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    return probe(args.profile) if args.what == "probe" else micro(args.batches, args.rounds)


if __name__ == "__main__":
    raise SystemExit(main())
