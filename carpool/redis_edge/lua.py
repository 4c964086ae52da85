"""The Lua scripts in ``scripts/<name>.lua``, read from the installed package and registered by name.

Each script documents its KEYS, ARGV and reply in its header; :mod:`carpool.redis_edge.store` is the
only Python that knows those layouts.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import redis
from redis.commands.core import Script


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
