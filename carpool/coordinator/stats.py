"""A coordinator's counters and gauges in a Redis hash, which ``carpool status`` and the demo read.

Counters are added (HINCRBY of what changed since the last write), so several coordinators sum up;
gauges are the writer's own view.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CoordinatorStats:
    taken: int = 0
    batches: int = 0
    dispatched: int = 0
    padded_tokens: int = 0
    real_tokens: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    flush: Counter[str] = field(default_factory=Counter)
    sizes: Counter[int] = field(default_factory=Counter)


class StatsWriter:
    """Writes :class:`CoordinatorStats` and gauges to the hash ``key``, one pipeline per write."""

    def __init__(self, client: Any, key: str) -> None:
        self.client = client
        self.key = key
        self._written: dict[str, int] = {}
        self._depth_keys: set[tuple[str, str]] = set()

    def write(
        self, stats: CoordinatorStats, depths: Mapping[tuple[str, str], int], gauges: Mapping[str, int]
    ) -> None:
        """``depths``: requests waiting per (model, bin); a bin that emptied is written as 0."""
        counters: dict[str, int] = {
            "taken": stats.taken,
            "batches": stats.batches,
            "dispatched": stats.dispatched,
            "padded_tokens": stats.padded_tokens,
            "real_tokens": stats.real_tokens,
        }
        counters.update({f"flush:{k}": v for k, v in stats.flush.items()})
        counters.update({f"failed:{k}": v for k, v in stats.failed.items()})
        counters.update({f"size:{k}": v for k, v in stats.sizes.items()})
        values = dict(gauges)
        for key in self._depth_keys - set(depths):
            values[f"depth:{key[0]}:{key[1]}"] = 0
        self._depth_keys |= set(depths)
        values.update({f"depth:{m}:{b}": n for (m, b), n in depths.items()})
        with self.client.pipeline(transaction=False) as pipe:
            for name, value in counters.items():
                delta = value - self._written.get(name, 0)
                if delta:
                    pipe.hincrby(self.key, name, delta)
            pipe.hset(self.key, mapping=values)
            pipe.execute()
        self._written = counters
