"""How the coordinator's loop waits: when to ask the policy again, and how to pass the time until then.

A pure object: the loop tells it what happened and the time, and it answers. The policy's answer
changes only with new requests, freed slots or time reaching the wake time of its last plan, so the
policy is asked only then. Between steps the loop waits for whatever can change the plan, in Redis
where it can, so that an idle or saturated coordinator neither burns CPU polling nor reacts late.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

BUSY_POLL_S = 0.002  # poll interval while requests wait for a partial batch, or when Redis cannot block
# Redis times a blocking command out from its event loop, which an otherwise idle server runs every
# 1/hz = 0.1 s, so a wait that must end on time (a deadline, a partial batch's wait) sleeps locally.
REDIS_TIMEOUT_GRAIN_S = 0.1
FORCED_POLL_S = 0.1  # the policy is asked at least this often, so that no missed change stalls it
MIN_BLOCK_S = 0.001  # Redis's timeout resolution; a zero timeout would block forever


class WaitFor(Enum):
    """A Redis list whose next element ends a wait early."""

    REPORTS = "reports"  # this coordinator's batch reports: a worker freed up
    REQUESTS = "requests"  # the default-priority request list: work arrived
    INTAKE = "intake"  # not a list: the intake stage finished a chunk (a local wait)


@dataclass(frozen=True, slots=True)
class Wait:
    """How long to wait before the next step (0: go again at once), and on which list if any."""

    seconds: float
    block_on: WaitFor | None = None

    @property
    def fallback_s(self) -> float:
        """How long to sleep instead when a blocking wait on ``block_on`` cannot be made."""
        return min(self.seconds, BUSY_POLL_S)


GO_ON = Wait(0.0)


class Pacer:
    """Decides when the loop asks the policy again and how it waits between steps."""

    def __init__(self, idle_poll_s: float) -> None:
        self.idle_poll_s = idle_poll_s
        self.can_block = True  # False once Redis turned out to lack BLMOVE (before 6.2)
        self._changed = True  # something happened that the policy's last plan did not know of
        self._wake_at_s: float | None = None
        self._next_poll_s = 0.0

    def changed(self) -> None:
        """New requests, a freed slot or a worker-count change: the policy's last plan is stale."""
        self._changed = True

    def poll_due(self, now: float) -> bool:
        """Whether the policy may answer differently now than at its last poll."""
        return (
            self._changed
            or now >= self._next_poll_s
            or (self._wake_at_s is not None and now >= self._wake_at_s)
        )

    def polled(self, now: float, wake_at_s: float | None) -> None:
        """The policy was asked at ``now`` and its plan wants asking again at ``wake_at_s``."""
        self._changed = False
        self._wake_at_s = wake_at_s
        self._next_poll_s = now + FORCED_POLL_S

    def cannot_block(self) -> None:
        """Redis refused a blocking wait: poll from now on."""
        self.can_block = False

    def next_wait(
        self,
        now: float,
        *,
        full_take: bool,
        held: int,
        all_workers_busy: bool,
        next_eta_s: float | None = None,
        intake_busy: bool = False,
        queued_s: float = 0.0,
    ) -> Wait:
        """How to wait after a step whose take came back ``full_take`` (as many requests as it may
        take at once) or not, with ``held`` requests in the policy and, at ``next_eta_s``, the soonest
        request held for its eta coming due.

        - A full take: more may be queued, so go again at once (a shorter one emptied the lists).
        - A deadline, a partial batch's wait or an eta is due within Redis's timeout grain: sleep
          locally.
        - Nothing held: wait for the next request at the default priority (other priorities and
          reports are looked at when the wait times out), or for the next eta, whichever comes first.
          Also with every worker busy: a report frees a slot, but with nothing held no batch could
          take it, and the take that a request wakes reads the reports too.
        - Every worker busy: wait for the next batch report. Arrivals are looked at when the wait
          times out: with no worker free they change at most which batch waits in a prefetch slot.
          With work queued behind what every worker runs (``queued_s``: predicted per worker, not
          started yet, at least ``2 * BUSY_POLL_S``), sleep half of it instead (at most the idle
          poll): the take after it reads every report that came meanwhile and their slots are
          refilled together, one wake and two round trips for several batches rather than for
          each, while the workers run the other half.
        - Otherwise a worker is idle and requests wait for a partial batch to fill: poll briefly.

        While the intake stage prepares chunks (``intake_busy``), a wait ends when a chunk finishes
        instead (its requests may fill a batch for a free worker, or for the room a fast device's
        queue has beyond its slots), or at the plan's wake time; with every worker busy, also after
        ``BUSY_POLL_S``, so that a report waiting in Redis is read by the next step's take.
        """
        if full_take:
            return GO_ON
        wake_at_s = self._wake_at_s
        if next_eta_s is not None and (wake_at_s is None or next_eta_s < wake_at_s):
            wake_at_s = next_eta_s
        until_wake = None if wake_at_s is None else max(0.0, wake_at_s - now)
        block_on: WaitFor | None = None
        if until_wake is not None and until_wake < REDIS_TIMEOUT_GRAIN_S:
            pass
        elif not held:
            block_on = WaitFor.REQUESTS
        elif all_workers_busy:
            block_on = WaitFor.REPORTS
        if intake_busy:
            # Arrivals are taken when the stage runs low, so only a chunk, a report or the plan's
            # time matters.
            seconds = min(self.idle_poll_s, BUSY_POLL_S) if all_workers_busy else self.idle_poll_s
            if until_wake is not None:
                seconds = min(seconds, until_wake)
            return Wait(seconds, WaitFor.INTAKE)
        if block_on is WaitFor.REPORTS and queued_s >= 2 * BUSY_POLL_S:
            seconds = min(self.idle_poll_s, queued_s / 2)
            return Wait(seconds if until_wake is None else min(seconds, until_wake))
        seconds = self.idle_poll_s if block_on is not None else min(self.idle_poll_s, BUSY_POLL_S)
        if until_wake is not None:
            seconds = min(seconds, until_wake)
        if block_on is not None and (not self.can_block or seconds < MIN_BLOCK_S):
            return Wait(min(seconds, BUSY_POLL_S))
        return Wait(seconds, block_on)
