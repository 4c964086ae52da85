"""A batch as its claim found it: which requests are still this batch's, which are answered already,
which this worker heard revoked, which are left to run.

The worker's claim (:meth:`~carpool.gpu_worker.runtime.WorkerRuntime._claim`) answers a flag per
request; :func:`claimed_batch` sorts the batch message's requests by those flags into a :class:`ClaimedBatch`,
the value that the Celery thread hands to whichever thread runs the batch and stores its outcomes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import TaskRevokedError

from carpool.celery_edge import compat
from carpool.celery_edge.events import TaskEvents
from carpool.celery_edge.results import REVOKED
from carpool.wire import BatchMessage, Links, RequestSlot

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ClaimedBatch:
    """A batch claimed on the Celery thread, to be run and stored on whichever thread completes it."""

    batch: BatchMessage
    task_id: str | None  # of its carpool.run_batch task
    t0: float  # perf_counter when that task started
    events: TaskEvents  # this batch's own buffer
    batches_queued: int | None  # batch messages queued behind it when claimed (None: not counted)
    ack_ids: list[str] = field(default_factory=list)  # every request claimed: acknowledged at the end
    answered: list[str] = field(default_factory=list)  # claimed, answered already: not run again
    to_run: list[RequestSlot] = field(default_factory=list)  # run if within their deadline
    entries: list[tuple[str, str, Any]] = field(default_factory=list)  # outcomes: (id, state, value)
    linked: dict[str, Links] = field(default_factory=dict)  # callbacks, chains, error callbacks
    inboxes: dict[str, str] = field(default_factory=dict)  # request id -> its producer's result inbox
    ran_s: float | None = None  # how long its run took (a split one's included); None: none ran
    claimed_at: float = 0.0  # perf_counter of its claim: a batch that waited long is claimed again


def claimed_batch(
    batch: BatchMessage,
    flags: Sequence[int],
    batches_queued: int | None,
    task_id: str | None,
    t0: float,
    events: TaskEvents,
) -> ClaimedBatch:
    """``batch`` sorted by its claim's ``flags`` (per request: 0 another batch's now, 1 claimed and to
    run, 2 claimed and answered already): acknowledged, revoked (answered REVOKED) or to run."""
    requests = batch["requests"]
    claimed = ClaimedBatch(batch, task_id, t0, events, batches_queued)
    revoked = compat.revoked_ids()
    revoked_ids = revoked if len(revoked) else None  # Celery's remote control fills it
    for r, flag in zip(requests, flags, strict=True):
        if flag == 0:  # another batch's now
            continue
        claimed.ack_ids.append(r["id"])
        if flag != 1:  # answered already (a rerun after recovery, or revoked since it was batched)
            claimed.answered.append(r["id"])
            continue
        if "links" in r:
            claimed.linked[r["id"]] = r["links"]
        if "inbox" in r:
            claimed.inboxes[r["id"]] = r["inbox"]
        if revoked_ids is not None and r["id"] in revoked_ids:
            claimed.entries.append((r["id"], REVOKED, TaskRevokedError("revoked")))
        else:
            claimed.to_run.append(r)
    if len(claimed.ack_ids) < len(requests):
        log.info(
            "batch %s: %d of %d requests now belong elsewhere; skipped",
            batch["id"],
            len(requests) - len(claimed.ack_ids),
            len(requests),
        )
    return claimed
