"""What the coordinator answers itself instead of batching: refusals (FAILURE), revokes, dead letters."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from celery.exceptions import TaskRevokedError

from carpool.batching import Request
from carpool.celery_edge import links
from carpool.celery_edge.results import FAILURE, REVOKED
from carpool.coordinator.intake import Malformed, Refused
from carpool.errors import CarpoolError, DeadlineExceeded, described
from carpool.redis_edge.connect import UNREACHABLE
from carpool.redis_edge.store import dead_letter_reason
from carpool.wire import Links, RequestSlot

if TYPE_CHECKING:
    from carpool.coordinator.loop import Coordinator

log = logging.getLogger(__name__)


def revoke(c: Coordinator, ids: list[str]) -> None:
    """Remember revoked ``ids``, and answer REVOKED those held here (for their eta, or while no
    worker is up). Dispatched ones are the workers' to check when they claim them."""
    c.revoked_ids.remember(ids)
    revoked = set(ids)
    held = c.deferred.discard(revoked) + c.policy.discard(revoked)
    if held:
        answer_revoked(c, [r.id for r in held], _inboxes(r.payload for r in held))
        c.pacer.changed()


def answer_revoked(
    c: Coordinator, ids: list[str], inboxes: dict[str, str] | None = None, expired: bool = False
) -> None:
    """Answer ``ids`` REVOKED (``inboxes``: the result inboxes of those whose producer named one).
    ``expired``: their ``expires=`` passed first, which Celery answers REVOKED too, as
    ``TaskRevokedError('expired')`` and with no error callbacks; counted as deadline failures."""
    c.held.difference_update(ids)
    entries = [(i, REVOKED, TaskRevokedError("expired" if expired else "revoked")) for i in ids]
    c.store.answer(c.backend, c.dbs, c.backend.store_args(entries, inboxes), ids)
    for request_id in ids:
        c.events.revoked(request_id, expired=expired)
    if expired:
        c.stats.failed["deadline"] += len(ids)
        c.metrics.failed("deadline", len(ids))
        log.info("%d requests expired (their expires= passed) before they ran", len(ids))
    else:
        c.stats.failed["revoked"] += len(ids)
        c.metrics.failed("revoked", len(ids))
        log.info("revoked %d requests before they were batched", len(ids))


def answer_expired(c: Coordinator, expired: list[Request], now: float) -> None:
    """Answer requests whose deadline passed before they ran: REVOKED ('expired') where it was
    their caller's ``expires=``, as Celery answers; :class:`DeadlineExceeded` where it was
    ``CARPOOL_DEFAULT_DEADLINE_S``'s, carpool's own."""
    by_caller = [r for r in expired if cast("RequestSlot", r.payload).get("expires")]
    if by_caller:
        answer_revoked(c, [r.id for r in by_caller], _inboxes(r.payload for r in by_caller), expired=True)
    defaulted = [r for r in expired if not cast("RequestSlot", r.payload).get("expires")]
    if not defaulted:
        return
    wall = c.wall()
    fail_held(
        c,
        [
            (
                r,
                DeadlineExceeded.waited(
                    now - r.deadline_s,
                    "in the coordinator's queue",
                    wall - cast("RequestSlot", r.payload)["sent_at"],
                ),
            )
            for r in defaulted
        ],
        "deadline",
    )


def fail_held(c: Coordinator, failures: list[tuple[Request, CarpoolError]], reason: str) -> None:
    """Answer requests the coordinator held (their messages no longer at hand: their task, links and
    result inbox are in their slots) with their errors, counted under ``reason``."""
    c.held.difference_update(r.id for r, _ in failures)
    fail(
        c,
        [
            Refused(
                r.id,
                reason,
                error,
                task=c.task_name(r.model),
                links=cast("RequestSlot", r.payload).get("links"),
                inbox=cast("RequestSlot", r.payload).get("inbox"),
            )
            for r, error in failures
        ],
    )


def dead_letter(c: Coordinator, bad: Malformed) -> None:
    reason = dead_letter_reason(bad.reason, bad.raw)
    log.warning("dead-lettering message %s: %s", bad.id, reason)
    c.store.dead_letter(bad.id, bad.raw, reason)
    c.stats.failed["malformed"] += 1
    c.metrics.failed("malformed")


