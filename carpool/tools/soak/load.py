"""The producer side of a soak: open-loop Poisson sends that ride out Redis restarts, and a collector
that reads every result as it lands, checks it, and reads it again later to see it never changed.

Requests go out with :func:`carpool.producer.submit_many` (every arrival due at that moment in one
MULTI/EXEC, all or nothing), without result subscriptions: the collector polls the result keys
with MGET, which a Redis restart cannot leave half-subscribed. A send that fails because Redis is
away is retried, with the requests that fall due meanwhile, as an application would; a request
whose send kept failing for ``give_up_s`` is recorded as refused at send with the error's class.
A request's latency is from its scheduled arrival to the moment the collector first read its result.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from carpool import errors
from carpool.codec import loads_result
from carpool.names import SENT_AT_HEADER

MGET_CHUNK = 1000


@dataclass(slots=True)
class Request:
    """One soak request from its scheduled arrival to its last check (times are wall clock)."""

    index: int
    text: int  # index of its text in the pool
    arrival: float
    id: str = ""
    key: bytes = b""
    sent: float | None = None
    attempts: int = 0
    send_error: str | None = None  # class of the error that made the producer give the send up
    seen: float | None = None  # when the collector first read its result
    outcome: str | None = None  # "ok", "wrong", or the stored error's class name
    named: bool = False  # a failure stored as a carpool.errors.CarpoolError subclass
    raw: bytes | None = None  # the stored result as first read, kept until re-read
    recheck: str | None = None  # "same", "changed" or "missing" when re-read

    @property
    def latency_s(self) -> float | None:
        return None if self.seen is None else self.seen - self.arrival


def is_named_error(exc_module: object, exc_type: object) -> bool:
    """Whether a stored failure is a class of :mod:`carpool.errors` (a CarpoolError)."""
    cls = getattr(errors, str(exc_type), None) if exc_module == errors.__name__ else None
    return isinstance(cls, type) and issubclass(cls, errors.CarpoolError)


class Sender(threading.Thread):
    """Sends request ``i`` of ``texts`` at ``start + offsets[i]`` (wall clock), until ``stop``."""

    def __init__(
        self,
        app: Any,
        model: str,
        texts: Sequence[str],
        offsets: Sequence[float],
        start: float,
        give_up_s: float,
        handoff: queue.SimpleQueue[list[Request]],
    ) -> None:
        super().__init__(name="soak-sender", daemon=True)
        self.app, self.model, self.texts = app, model, texts
        self.offsets, self.start_at, self.give_up_s = offsets, start, give_up_s
        self.handoff = handoff
        self.requests: list[Request] = []
        self.send_failures = 0
        self.stop = threading.Event()

    def run(self) -> None:
        from carpool.producer.submit import submit_many

        backlog: list[Request] = []
        i, pause = 0, 0.05
        while not self.stop.is_set():
            now = time.time()
            while i < len(self.offsets) and self.start_at + self.offsets[i] <= now:
                request = Request(i, i % len(self.texts), self.start_at + self.offsets[i])
                self.requests.append(request)
                backlog.append(request)
                i += 1
            if not backlog and i >= len(self.offsets):
                return
            if backlog:
                try:
                    results = submit_many(
                        [self.texts[r.text] for r in backlog],
                        model=self.model,
                        app=self.app,
                        subscribe=False,
                        headers={SENT_AT_HEADER: backlog[0].arrival},
                    )
                except redis.RedisError as exc:
                    self.send_failures += 1
                    for r in backlog:
                        r.attempts += 1
                        if now - r.arrival > self.give_up_s:
                            r.send_error = type(exc).__name__
                    backlog = [r for r in backlog if r.send_error is None]
                    time.sleep(pause)
                    pause = min(1.0, pause * 2)
                    continue
                sent = time.time()
                backend = self.app.backend
                for r, result in zip(backlog, results, strict=True):
                    r.attempts += 1
                    r.id, r.sent = result.id, sent
                    r.key = backend.get_key_for_task(result.id)
                self.handoff.put(backlog)
                backlog, pause = [], 0.05
            next_at = self.start_at + self.offsets[i] if i < len(self.offsets) else now + 0.02
            time.sleep(min(0.02, max(0.0, next_at - time.time())))


class Collector(threading.Thread):
    """Reads the results of the requests handed over, checks each once it lands (``check(text,
    value)``) and reads it again ``recheck_after_s`` later; polls every ``poll_s``."""

    def __init__(
        self,
        client: redis.Redis,
        handoff: queue.SimpleQueue[list[Request]],
        check: Callable[[int, Any], bool],
        poll_s: float,
        recheck_after_s: float,
    ) -> None:
        super().__init__(name="soak-collector", daemon=True)
        self.client, self.handoff, self.check = client, handoff, check
        self.poll_s, self.recheck_after_s = poll_s, recheck_after_s
        self.pending: dict[bytes, Request] = {}
        self.rechecks: deque[Request] = deque()  # in the order first read, so due ones are in front
        self.read_failures = 0
        self.stop = threading.Event()
        self.final = threading.Event()  # set: re-read every result now instead of when due

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.step()
            except (redis.ConnectionError, redis.TimeoutError):
                self.read_failures += 1  # Redis is restarting: look again next time
            self.stop.wait(self.poll_s)

    def outstanding(self) -> int:
        """Requests handed over and not yet read, or read and not yet re-read."""
        return self.handoff.qsize() + len(self.pending) + len(self.rechecks)

    def step(self) -> None:
        while not self.handoff.empty():
            for r in self.handoff.get():
                self.pending[r.key] = r
        keys = list(self.pending)
        now = time.time()
        for first in range(0, len(keys), MGET_CHUNK):
            chunk = keys[first : first + MGET_CHUNK]
            for key, raw in zip(chunk, self.client.mget(chunk), strict=True):
                if isinstance(raw, bytes):
                    self._landed(self.pending.pop(key), raw, now)
        # Re-read the results read at least recheck_after_s ago (all of them at the end): a prefix of
        # the deque, dropped once re-read, so a Redis error leaves them for the next step.
        due = 0
        for r in self.rechecks:
            if not self.final.is_set() and (r.seen or 0.0) + self.recheck_after_s > now:
                break
            due += 1
        while due:
            batch = list(itertools.islice(self.rechecks, min(due, MGET_CHUNK)))
            self._recheck(batch)
            for _ in batch:
                self.rechecks.popleft()
            due -= len(batch)

    def _landed(self, r: Request, raw: bytes, now: float) -> None:
        r.seen, r.raw = now, raw
        meta = loads_result(raw)  # JSON or msgpack, as CARPOOL_RESULT_SERIALIZER wrote it
        if meta.get("status") == "SUCCESS":
            r.outcome = "ok" if self.check(r.text, meta.get("result")) else "wrong"
        else:
            result = meta.get("result") or {}
            r.outcome = str(result.get("exc_type") or meta.get("status"))
            r.named = is_named_error(result.get("exc_module"), result.get("exc_type"))
        self.rechecks.append(r)

    def _recheck(self, batch: list[Request]) -> None:
        for r, raw in zip(batch, self.client.mget([r.key for r in batch]), strict=True):
            r.recheck = "missing" if raw is None else ("same" if raw == r.raw else "changed")
            r.raw = None
