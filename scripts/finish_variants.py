"""Redis CPU per result of storing 384-float results: the finish script against plain commands.

    python scripts/finish_variants.py [--batches 200] [--rounds 5] [--serializer json|msgpack]

Per batch of 32 Celery result metas of 384 float32 values (as ``sim-v100`` and MiniLM give them:
~4.8 KB each as JSON, 2,057 bytes as msgpack, the worker's default), with one subscriber reading a
result inbox as a producer does, four ways, alternating:

- ``finish.lua``: carpool's finish script with results and inboxes only (each result SET write-once
  and PUBLISHed on its own channel and its inbox);
- ``lua-args-only``: a script that only receives the same 32 metas and returns (the cost of handing
  them to Lua);
- ``pipe set+2pub``: the same without Lua: a pipeline of ``SET NX EX``, then, for those stored, a
  pipeline of both PUBLISHes (two round trips; write-once decided by the client from the replies);
- ``pipe set+inbox``: as above with only the inbox PUBLISH (what skipping the result channel would
  save; a plain Celery client waiting on that channel would then never hear of its result).

Prints Redis's own CPU (INFO cpu) per result, least and median of ``--rounds``, and this process's
CPU (the subscriber's thread included). On an embedded redis-server, as the tests start one.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import orjson
import redis

from carpool.redis_edge import lua
from carpool.tools.bench.procstat import redis_cpu_s
from carpool.tools.embedded import EmbeddedRedis

BATCH = 32
INBOX_PREFIX = "carpool-inbox."
INBOX = INBOX_PREFIX + "finish-variants"


def _metas(serializer: str) -> list[bytes]:
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((BATCH, 384)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    if serializer == "msgpack":  # as the worker writes them by default (2,057 bytes each)
        from carpool.celery_edge.results import success_msgpack
        from carpool.codec import packb_plain, packb_result

        date = packb_plain("2026-12-02T00:00:00.000000+00:00") or b""
        return [success_msgpack(packb_result(row) or b"", date, str(uuid.uuid4())) for row in rows]
    return [
        b'{"status":"SUCCESS","result":'
        + orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY)
        + b',"traceback":null,"children":[],"date_done":"2026-12-02T00:00:00.000000+00:00","task_id":"'
        + str(uuid.uuid4()).encode()
        + b'"}'
        for row in rows
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--serializer", choices=("json", "msgpack"), default="json", help="the metas' encoding"
    )
    args = parser.parse_args()
    metas = _metas(args.serializer)
    with EmbeddedRedis() as server:
        client = redis.Redis(port=server.port)
        subscriber = redis.Redis(port=server.port).pubsub()
        subscriber.subscribe(INBOX)
        stop = threading.Event()

        def drain() -> None:
            while not stop.is_set():
                while subscriber.get_message(timeout=0.05):
                    pass

        threading.Thread(target=drain, daemon=True).start()
        finish = lua.register(client, "finish")
        args_only = client.register_script("return 1")

        def finish_lua(keys: list[str]) -> None:
            # No links outbox entries (0, due ms): what a batch without links sends.
            tail = ["", 100, 600, "", b"", BATCH, INBOX_PREFIX, *([INBOX] * BATCH), 0, 0]
            finish(keys=keys, args=[BATCH, "", "", 86400, *metas, *tail])

        def lua_args_only(keys: list[str]) -> None:
            args_only(keys=keys, args=metas)

        def pipelined(channels: int) -> Callable[[list[str]], None]:
            def store(keys: list[str]) -> None:
                pipe = client.pipeline(transaction=False)
                for key, meta in zip(keys, metas, strict=True):
                    pipe.set(key, meta, nx=True, ex=86400)
                stored = pipe.execute()
                pipe = client.pipeline(transaction=False)
                for key, meta, ok in zip(keys, metas, stored, strict=True):
                    if ok:
                        if channels == 2:
                            pipe.publish(key, meta)
                        pipe.publish(INBOX, meta)
                pipe.execute()

            return store

        variants = {
            "finish.lua": finish_lua,
            "lua-args-only": lua_args_only,
            "pipe set+2pub": pipelined(2),
            "pipe set+inbox": pipelined(1),
        }
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        results = args.batches * BATCH
        for _ in range(args.rounds):
            for name, store in variants.items():
                client.flushdb()
                batches = [
                    [f"celery-task-meta-{uuid.uuid4()}" for _ in range(BATCH)] for _ in range(args.batches)
                ]
                time.sleep(0.2)
                redis_before, ours_before = redis_cpu_s(client), time.process_time()
                for keys in batches:
                    store(keys)
                time.sleep(0.3)  # the subscriber reads what is left
                figures[name].append(
                    (
                        (redis_cpu_s(client) - redis_before) / results * 1e6,
                        (time.process_time() - ours_before) / results * 1e6,
                    )
                )
        stop.set()
        print(f"{args.rounds} rounds of {args.batches} batches of {BATCH} results of {len(metas[0])} bytes")
        print(
            f"{'us per result':18s} {'Redis least':>12s} {'median':>8s} {'client least':>13s} {'median':>8s}"
        )
        for name, rows in figures.items():
            ours = [r for r, _ in rows]
            theirs = [c for _, c in rows]
            print(
                f"{name:18s} {min(ours):12.1f} {statistics.median(ours):8.1f}"
                f" {min(theirs):13.1f} {statistics.median(theirs):8.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
