"""Calls retried while Redis is unreachable, for work already done that must reach it: a worker's
batch results and the links after them, a coordinator's sending of a dead worker's links."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from carpool.redis_edge.connect import UNREACHABLE

log = logging.getLogger(__name__)

T = TypeVar("T")


RETRY_WINDOW_S = 25.0  # how long a worker keeps handing over what it computed while Redis is away


def retrying(call: Callable[[], T], window_s: float = RETRY_WINDOW_S, first_pause_s: float = 0.1) -> T:
    """``call()``, retried while Redis is unreachable (:data:`~carpool.redis_edge.connect.UNREACHABLE`)
    for up to ``window_s``; pauses double from 0.1 s to 5 s. ``window_s=0``: one try.

    A call that ran but lost its reply runs again, so ``call`` must bear that: a finish does, its
    results encoded once (``finish.lua`` knows them as its own and answers as the first time)."""
    until = time.monotonic() + window_s
    pause = first_pause_s
    while True:
        try:
            return call()
        except UNREACHABLE as exc:
            if time.monotonic() + pause > until:
                raise
            log.warning("redis unavailable (%s); retrying in %.1fs", exc, pause)
            time.sleep(pause)
            pause = min(5.0, pause * 2)


class Retries:
    """One retry window shared by every call it makes: a batch's links, sent one request after
    another, wait for Redis at most ``window_s`` in all, not that long each."""

    def __init__(self, window_s: float = RETRY_WINDOW_S) -> None:
        self.until = time.monotonic() + window_s

    def __call__(self, call: Callable[[], T]) -> T:
        return retrying(call, window_s=max(0.0, self.until - time.monotonic()))
