"""Requests held by the coordinator until their eta (``countdown=`` / ``eta=``), then batched.

A pure object on the coordinator's monotonic clock. Held requests stay in flight in Redis, leased by
the coordinator like those in the policy, so a coordinator that dies returns them to the request
queue and the next one holds them again until the same eta (the message keeps its absolute eta).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection

from carpool.batching import Request


class Deferred:
    """Requests not to be batched before their due time, soonest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._seq = itertools.count()  # ties keep arrival order, and Requests are never compared

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request: Request, due_s: float) -> None:
        """Hold ``request`` until ``due_s`` (coordinator clock)."""
        heapq.heappush(self._heap, (due_s, next(self._seq), request))

    def next_due_s(self) -> float | None:
        """When the soonest held request comes due; None when none is held."""
        return self._heap[0][0] if self._heap else None

    def due(self, now_s: float) -> list[Request]:
        """Remove and return the requests due at ``now_s``, soonest first."""
        out: list[Request] = []
        while self._heap and self._heap[0][0] <= now_s:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def discard(self, ids: Collection[str]) -> list[Request]:
        """Remove and return the held requests whose id is in ``ids`` (they were revoked)."""
        kept = [entry for entry in self._heap if entry[2].id not in ids]
        if len(kept) == len(self._heap):
            return []
        gone = [entry[2] for entry in self._heap if entry[2].id in ids]
        heapq.heapify(kept)
        self._heap = kept
        return gone

    def drain(self) -> list[Request]:
        """Remove and return every held request (shutdown hands them back)."""
        out = [entry[2] for entry in sorted(self._heap)]
        self._heap = []
        return out
