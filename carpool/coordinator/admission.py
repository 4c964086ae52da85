"""Taken requests into the coordinator's hold: into the policy, deferred until their eta, or refused."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from carpool.batching import Request
from carpool.celery_edge import requests as protocol
from carpool.celery_edge.requests import Incoming
from carpool.coordinator.answers import answer_revoked, dead_letter, fail
from carpool.coordinator.intake import Intake

if TYPE_CHECKING:
    from carpool.coordinator.loop import Coordinator

log = logging.getLogger(__name__)


def admit_taken(c: Coordinator, taken: list[tuple[str, bytes]], now: float) -> None:
    """Admit ``taken`` at once when it is small and the stage idle (a lone request gets no extra
    hop), else hand it to the intake stage."""
    c.stats.taken += len(taken)
    c.metrics.requests.inc(len(taken))
    if len(c.revoked_ids):
        kept, revoked = c.revoked_ids.split(taken)
        if revoked:
            for request_id in revoked:
                c.store.deaths.pop(request_id, None)
            # Their producers' gather waits on the inboxes their messages name, as for any answer.
            gone = set(revoked)
            inboxes = {i: inbox for i, raw in taken if i in gone and (inbox := protocol.inbox_in(raw))}
            answer_revoked(c, revoked, inboxes)
        taken = kept
    room = c.settings.max_pending - len(c.policy) - len(c.deferred) - c.stage.reserved
    if c.stage.busy or len(taken) > c.settings.max_batch:
        c.stage.submit(taken, room)
    else:
        admit(c, c.take_chunk(taken, room), now)


def count_requeued(c: Coordinator, reason: str, count: int) -> None:
    """Count ``count`` requests put back on the request queue (``stats.REQUEUE_REASONS``), in the
    stats and the metrics: each is taken, and counted taken, again."""
    if count:
        c.stats.requeued[reason] += count
        c.metrics.put_back(reason, count)


def admit_finished(c: Coordinator) -> None:
    """Admit the chunks the intake stage finished; a request revoked meanwhile is answered so."""
    intakes, errors = c.stage.finished()
    for error in errors:
        log.error(
            "preparing taken requests failed; they return to the queue when their lease runs out",
            exc_info=error,
        )
    now = c.clock()
    for intake in intakes:
        if len(c.revoked_ids):
            revoked = [msg.id for msg, _ in intake.admitted if msg.id in c.revoked_ids]
            if revoked:
                inboxes = {m.id: m.inbox for m, _ in intake.admitted if m.inbox and m.id in c.revoked_ids}
                answer_revoked(c, revoked, inboxes)
                gone = set(revoked)
                intake.admitted = [(m, r) for m, r in intake.admitted if m.id not in gone]
        admit(c, intake, now)


# A request put back after a worker that had claimed it stopped renewing its lease (it died running
# it, killed for memory say; or Redis was out of its reach that long) runs again alone, with nothing
# beside it on its worker, so that the requests batched with it are not lost with it. Back this many
# times, an ERROR names it (it may be what kills workers) and it waits before it runs again, twice
# as long each time (a recovery timeout the first), so that the others it came back with run
# before it can kill the next worker. It is never failed for it: a Redis failover lapses leases
# too. Its deadline (CARPOOL_DEFAULT_DEADLINE_S, expires=) ends it.
DEATHS_TOLD = 2


def admit(c: Coordinator, intake: Intake, now: float) -> None:
    c.stats.prepare_cpu_ns += intake.prepare_cpu_ns
    c.stats.prepared += intake.prepared
    deaths = c.store.deaths
    for bad in intake.malformed:
        deaths.pop(bad.id, None)
        dead_letter(c, bad)
    refused = intake.refused
    for r in refused:
        deaths.pop(r.id, None)
    # Asked once per chunk, not per request: a monitor that comes or goes is seen from the next one.
    events = c.events.enabled
    for msg, request in intake.admitted:
        if deaths and (died := deaths.pop(request.id, 0)):
            request.alone = True
            if died >= DEATHS_TOLD:
                wait_s = c.settings.recovery_timeout_s * 2 ** (died - DEATHS_TOLD)
                log.error(
                    "request %s (%s) came back %d times from workers that stopped renewing its lease"
                    " while they held it, the last times holding it alone: it may be what kills them"
                    " (out of memory?); it runs alone again in %.0f s, until its deadline; revoke it"
                    " to stop it",
                    request.id,
                    msg.task,
                    died,
                    wait_s,
                )
                c.held.add(request.id)
                # Leased meanwhile, as a request with an eta; released by its deadline to expire on time.
                c.deferred.add(request, min(now + wait_s, request.deadline_s))
                continue
        c.held.add(request.id)
        if msg.eta_at is not None and request.arrival_s > now:
            _defer(c, msg, request)
            continue
        c.policy.add(request)
        if not events:
            continue
        c.events.received_of(msg)
    if refused:
        fail(c, refused)
    c.pacer.changed()


def release_due(c: Coordinator, now: float) -> float | None:
    """Move the requests whose eta has come into the policy; returns when the next one comes due."""
    due = c.deferred.due(now)
    if due:
        for request in due:
            c.policy.add(request)
        c.pacer.changed()
    return c.deferred.next_due_s()


def _defer(c: Coordinator, msg: Incoming, request: Request) -> None:
    """Hold ``request`` until its eta (it stays leased in flight meanwhile), or answer it expired
    when it expires first: it could never run."""
    if request.deadline_s <= request.arrival_s:  # only an expires= can come before the eta
        # Celery's worker answers it REVOKED ('expired') when the eta comes; nothing is gained by
        # keeping its caller waiting until then.
        c.events.received_of(msg)
        answer_revoked(c, [request.id], {msg.id: msg.inbox} if msg.inbox else None, expired=True)
        return
    c.deferred.add(request, request.arrival_s)
    c.events.received_of(msg)
