"""Every Redis key carpool writes besides Celery's own, named from the request queue.

Deployments that share a Redis db but use different request queues never touch each other's keys
(nor, unless CARPOOL_BATCH_QUEUE names one for both, each other's batch queue).
Every request id below is a Celery task id; an in-flight request has an entry in ``inflight_lease``
and ``inflight_raw``, one in ``inflight_origin`` if it came from a priority list, once dispatched one
in ``inflight_owner``, once claimed one in ``inflight_claimed``; every step that forgets a request
(ack, requeue, reap) deletes it from all of them (:attr:`Keys.inflight`). The owner and claimed
hashes also keep one field, ``''`` (never a request id), whose long value keeps Redis storing them
as hash tables (``_chunked.lua``); so they outlive their last request.
"""

from __future__ import annotations

from dataclasses import dataclass

# kombu's Redis transport emulates priorities with one list per step; a message sent with a non-zero
# priority goes to "<queue>\x06\x16<step>" (kombu.transport.redis: PRIORITY_STEPS, priority sep).
PRIORITY_STEPS = (0, 3, 6, 9)
PRIORITY_SEP = "\x06\x16"


# Stats field: results a worker computed that write-once refused, because the request already had an
# answer (it ran twice: at-least-once execution after a recovery); the first answer stays.
REJECTED_WRITES = "rejected_writes"


SERVES_FIELD = "serves"  # the field of a coordinator's gauges saying what it serves (not a number)
# A coordinator's gauge of its batches dispatched to one batch queue and not yet reported, one per
# queue it dispatches to (0 too): status names a queue with batches waiting that no worker consumes.
OUTSTANDING_ON = "outstanding:"


@dataclass(frozen=True, slots=True)
class Keys:
    request_queue: str
    """The Celery queue ``.delay()`` sends to: a LIST of Celery messages, priority step 0."""

    @property
    def request_lists(self) -> list[str]:
        """The lists `.delay()` writes to, drained first to last.

        carpool gives ``priority=`` its AMQP meaning, higher first; kombu's own Redis consumer serves
        step 0 first, which is why carpool drains these lists itself in reverse step order.
        """
        steps = sorted(PRIORITY_STEPS, reverse=True)
        return [self.request_queue if s == 0 else f"{self.request_queue}{PRIORITY_SEP}{s}" for s in steps]

    @property
    def _base(self) -> str:
        return f"carpool:{self.request_queue}"

    @property
    def inflight_lease(self) -> str:
        """ZSET request id -> lease expiry (ms, Redis clock); past it the request is recovered."""
        return f"{self._base}:inflight:lease"

    @property
    def inflight_raw(self) -> str:
        """HASH request id -> the original Celery message, so a recovery can requeue it verbatim."""
        return f"{self._base}:inflight:raw"

    @property
    def inflight_owner(self) -> str:
        """HASH request id -> batch id (uuid) that currently owns it; a stale batch finds it not its own."""
        return f"{self._base}:inflight:owner"

    @property
    def inflight_claimed(self) -> str:
        """HASH request id -> batch id (uuid) whose worker claimed it. The request is claimed, its lease
        the worker's to renew, only while this equals its owner: a new dispatch supersedes the claim."""
        return f"{self._base}:inflight:claimed"

    @property
    def inflight_deaths(self) -> str:
        """HASH request id -> how many times a worker died running it (its lease ran out while
        claimed). Unlike the in-flight keys it stays when the request is put back, until it is
        answered; it exists only while some request has a death counted."""
        return f"{self._base}:inflight:deaths"

    @property
    def inflight_running(self) -> str:
        """ZSET batch id -> when a worker began running it (ms, the worker's clock), while its device
        runs it and while its results are stored (a dead worker's, until the reap drops it a day
        old): a lease that runs out on a request of such a batch counts as a death
        (:mod:`carpool.redis_edge.marks`)."""
        return f"{self._base}:inflight:running"

    @property
    def links_due(self) -> str:
        """ZSET request id -> when its links are due (ms, Redis clock): the links outbox. A worker
        files a request with links (callbacks, error callbacks, a chain) here as it stores its
        result, and empties the entry once it sent them; an entry a lease old is a dead worker's, and
        a coordinator sends its links (:mod:`carpool.coordinator.outbox`)."""
        return f"{self._base}:links:due"

    @property
    def links_pending(self) -> str:
        """HASH request id -> its outbox entry: its task and links (JSON, as kombu writes them)."""
        return f"{self._base}:links:pending"

    @property
    def links_tries(self) -> str:
        """HASH request id -> how often a coordinator took its outbox entry to send its links: one
        whose links kill or hang each process that sends them (an error callback run in the
        coordinator) is dropped after a few (``outbox.lua``)."""
        return f"{self._base}:links:tries"

    @property
    def inflight_origin(self) -> str:
        """HASH request id -> the priority list it was taken from, so a recovery puts it back there.
        Requests taken from the base list (priority 0, the common case) have no entry."""
        return f"{self._base}:inflight:origin"

    @property
    def inflight(self) -> list[str]:
        """Every key that holds part of a request's in-flight state."""
        return [
            self.inflight_lease,
            self.inflight_raw,
            self.inflight_owner,
            self.inflight_claimed,
            self.inflight_origin,
        ]

    @property
    def dead_letter(self) -> str:
        """LIST of messages that were not carpool requests, with the reason."""
        return f"{self._base}:dead"

    @property
    def revoked(self) -> str:
        """ZSET request id -> when a coordinator heard it revoked (wall clock, s), for the revokes'
        memory of Celery's workers (count and age): a process that starts later learns them here."""
        return f"{self._base}:revoked"

    def reports_for(self, coordinator: str) -> str:
        """LIST of per-batch reports (JSON) from workers to the coordinator that cut the batches."""
        return f"{self._base}:reports:{coordinator}"

    @property
    def workers(self) -> str:
        """ZSET worker hostname -> heartbeat expiry (ms, Redis clock)."""
        return f"{self._base}:workers"

    @property
    def worker_queues(self) -> str:
        """HASH worker hostname -> the batch queues it consumes (a JSON list), written with its
        heartbeat; the field of a worker no longer live goes with the next worker's heartbeat."""
        return f"{self._base}:workers:queues"

    @property
    def stats(self) -> str:
        """HASH of counters every coordinator adds to, read by `carpool status` and the demo; workers
        add one, ``REJECTED_WRITES``."""
        return f"{self._base}:stats"

    @property
    def coordinators(self) -> str:
        """ZSET coordinator hostname -> its last stats write (ms, its own clock): where to find the
        gauge hashes. Names gone for long are pruned; whether one is live is its gauges' existence."""
        return f"{self._base}:coordinators"

    def stats_applied_of(self, writer: str) -> str:
        """HASH of the counter totals one stats writer (a coordinator's run) has added to
        :attr:`stats`, so that a write sent again adds nothing twice (``stats.lua``)."""
        return f"{self._base}:stats:applied:{writer}"

    def gauges_of(self, coordinator: str) -> str:
        """HASH of one coordinator's gauges (pending, outstanding, depth:<model>:<bin>) and the task of
        each routing key (task:<model>); it expires soon after the coordinator stops writing, so a
        dead one's gauges disappear."""
        return f"{self._base}:gauges:{coordinator}"
