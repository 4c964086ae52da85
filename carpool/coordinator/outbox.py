"""The links a dead worker (or coordinator) left unsent, sent by a coordinator.

A worker files each request with links (callbacks, error callbacks, a chain) in the links outbox in
the script that stores its result, and empties the entry once it sent them
(:mod:`carpool.celery_edge.links`); a coordinator does the same with the error callbacks of the
requests it refuses (:mod:`carpool.coordinator.answers`). An entry still there a lease later is
one whose process died in between: the coordinator reads the stored result and sends the links as
that process would have, with it. Each coordinator's housekeeping takes the due entries (one
coordinator gets each), so a coordinator that dies sending them leaves them due again a lease later.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from carpool.celery_edge import links
from carpool.celery_edge.results import FAILURE, SUCCESS
from carpool.errors import described
from carpool.redis_edge.connect import UNREACHABLE
from carpool.redis_edge.retry import Retries
from carpool.redis_edge.store import LINKS_TRIES, refused_by_acl

if TYPE_CHECKING:
    from carpool.coordinator.loop import Coordinator

log = logging.getLogger(__name__)

DUE_PER_ROUND = 100  # outbox entries one housekeeping round sends at most
SEND_WINDOW_S = 5.0  # how long each round retries its sends while Redis is unreachable
DRAIN_S = 5.0  # how long a stopping coordinator lets the links it queued go out


class LinkSender:
    """The coordinator's links, sent on a thread of their own, in the order they were queued.

    Celery calls an error callback taking ``(request, exc, traceback)`` in the process that fails the
    request, for as long as it runs: on the coordinator's loop it would hold batching meanwhile (a
    refusal under overload, one after another). Whatever a coordinator queues here is in the links
    outbox already, so a coordinator stopping or killed with links still queued leaves them to another
    coordinator's housekeeping (or its own, restarted) within a lease."""

    def __init__(self) -> None:
        self._jobs: list[Callable[[], object]] = []
        self._changed = threading.Condition()
        self._running = 0  # jobs taken off the list and not finished yet
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._held: Counter[str] = Counter()  # outbox entries queued or being sent: renewed meanwhile
        self._started: float | None = None  # monotonic time the running job started
        self._told = False  # whether overdue() said so of the running job
        #: the first error of Redis's ACL refusing a command a job sent: a deployment error
        self.refused: Exception | None = None

    def submit(self, job: Callable[[], object], holds: Sequence[str] = ()) -> None:
        """Run ``job`` on the sender's thread, after those before it; it logs its own errors.
        ``holds``: the outbox entries whose links it sends, held until it ran (see :meth:`hold`)."""
        with self._changed:
            if self._stopping:
                return  # its links stay in the outbox
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="carpool-links", daemon=True)
                self._thread.start()
            self._held.update(holds)
            self._jobs.append(lambda: self._holding(job, holds))
            self._changed.notify_all()

    def hold(self, request_ids: Sequence[str]) -> None:
        """Count the outbox entries of ``request_ids`` as being sent here until :meth:`release`: the
        coordinator renews them (:meth:`held`), so that no other process takes them from the outbox
        while this one lives, however long the links before them take."""
        with self._changed:
            self._held.update(request_ids)

    def release(self, request_ids: Sequence[str]) -> None:
        with self._changed:
            self._held.subtract(request_ids)
            self._held = +self._held  # drops the counts at zero

    def held(self) -> list[str]:
        """The outbox entries queued or being sent here."""
        with self._changed:
            return list(self._held)

    def _holding(self, job: Callable[[], object], holds: Sequence[str]) -> object:
        try:
            return job()
        finally:
            self.release(holds)

    @property
    def busy(self) -> bool:
        """Whether a job is queued or running."""
        with self._changed:
            return bool(self._jobs) or self._running > 0

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every job submitted so far ran; False if ``timeout_s`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._jobs and not self._running, timeout_s)

    def close(self, timeout_s: float = DRAIN_S) -> None:
        """Take no more jobs; let those queued run for up to ``timeout_s``."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if not self.flush(timeout_s):
            log.warning(
                "stopping with links still being sent (an error callback still running?): they stay in"
                " the links outbox, and a coordinator sends them within a lease"
            )

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._jobs) or self._stopping)
                if not self._jobs:
                    return
                job = self._jobs.pop(0)
                self._running += 1
                self._started, self._told = time.monotonic(), False
            try:
                job()
            except UNREACHABLE as exc:  # the loop says Redis is away; what is unsent stays in the outbox
                log.debug("sending links: Redis unreachable (%s)", described(exc))
            except Exception as exc:  # the next job still runs; what this one left is in the outbox
                if refused_by_acl(exc):
                    self.refused = self.refused or exc  # the loop stops on it, saying what to grant
                else:
                    log.exception("sending links failed")
            except BaseException:  # SystemExit from an error callback run here: it ends no thread
                log.exception("an error callback run in this coordinator raised; the links after it go on")
            finally:
                with self._changed:
                    self._running -= 1
                    self._started = None
                    self._changed.notify_all()

    def overdue(self, after_s: float) -> float | None:
        """How long the job now running has run, the first time that passes ``after_s`` (else None):
        the coordinator warns of one that holds the links behind it (an error callback that never
        returns holds them for as long as the coordinator lives)."""
        with self._changed:
            if self._started is None or self._told or time.monotonic() - self._started < after_s:
                return None
            self._told = True
            return time.monotonic() - self._started


def send_due_links(c: Coordinator) -> int:
    """Send the links of the outbox's due entries (held by ``c.link_sender`` meanwhile, so that the
    coordinator's housekeeping renews them); returns how many requests' links were sent."""
    due = c.store.links_due(DUE_PER_ROUND)
    for request_id in due.dropped:
        log.error(
            "request %s: its links were taken %d times from the links outbox by coordinators that"
            " stopped (or hung) sending them; dropped. An error callback that kills or hangs the process"
            " calling it (one taking (request, exc, traceback), which Celery runs in the coordinator)?",
            request_id,
            LINKS_TRIES,
        )
    if not due.entries:
        return 0
    ids = [request_id for request_id, _ in due.entries]
    c.link_sender.hold(ids)
    try:
        return _send(c, due.entries)
    finally:
        c.link_sender.release(ids)


def _send(c: Coordinator, due: list[tuple[str, bytes]]) -> int:
    send = Retries(SEND_WINDOW_S)
    backend: Any = c.app.backend
    sent: list[str] = []
    dropped: list[str] = []
    unsent: list[links.Entry] = []
    try:
        for request_id, entry in due:
            try:
                task, request_links = links.read_outbox_entry(entry)
                meta = send(lambda rid=request_id: backend.get_task_meta(rid, cache=False))  # type: ignore[misc]
                state = meta.get("status")
                if state == SUCCESS:
                    unsent += links.on_success(c.app, request_id, request_links, meta.get("result"), send)
                elif state == FAILURE:
                    links.on_failure(
                        c.app,
                        request_id,
                        task,
                        request_links,
                        meta["result"],
                        c.hostname,
                        send,
                        traceback=meta.get("traceback"),  # the one stored with the failure
                        keep_on_outage=True,
                    )
                else:  # its result expired, or the entry was filed by hand
                    log.warning(
                        "request %s: its links were due but it has no result (%s); dropped", request_id, state
                    )
                    dropped.append(request_id)
                    continue
                sent.append(request_id)
            except UNREACHABLE:
                # The rest stay, due again a lease later; an outage is no try of theirs.
                done = set(sent + dropped)
                _give_back(c, [rid for rid, _ in due if rid not in done])
                raise
            except Exception as exc:
                log.error("request %s: its links could not be sent (%s); dropped", request_id, described(exc))
                dropped.append(request_id)
        if unsent:
            try:
                send(lambda: backend.store_many(unsent))
            except Exception:
                log.exception("storing the failures of %d links that could not be sent failed", len(unsent))
    finally:  # what was sent is emptied, also when Redis went away midway (if it answers that)
        c.store.links_sent(sent + dropped)
        if sent:
            log.warning(
                "sent the links of %d requests whose worker or coordinator stopped before sending them",
                len(sent),
            )
            c.metrics.links_resent.inc(len(sent))
    return len(sent)


def _give_back(c: Coordinator, request_ids: list[str]) -> None:
    """Uncount this take of ``request_ids``' outbox entries (best effort: Redis may be away too)."""
    with contextlib.suppress(*UNREACHABLE):
        c.store.links_untried(request_ids)
