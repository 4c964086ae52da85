"""Client CPU of the coordinator's Redis calls: through redis-py's command path, and packed on a
connection the calling thread holds (``carpool.redis_edge.lua.HeldScript``), as the store sends them.

    python scripts/coordinator_call_cost.py [--calls 3000] [--rounds 3]

On an embedded redis-server: a take that finds no request (with this coordinator's reports asked
for), a wait that ends at once followed by that take (``BLMOVE`` on a list holding an element, then
the take: a pipeline without a transaction, against ``HeldScript.after``), and a dispatch of one
batch of 32 request ids with a 6.6 KB batch message (none of the ids in flight, so the script only
pushes the message). This thread's CPU per call, least of ``--rounds``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import redis

from carpool.redis_edge import lua
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.store import RequestStore
from carpool.tools.embedded import EmbeddedRedis


def cpu_us(call: Callable[[], Any], calls: int, rounds: int) -> float:
    for _ in range(200):  # connections, script cache, allocator
        call()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, (time.thread_time() - start) / calls * 1e6)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url(0))
        store = RequestStore(client, Keys("carpool.requests"), 30.0)
        held = lua.ThreadConnections(client)
        take = lua.HeldScript(store._take, held)
        dispatch = lua.HeldScript(store._dispatch, held)
        client.rpush("waited", "x")  # a wait on it ends at once (BLMOVE rotates it onto itself)
        take_keys, take_args = store._take_call(64, "me", 1000)
        blmove = ("BLMOVE", "waited", "waited", "RIGHT", "RIGHT", 0.1)
        ids = [f"{i:036d}" for i in range(32)]
        message = b"x" * 6600
        dispatch_keys = [store.keys.inflight_lease, store.keys.inflight_owner, "batches"]
        dispatch_args: list[Any] = [store.lease_ms, "", b"", "batch-1", len(ids), *ids, message]

        def wait_then_take_pipeline() -> Any:
            with client.pipeline(transaction=False) as pipe:
                pipe.blmove("waited", "waited", 0.1, "RIGHT", "RIGHT")  # type: ignore[arg-type]
                pipe.evalsha(store._take.sha, len(take_keys), *take_keys, *take_args)
                return pipe.execute(raise_on_error=False)

        def trim() -> None:
            client.ltrim("batches", 0, 0)

        rows = [
            (
                "take, nothing to take",
                lambda: store._take(keys=take_keys, args=take_args),
                lambda: take(take_keys, take_args),
            ),
            (
                "wait, then take",
                wait_then_take_pipeline,
                lambda: take.after(blmove, take_keys, take_args),
            ),
            (
                "dispatch of one batch",
                lambda: store._dispatch(keys=dispatch_keys, args=dispatch_args),
                lambda: dispatch(dispatch_keys, dispatch_args),
            ),
        ]
        print(f"client CPU µs per call, least of {args.rounds} rounds of {args.calls}")
        print(f"{'':24s} {'redis-py':>9s} {'held':>9s}")
        for name, through_redis_py, on_held in rows:
            plain = cpu_us(through_redis_py, args.calls, args.rounds)
            trim()
            packed = cpu_us(on_held, args.calls, args.rounds)
            trim()
            print(f"{name:24s} {plain:9.1f} {packed:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
