"""The Lua scripts in ``scripts/<name>.lua``, read from the installed package and registered by name.

Each script documents its KEYS, ARGV and reply in its header; :mod:`carpool.redis_edge.store` is the
only Python that knows those layouts.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Sequence
from functools import cache
from importlib.resources import files
from typing import Any

import hiredis
import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError


def register(client: redis.Redis, name: str) -> Script:
    """Script ``name`` on ``client``: called, it runs by EVALSHA (loading itself on a cache miss)."""
    return client.register_script(source(name))


@cache
def source(name: str) -> str:
    """The text of ``scripts/<name>.lua``, after the helpers every script may use (``_chunked.lua``)."""
    return _read(PRELUDE) + _read(name)


PRELUDE = "_chunked"


def _read(name: str) -> str:
    return (files("carpool.redis_edge") / "scripts" / f"{name}.lua").read_text(encoding="utf-8")


class ThreadConnections(threading.local):
    """One connection of ``client``'s pool per thread, taken on the thread's first call and kept
    until the thread ends (or this object goes), then given back to the pool."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._held: _Held | None = None

    def get(self) -> Any:
        """This thread's connection, dropped first if the pool would drop it on release: under
        Sentinel, one to a master that was replaced. A process forked from one that held it takes
        a connection of its own."""
        if _ENDED:
            _give_back_ended()
        held = self._held
        if held is None or held.pid != os.getpid():
            if held is not None:
                held.pool = None  # the parent's: not this process's to give back
            pool = self.client.connection_pool
            held = self._held = _Held(pool, pool.get_connection())
        elif not held.pool.owns_connection(held.conn):
            held.conn.disconnect()
            held.conn.connect()  # as the pool's checkout does: under Sentinel, to the master named now
        return held.conn


class _Held:
    """A thread's connection. Python drops a thread's ``threading.local`` values when the thread
    ends (all of them when the ``ThreadConnections`` goes), and then this connection is queued to go
    back to its pool, so that threads that come and go (a coordinator run in an application's
    thread, restarted) do not use up the pool. Queued, not released here: the garbage collector may
    run this while the same thread is inside the pool's code, holding its lock."""

    __slots__ = ("conn", "pid", "pool")

    def __init__(self, pool: Any, conn: Any) -> None:
        self.pool, self.conn, self.pid = pool, conn, os.getpid()

    def __del__(self) -> None:
        if self.pool is not None and self.pid == os.getpid():
            _ENDED.append((self.pool, self.conn))


# Connections of threads that ended, given back to their pools by the next get() on any thread.
_ENDED: collections.deque[tuple[Any, Any]] = collections.deque()


def _give_back_ended() -> None:
    while True:
        try:
            pool, conn = _ENDED.popleft()
        except IndexError:  # another thread emptied it meanwhile
            return
        with contextlib.suppress(Exception):  # a pool closed meanwhile: nothing to give back to
            pool.release(conn)


class HeldScript:
    """A script that each calling thread runs on its own connection (:class:`ThreadConnections`).

    For the scripts on the hot path: a worker's two per batch (a batch's results in their
    arguments), and the coordinator's take, wait and dispatch, which it runs several times per batch.
    redis-py's command path (a pool checkout that probes the socket, a retry wrapper,
    instrumentation, and the arguments converted and packed once more) costs more CPU per call than
    the round trip itself. Here the call is packed into one buffer by hiredis and written to the
    thread's connection. It behaves as calling the :class:`~redis.commands.core.Script`: NOSCRIPT loads the
    script (on that same connection, so on the server that lacked it) and sends the call again, and a
    connection that fails is reconnected and the call sent once more (the one retry carpool's clients
    make); the connection's own health check, and under Sentinel its reconnection to a new master
    after a READONLY reply, still run.
    """

    def __init__(self, script: Script, connections: ThreadConnections) -> None:
        self.script = script
        self._connections = connections

    def __call__(self, keys: Sequence[str | bytes], args: Sequence[str | bytes | int]) -> Any:
        conn = self._connections.get()
        packed = self._packed(keys, args)
        reconnected = False
        for attempt in range(4):  # at most: a reconnection, and a load on each of two servers
            try:
                conn.send_packed_command((packed,))
                return conn.read_response()
            except NoScriptError:  # a restarted, flushed or newly promoted server: load it there
                if attempt == 3:
                    raise
                conn.send_command("SCRIPT", "LOAD", self.script.script)
                conn.read_response()
            except (redis.ConnectionError, redis.TimeoutError):
                conn.disconnect()
                if reconnected or attempt == 3:
                    raise
                reconnected = True
                # Not left to the send, which would reconnect to the same address: under Sentinel a
                # connection asks for the master's address in connect() only.
                conn.connect()
        raise AssertionError("unreachable")

    def after(
        self,
        command: Sequence[str | bytes | int | float],
        keys: Sequence[str | bytes],
        args: Sequence[str | bytes | int],
    ) -> tuple[Any, Any]:
        """Send ``command`` and then this script's call in one write, as a pipeline without a
        transaction does (Redis runs the call the moment ``command`` is answered, a blocking one
        too), and return both replies; a reply that is an error comes back as its exception,
        NOSCRIPT too (a later call of the script loads it). A connection that fails is reconnected
        and both are sent once more, as :meth:`__call__` does."""
        conn = self._connections.get()
        packed = pack_command(command) + self._packed(keys, args)
        for attempt in range(2):
            try:
                conn.send_packed_command((packed,))
                return _reply(conn), _reply(conn)
            except (redis.ConnectionError, redis.TimeoutError):
                conn.disconnect()
                if attempt:
                    raise
                conn.connect()
        raise AssertionError("unreachable")

    def _packed(self, keys: Sequence[str | bytes], args: Sequence[str | bytes | int]) -> bytes:
        return pack_command(("EVALSHA", self.script.sha, len(keys), *keys, *args))


def pack_command(command: Sequence[str | bytes | int | float]) -> bytes:
    """``command`` in Redis's protocol, packed by hiredis, to send as it is."""
    packed: bytes = hiredis.pack_command(tuple(command))  # type: ignore[arg-type]  # its stub: a 1-tuple
    return packed


def _reply(conn: Any) -> Any:
    """The next reply on ``conn``, an error reply as its exception (connection errors raise)."""
    try:
        return conn.read_response()
    except redis.ResponseError as exc:
        return exc
