"""A producer process's result inbox: one pub/sub channel where every result stored for that process
is published, besides its own channel.

    submit_many --INBOX_HEADER in each request's message--> coordinator --the request's slot-->
    worker's finish script: SET each result, PUBLISH it on its own channel and on its inbox

``gather`` then subscribes to one channel for as long as it waits, instead of SUBSCRIBing and
UNSUBSCRIBing every result's channel. Each result's own channel still gets its message, so plain
Celery clients and ``.get()`` work as ever. An inbox message is an ordinary result meta (its
``task_id`` says whose), so any reader of Celery's result pub/sub connection handles it. The
channel is ``<result key prefix>carpool.inbox.<random id>``, one per app and process (a forked
child draws its own), under the result channels every role's ACL already grants.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

from carpool.celery_edge.compat import join_will_block

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

# The attribute an AsyncResult carries when its result comes back through an inbox: the channel.
_MARK = "carpool_inbox"


def inbox_channel(app: Celery) -> str | None:
    """This process's result inbox channel for ``app``; None where results come back per request:
    ``CARPOOL_RESULT_INBOX`` off, not carpool's result backend, or inside a worker's task (where
    Celery refuses to wait for results)."""
    from carpool.celery_edge.app import state_of
    from carpool.celery_edge.result_consumer import PromptResultConsumer

    state = state_of(app)
    if not state.settings.result_inbox or join_will_block():
        return None
    backend = app.backend
    if not isinstance(getattr(backend, "result_consumer", None), PromptResultConsumer):
        return None
    pid = os.getpid()
    kept = state.inbox
    if kept is None or kept[0] != pid:
        kept = state.inbox = (pid, backend.inbox_prefix.decode() + secrets.token_hex(12))
    return kept[1]


def mark(results: Sequence[AsyncResult], channel: str) -> None:
    """Record on each of ``results`` that its result comes back through inbox ``channel``."""
    for r in results:
        setattr(r, _MARK, channel)


def inbox_of(result: AsyncResult) -> str | None:
    """The inbox channel ``result`` comes back through, or None (it has a subscription of its own)."""
    channel: str | None = getattr(result, _MARK, None)
    return channel
