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

import logging
from typing import TYPE_CHECKING, Any

from carpool.celery_edge import links
from carpool.celery_edge.results import FAILURE, SUCCESS
from carpool.errors import described
from carpool.redis_edge.connect import UNREACHABLE
from carpool.redis_edge.retry import Retries

if TYPE_CHECKING:
    from carpool.coordinator.loop import Coordinator

log = logging.getLogger(__name__)

DUE_PER_ROUND = 100  # outbox entries one housekeeping round sends at most
SEND_WINDOW_S = 5.0  # how long each round retries its sends while Redis is unreachable


def send_due_links(c: Coordinator) -> int:
    """Send the links of the outbox's due entries; returns how many requests' links were sent."""
    due = c.store.links_due(DUE_PER_ROUND)
    if not due:
        return 0
    send = Retries(SEND_WINDOW_S)
    backend: Any = c.app.backend
    sent: list[str] = []
    dropped: list[str] = []
    unsent: list[links.Entry] = []
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
                    traceback=meta.get("traceback"),  # the worker's, stored with the failure
                )
            else:  # its result expired, or the entry was filed by hand
                log.warning(
                    "request %s: its links were due but it has no result (%s); dropped", request_id, state
                )
                dropped.append(request_id)
                continue
            sent.append(request_id)
        except UNREACHABLE:
            raise  # the entries stay, due again a lease later (those sent already are sent again)
        except Exception as exc:
            log.error("request %s: its links could not be sent (%s); dropped", request_id, described(exc))
            dropped.append(request_id)
    if unsent:
        try:
            send(lambda: backend.store_many(unsent))
        except Exception:
            log.exception("storing the failures of %d links that could not be sent failed", len(unsent))
    c.store.links_sent(sent + dropped)
    if sent:
        log.warning(
            "sent the links of %d requests whose worker or coordinator stopped before sending them", len(sent)
        )
        c.metrics.links_resent.inc(len(sent))
    return len(sent)
