"""A coordinator's counters and gauges in Redis, which ``carpool status`` and the demo read.

Counters are added to one hash, so several coordinators sum up. Each write sends this run's
running totals and ``stats.lua`` adds what changed since the totals it last applied for this run: a
write whose reply was lost, sent again by the client's retry or followed by the next write, adds
nothing twice. Gauges (what this coordinator holds now) go to a hash of its own that expires
unless rewritten, listed in the coordinators ZSET: a reader sums the live coordinators' gauges, and a
dead coordinator's drop out.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from carpool.redis_edge import lua, reply_text
from carpool.redis_edge.keys import SERVES_FIELD, Keys

log = logging.getLogger(__name__)

GAUGES_TTL_S = 10  # a coordinator's gauges outlive its last write by this long
COORDINATORS_KEPT_S = 86_400  # a name stays listed this long after its last write (its own clock)
# Why a taken request went back to the request queue: its coordinator stopped and handed it back, or
# a reap returned it after its holder's lease ran out (the holder died or lost Redis).
REQUEUE_REASONS = ("shutdown", "lease_expired")


def serving(default_model: str, models: Iterable[str], tasks: Iterable[str]) -> str:
    """What a coordinator serves, as one comparable text: peers that differ answer a request
    differently (another default model) or refuse it (a task or model only some serve)."""
    return f"model={default_model} models={','.join(sorted(models))} tasks={','.join(sorted(tasks))}"


@dataclass(slots=True)
class CoordinatorStats:
    taken: int = 0
    batches: int = 0
    dispatched: int = 0
    padded_tokens: int = 0
    real_tokens: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    # put back on the request queue, by why (REQUEUE_REASONS): each such request is taken again
    requeued: Counter[str] = field(default_factory=Counter)
    flush: Counter[str] = field(default_factory=Counter)
    sizes: Counter[int] = field(default_factory=Counter)
    # CPU of the tasks' prepare calls (infer: tokenization), on whichever thread ran them, and the
    # values prepared: a benchmark reads tokenization's share of the coordinator's CPU from these.
    prepare_cpu_ns: int = 0
    prepared: int = 0


class StatsWriter:
    """Writes :class:`CoordinatorStats` to the shared counters hash and the gauges of coordinator
    ``hostname`` to its own hash, one pipeline per write."""

    def __init__(
        self,
        client: Any,
        keys: Keys,
        hostname: str,
        wall: Callable[[], float],
        serves: str = "",
    ) -> None:
        self.client = client
        self.keys = keys
        #: what this coordinator serves (:func:`serving`), in its gauges for its peers and status
        self.serves = serves
        self.hostname = hostname
        self.wall = wall
        self._gauges_key = keys.gauges_of(hostname)
        # A name of this run's own: a coordinator restarted under the same hostname counts anew.
        self._applied_key = keys.stats_applied_of(f"{hostname}:{uuid.uuid4().hex[:12]}")
        self._add_totals = lua.register(client, "stats")
        self._written: dict[str, int] = {}
        # The counts last written: the coordinator's own, which go on counting (a shutdown's hand-back).
        self._stats: CoordinatorStats | None = None
        self._depth_keys: set[tuple[str, str]] = set()
        self._span_fields: set[str] = set()

    def write(
        self,
        stats: CoordinatorStats,
        depths: Mapping[tuple[str, str], int],
        gauges: Mapping[str, int],
        task_of: Callable[[str], str] | None = None,
        spans: Mapping[tuple[str, str], str] | None = None,
    ) -> None:
        """``depths``: requests waiting per (routing key, bin); a bin that emptied is written as 0.
        ``task_of``: the task of a routing key (written as ``task:<key>``, for ``carpool status``).
        ``spans``: the token lengths each automatic bin (``b0``...) holds now, per (routing key,
        bin), written as ``span:<key>:<bin>``."""
        self._stats = stats
        counters = _counters(stats)
        values: dict[str, int | str] = dict(gauges)
        if self.serves:
            values[SERVES_FIELD] = self.serves
        for key in self._depth_keys - set(depths):
            values[f"depth:{key[0]}:{key[1]}"] = 0
        self._depth_keys |= set(depths)
        values.update({f"depth:{m}:{b}": n for (m, b), n in depths.items()})
        if task_of is not None:
            values.update({f"task:{m}": task_of(m) for m in {m for m, _ in self._depth_keys}})
        span_fields = {f"span:{m}:{b}": span for (m, b), span in (spans or {}).items()}
        values.update(span_fields)
        # A refit that fitted fewer bins leaves labels without a span: their fields go.
        gone = self._span_fields - set(span_fields)
        now_ms = int(self.wall() * 1000)
        with self.client.pipeline(transaction=False) as pipe:
            self._add_moved(pipe, counters)
            pipe.hset(self._gauges_key, mapping=values)
            if gone:
                pipe.hdel(self._gauges_key, *sorted(gone))
            pipe.expire(self._gauges_key, GAUGES_TTL_S)
            # Kept while this run writes, moving or idle: gone, its next totals would count again.
            pipe.expire(self._applied_key, COORDINATORS_KEPT_S)
            pipe.zadd(self.keys.coordinators, {self.hostname: now_ms})
            pipe.zremrangebyscore(self.keys.coordinators, "-inf", now_ms - COORDINATORS_KEPT_S * 1000)
            pipe.execute()
        self._written = counters
        self._span_fields = set(span_fields)

    def _add_moved(self, pipe: Any, counters: dict[str, int]) -> None:
        """Queue on ``pipe`` the totals that moved since the last write known to have applied."""
        totals = [
            x
            for name, value in counters.items()
            if value != self._written.get(name, 0)
            for x in (name, value)
        ]
        if totals:
            self._add_totals(
                keys=[self.keys.stats, self._applied_key],
                args=[COORDINATORS_KEPT_S, *totals],
                client=pipe,
            )

    def peers_serving_otherwise(self) -> dict[str, str]:
        """The live coordinators of this request queue that serve otherwise than this one, and
        what they serve: the same request is then answered by another model's default, or refused
        by some of them only."""
        listed = map(reply_text, self.client.zrange(self.keys.coordinators, 0, -1))
        peers = [name for name in listed if name != self.hostname]
        if not peers:
            return {}
        with self.client.pipeline(transaction=False) as pipe:
            for name in peers:
                pipe.hget(self.keys.gauges_of(name), SERVES_FIELD)
            found = pipe.execute()
        return {
            name: reply_text(serves)
            for name, serves in zip(peers, found, strict=True)
            if serves is not None and reply_text(serves) != self.serves
        }

    def leave(self) -> None:
        """Withdraw this coordinator's gauges now (it holds nothing any more), not at their expiry,
        after adding what the counts last written counted since (the requests the shutdown handed
        back)."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                if self._stats is not None:
                    # Added before this run's applied totals are deleted, in the same pipeline.
                    self._add_moved(pipe, _counters(self._stats))
                pipe.delete(self._gauges_key, self._applied_key)
                pipe.zrem(self.keys.coordinators, self.hostname)
                pipe.execute()
        except redis.RedisError as exc:
            log.info("could not withdraw this coordinator's gauges (they expire on their own): %s", exc)


def _counters(stats: CoordinatorStats) -> dict[str, int]:
    """The stats hash's fields and this run's totals of them."""
    counters: dict[str, int] = {
        "taken": stats.taken,
        "batches": stats.batches,
        "dispatched": stats.dispatched,
        "padded_tokens": stats.padded_tokens,
        "real_tokens": stats.real_tokens,
        "prepare_cpu_ns": stats.prepare_cpu_ns,
        "prepared": stats.prepared,
    }
    counters.update({f"flush:{k}": v for k, v in stats.flush.items()})
    counters.update({f"failed:{k}": v for k, v in stats.failed.items()})
    counters.update({f"requeued:{k}": v for k, v in stats.requeued.items()})
    counters.update({f"size:{k}": v for k, v in stats.sizes.items()})
    return counters
