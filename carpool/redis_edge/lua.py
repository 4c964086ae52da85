"""The Lua scripts in ``scripts/<name>.lua``, read from the installed package and registered by name.

Each script documents its KEYS, ARGV and reply in its header; :mod:`carpool.redis_edge.store` is the
only Python that knows those layouts.
"""

from __future__ import annotations

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
    """One connection of ``client``'s pool per thread, taken on the thread's first call and kept."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._conn: Any = None

    def get(self) -> Any:
        """This thread's connection (never released to the pool: the thread keeps it)."""
        if self._conn is None:
            self._conn = self.client.connection_pool.get_connection()
        return self._conn


class HeldScript:
    """A script that each calling thread runs on its own connection (:class:`ThreadConnections`).

    For the scripts a worker runs once per batch with a batch's results in their arguments: redis-py's
    command path (a pool checkout that probes the socket, a retry wrapper, instrumentation, and the
    arguments converted and packed once more) costs a worker more CPU per batch than sending the
    results does. Here the call is packed into one buffer by hiredis and written to the thread's
    connection. It behaves as calling the :class:`~redis.commands.core.Script`: NOSCRIPT loads the
    script and sends the call again, and a connection that fails is reconnected and the call sent once
    more (the one retry carpool's clients make); the connection's own health check still runs.
    """

    def __init__(self, script: Script, connections: ThreadConnections) -> None:
        self.script = script
        self._connections = connections

    def __call__(self, keys: Sequence[str | bytes], args: Sequence[str | bytes | int]) -> Any:
        conn = self._connections.get()
        packed = self._packed(keys, args)
        loaded = reconnected = False
        while True:
            try:
                conn.send_packed_command((packed,))
                return conn.read_response()
            except NoScriptError:  # a restarted or flushed server: load it, then send again
                if loaded:
                    raise
                loaded = True
                self.script.sha = self._connections.client.script_load(self.script.script)
                packed = self._packed(keys, args)
            except (redis.ConnectionError, redis.TimeoutError):
                conn.disconnect()  # the next send reconnects
                if reconnected:
                    raise
                reconnected = True

    def _packed(self, keys: Sequence[str | bytes], args: Sequence[str | bytes | int]) -> bytes:
        call = ("EVALSHA", self.script.sha, len(keys), *keys, *args)
        packed: bytes = hiredis.pack_command(call)  # type: ignore[arg-type]  # its stub says a 1-tuple
        return packed
