"""Redis ``WAIT``: a write is relied on only once ``CARPOOL_WAIT_REPLICAS`` replicas have it.

Redis replicates asynchronously, so a failover can promote a replica that lacks the master's latest
writes. ``WAIT numreplicas timeout`` blocks the connection that wrote until that many replicas
acknowledged everything it wrote, so it must run on the same connection, after the writes: each
helper here sends the writes and the WAIT in one pipeline (one connection, one round trip). WAIT
is refused inside MULTI and Lua (it would return at once), hence the explicit MULTI ... EXEC, WAIT.

Replicas apply the master's writes in order, so WAIT after any write of our own also covers every
write the master applied before it, from any connection: :func:`fence` uses that for writes made on
someone else's connection (kombu's publish).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError, ResponseError

from carpool.errors import NotReplicated

FENCE_CHANNEL = "carpool:replication-fence"  # a PUBLISH here is a write no one reads


def transaction_then_wait(
    client: redis.Redis, queue: Callable[[Any], None], replicas: int, timeout_s: float
) -> tuple[list[Any], int]:
    """Run the commands ``queue(pipe)`` adds in one MULTI/EXEC, then WAIT for ``replicas``.

    Returns (the EXEC replies, the replicas that acknowledged). Raises the first error among the
    commands, as a transactional pipeline does (nothing of the transaction applied on a queueing
    error; the rest applied on a runtime error). Scripts must not be queued (no NOSCRIPT reload).
    """
    with client.pipeline(transaction=False) as pipe:
        pipe.execute_command("MULTI")  # type: ignore[no-untyped-call]
        queue(pipe)
        count = len(pipe)
        pipe.execute_command("EXEC")  # type: ignore[no-untyped-call]
        pipe.execute_command("WAIT", replicas, _wait_ms(timeout_s))  # type: ignore[no-untyped-call]
        replies = pipe.execute(raise_on_error=False)
    for reply in replies[1:count]:
        if isinstance(reply, ResponseError):
            raise reply
    executed, acked = replies[count], replies[count + 1]
    if isinstance(executed, Exception):
        raise executed
    for reply in executed:
        if isinstance(reply, ResponseError):
            raise reply
    return list(executed), int(acked)


def script_then_wait(
    client: redis.Redis,
    script: Script,
    keys: Sequence[Any],
    args: Sequence[Any],
    replicas: int,
    timeout_s: float,
) -> tuple[Any, int]:
    """``script(keys, args)`` then WAIT for ``replicas``: (the script's reply, replicas that acked).

    A server that lacks the script (a promoted replica after a failover, or a restarted one) is
    sent it and asked again, as ``Script.__call__`` does.
    """
    for attempt in range(2):
        with client.pipeline(transaction=False) as pipe:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.execute_command("WAIT", replicas, _wait_ms(timeout_s))  # type: ignore[no-untyped-call]
            reply, acked = pipe.execute(raise_on_error=False)
        if isinstance(reply, NoScriptError) and attempt == 0:
            script.sha = client.script_load(script.script)
            continue
        if isinstance(reply, Exception):
            raise reply
        return reply, int(acked)
    raise AssertionError("unreachable")


def fence(client: redis.Redis, replicas: int, timeout_s: float) -> int:
    """WAIT for ``replicas`` to have every write the master applied before this call, from any
    connection; returns how many acknowledged."""
    with client.pipeline(transaction=False) as pipe:
        pipe.publish(FENCE_CHANNEL, b"")
        pipe.execute_command("WAIT", replicas, _wait_ms(timeout_s))  # type: ignore[no-untyped-call]
        _, acked = pipe.execute()
    return int(acked)


def not_replicated(what: str, acked: int, replicas: int, timeout_s: float) -> NotReplicated:
    """The producer's error for ``what`` (a phrase) acknowledged by only ``acked`` replicas."""
    return NotReplicated(
        f"{what} reached the Redis master, but only {acked} of CARPOOL_WAIT_REPLICAS={replicas} "
        f"replicas confirmed it within CARPOOL_WAIT_TIMEOUT_S={timeout_s:g}; it will run unless the "
        "master fails first. Check the replicas (INFO replication), raise CARPOOL_WAIT_TIMEOUT_S, or "
        "lower CARPOOL_WAIT_REPLICAS"
    )


def _wait_ms(timeout_s: float) -> int:
    return max(1, round(timeout_s * 1000))  # WAIT 0 would block forever