def fail(c: Coordinator, refused: list[Refused]) -> None:
    """Store each refusal as its request's failure (and its chain steps'), acknowledge them, then
    have their error callbacks called on the coordinator's link thread
    (:class:`~carpool.coordinator.outbox.LinkSender`; :mod:`carpool.celery_edge.links`). The
    refusals with error callbacks are filed in the links outbox in the same step, so that a
    coordinator dying before it calls them leaves them to the next housekeeping round."""
    entries: list[tuple[str, str, Any]] = [(r.id, FAILURE, r.error) for r in refused]
    linked: list[tuple[Refused, str | None, Links]] = []
    outbox: list[tuple[int, str, bytes]] = []
    for index, r in enumerate(refused, 1):  # the refusals' entries come first, in this order
        task, lk = r.task_and_links()
        if lk:
            linked.append((r, task, lk))
            entries += links.chain_failures(lk, r.error)
            if links.sends_on(lk, FAILURE):
                outbox.append((index, r.id, links.outbox_entry(task, lk)))
    inboxes = {r.id: inbox for r in refused if (inbox := r.inbox_of()) is not None}
    writes = c.backend.store_args(entries, inboxes)
    stored = c.store.answer(c.backend, c.dbs, writes, [r.id for r in refused], outbox=outbox)
    for r in refused:
        c.stats.failed[r.reason] += 1
        c.metrics.failed(r.reason)
        if r.message is not None:  # refused at intake: Flower has not seen it received yet
            c.events.received_of(r.message)
        c.events.failed(r.id, r.error)
    _log_refusals(refused)
    if linked:
        answered = {entries[i - 1][0] for i in stored}
        calls = [(r.id, task, lk, r.error) for r, task, lk in linked if r.id in answered]
        filed = [rid for _, rid, _ in outbox if rid in answered]
        # Off the loop: an error callback Celery calls in this process holds it while it runs.
        c.link_sender.submit(lambda: _call_errbacks(c, calls, filed), holds=filed)


def _call_errbacks(
    c: Coordinator, calls: list[tuple[str, str | None, Links, CarpoolError]], filed: list[str]
) -> None:
    """Call the refused requests' error callbacks, then empty the outbox entries of those called;
    those that Redis, unreachable, kept from being called stay there, sent again a lease later."""
    called: set[str] = set()
    for request_id, task, lk, error in calls:
        try:
            links.on_failure(c.app, request_id, task, lk, error, c.hostname, keep_on_outage=True)
        except UNREACHABLE as exc:
            log.warning(
                "request %s: its error callbacks could not be called, Redis unreachable (%s); they stay"
                " in the links outbox, sent again a lease from now",
                request_id,
                described(exc),
            )
            continue
        except Exception:  # one request's links do not stop the others'
            log.exception("request %s: applying its error callbacks failed", request_id)
        called.add(request_id)
    try:
        c.store.links_sent([rid for rid in filed if rid in called])
    except UNREACHABLE as exc:
        log.warning(
            "the error callbacks of %d refused requests were sent, but their outbox entries could not be"
            " emptied (%s): a coordinator sends them again in a lease",
            len(called),
            described(exc),
        )


#: Refusals of one reason logged one by one per call; past this, one line counts the rest (under
#: overload every request past CARPOOL_MAX_PENDING is refused, and a line each would flood the log).
LOGGED_REFUSALS = 3


def _log_refusals(refused: list[Refused]) -> None:
    by_reason: dict[str, list[Refused]] = {}
    for r in refused:
        by_reason.setdefault(r.reason, []).append(r)
    for reason, group in by_reason.items():
        for r in group[:LOGGED_REFUSALS]:
            log.info("request %s failed (%s): %s", r.id, reason, r.error)
        if len(group) > LOGGED_REFUSALS:
            log.info("%d more requests failed (%s)", len(group) - LOGGED_REFUSALS, reason)
        for r in group[LOGGED_REFUSALS:]:
            log.debug("request %s failed (%s): %s", r.id, reason, r.error)


def _inboxes(slots: Iterable[object]) -> dict[str, str]:
    """Request id -> result inbox, for the request slots whose producer named one."""
    out = {}
    for slot in cast("Iterable[RequestSlot]", slots):
        inbox = slot.get("inbox")
        if inbox is not None:
            out[slot["id"]] = inbox
    return out
