"""How much work the worker pool can take now, and whether a request may still start: pure rules
shared by the coordinator, the worker and the simulator."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# The most batches queued per worker when full batches leave by predicted time (``prefetch_s``):
# a bound for a model whose batches are predicted to take next to no time.
MAX_QUEUED_PER_WORKER = 16


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the policy needs to know about the pool at one instant."""

    free_workers: int  # workers with nothing to run
    free_slots: int  # batches that may be cut now (idle workers plus prefetch slots)
    ahead_s: float  # predicted work already queued per worker, seconds
    queue_room: int = 0  # batches that may still be queued while ahead_s is short of prefetch_s


def free_workers(workers: int, outstanding_batches: int) -> int:
    """Workers with nothing to run: outstanding batches occupy workers before prefetch slots."""
    return max(0, workers - outstanding_batches)


def pool_capacity(workers: int, prefetch_batches: int, outstanding_predicted_s: Iterable[float]) -> Capacity:
    """Outstanding batches occupy workers first, then each worker's ``prefetch_batches`` slots.

    Keeping a worker's next batch queued removes the hand-off gap between batches, while never
    cutting batches long before anyone can take them (they would stop filling for nothing).
    """
    predicted = list(outstanding_predicted_s)
    busy = len(predicted)
    ahead_s = sum(predicted) / workers if busy and workers else 0.0
    return Capacity(
        free_workers=free_workers(workers, busy),
        free_slots=max(0, workers * (1 + prefetch_batches) - busy),
        ahead_s=ahead_s,
        queue_room=max(0, workers * MAX_QUEUED_PER_WORKER - busy),
    )


def may_start(deadline_s: float, start_s: float) -> bool:
    """A request runs only if its deadline has not passed when a worker starts its batch."""
    return deadline_s >= start_s
