"""A worker's background stages: jobs in order on one thread each, never more than a few held.

The Celery thread claims a batch and hands it to the :class:`DeviceStage`, whose thread runs it on
the device and hands its results to the :class:`Finisher`, whose thread stores them: while the
device runs batch k, the Celery thread prepares batch k+1 and the finisher stores batch k-1. On an
asynchronous device (a model with ``launch``) the device thread also starts batch k+1 before it
collects batch k's outputs, so the device never waits for the thread between two batches. Each
job carries the ids of the requests it holds, which the heartbeat keeps leased until the job is
done; a job that fails is logged and its requests are left to lease recovery, as a dead worker's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from celery.platforms import EX_FAILURE
from celery.worker import state as worker_state

log = logging.getLogger(__name__)

FINISHER_DEPTH = 3  # batches whose results are being stored or wait to be


class Stage:
    """One daemon thread running submitted jobs in order; at most ``depth`` held (running + waiting).

    :meth:`submit` blocks while ``depth`` jobs are held, so the submitter never runs more than that
    far ahead and nothing piles up in memory.

    A job may return a function that completes it (a batch launched on an asynchronous device
    returns what collects its outputs): the thread then starts up to ``ahead`` jobs before it
    completes the oldest, and completes one at once whenever no other job is waiting to start. A
    job stays held, its requests leased, until it is complete. The submitting thread may also start
    a job itself where this thread would start it at once (:meth:`may_start_here`,
    :meth:`add_started`): this thread may be busy completing a job, and its completion can wait on
    the device.
    """

    def __init__(
        self, name: str, depth: int, failure: str, ahead: int = 1, launch_ahead_for_s: float | None = None
    ) -> None:
        if depth < 1:
            raise ValueError("depth must be an integer >= 1")
        if not 1 <= ahead <= depth:
            raise ValueError("ahead must be an integer from 1 to depth")
        self.depth = depth
        self.ahead = ahead
        self._failure = failure
        self._changed = threading.Condition()
        # Held jobs, oldest first: the started ones (completions in _started, same order), then
        # the waiting ones.
        self._held: deque[tuple[Callable[[], object], list[str]]] = deque()
        self._started: deque[Callable[[], object]] = deque()
        self._completing = False  # the oldest held job is being completed (out of _started)
        # When each held job that has begun (running, launched, completing) began (monotonic): the
        # begun jobs are the oldest held, as many as this holds.
        self._began: deque[float] = deque()
        # A job is started ahead of another only while the oldest begun one has run at most this
        # long: one started behind a slow or hung job would be held (and leased) with it.
        self._launch_ahead_for_s = launch_ahead_for_s
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], object], ids: list[str]) -> None:
        """Queue ``job``, whose requests are ``ids``, after waiting for room."""
        with self._changed:
            while len(self._held) >= self.depth:
                self._changed.wait()
            self._held.append((job, ids))
            self._changed.notify_all()

    def may_start_here(self) -> bool:
        """Whether a job submitted now would be the next to start, with room to start it: none
        waiting to start and fewer than ``ahead`` started. Only the submitting thread may act on a
        True (by :meth:`add_started`): it alone adds jobs, and this thread starts none meanwhile."""
        with self._changed:
            waiting = len(self._held) - len(self._started) - int(self._completing)
            room = waiting == 0 and len(self._started) < self.ahead and len(self._held) < self.depth
            return room and not self._running_long()

    def _running_long(self) -> bool:
        """Whether the oldest begun job has run past ``launch_ahead_for_s`` (call under the lock)."""
        limit = self._launch_ahead_for_s
        return limit is not None and bool(self._began) and time.monotonic() - self._began[0] > limit

    def add_started(self, completion: Callable[[], object], ids: list[str]) -> None:
        """Hold a job that the submitting thread started itself after :meth:`may_start_here`; this
        thread calls ``completion`` in its turn, after those of the jobs started before it."""
        with self._changed:
            self._held.append((completion, ids))
            self._started.append(completion)
            self._began.append(time.monotonic())  # every job before it had begun: it starts only then
            self._changed.notify_all()

    def wait_for_room(self, timeout_s: float | None = None) -> bool:
        """Wait until a :meth:`submit` would not block; False if that took longer than ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self._held) < self.depth, timeout_s)

    def idle(self) -> bool:
        """Whether nothing is running or waiting."""
        return not self._held

    def held(self) -> int:
        """How many jobs are running or waiting."""
        return len(self._held)

    def pending_ids(self) -> list[str]:
        """The ids of every job held, running or waiting."""
        with self._changed:
            return [i for _, ids in self._held for i in ids]

    def begun_ids(self) -> list[str]:
        """The ids of the jobs held that have begun (running, launched or being completed): the
        heartbeat renews their leases, not those of a job still waiting, so that a job waiting
        behind a long or hung one runs out of its leases and its requests go to another worker."""
        with self._changed:
            return [i for _, ids in list(self._held)[: len(self._began)] for i in ids]

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for every job held to finish; False if they did not within ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._held, timeout_s)

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not self._held:
                    self._changed.wait()
                started = len(self._started)
                job = self._held[started][0] if started < min(self.ahead, len(self._held)) else None
                if job is not None and started and self._running_long():
                    job = None  # not behind a slow one: it waits, unleased, to go elsewhere
                if job is not None:
                    self._began.append(time.monotonic())
                completion = None
                if job is None:  # nothing more may start now: complete the oldest started job
                    completion = self._started.popleft()
                    self._completing = True
            if completion is not None:
                self._run(completion, index=0)
                continue
            assert job is not None
            outcome = self._run(job, index=started)
            if callable(outcome):
                with self._changed:
                    self._started.append(outcome)

    def _run(self, call: Callable[[], object], index: int) -> object:
        """``call()``; the job at ``index`` of those held is done unless it returned its completion."""
        outcome: object = None
        try:
            outcome = call()
        except Exception:
            log.exception("%s failed; its requests return through lease recovery", self._failure)
        except BaseException:
            # Ctrl-C or Celery's shutdown raised on this thread (by user code) would end the thread
            # alone, and the worker, still heartbeating, would wait on it for ever: it stops instead.
            log.critical(
                "%s raised what stops the worker; its requests return through lease recovery, and"
                " the worker stops (exit status %d)",
                self._failure,
                EX_FAILURE,
                exc_info=True,
            )
            worker_state.should_stop = EX_FAILURE
        finally:
            if not callable(outcome):
                with self._changed:
                    del self._held[index]
                    del self._began[index]
                    if index == 0 and self._began:
                        # Queued on the device behind the job that just ended, the next oldest
                        # starts running only now.
                        self._began[0] = time.monotonic()
                    self._completing = False
                    self._changed.notify_all()
        return outcome


class Finisher(Stage):
    """Stores batches' results, in order, while the device runs the next batches: at most
    ``FINISHER_DEPTH`` held, so the device thread launches on while storing lags behind a run of
    short batches (whose results cost more CPU than their device time) and catches up during long
    ones; past that, handing over waits."""

    def __init__(self) -> None:
        super().__init__("carpool-finisher", depth=FINISHER_DEPTH, failure="storing a batch's results")


class DeviceStage(Stage):
    """Runs batches on the device while the Celery thread claims the next: one running and at most
    one waiting beside it, so the worker never claims far ahead of its device. On an asynchronous
    device (``launches``): two started, the second queued on the device behind the first, and one
    waiting, so the next batch is claimed while the thread collects the oldest."""

    def __init__(self, launches: bool = False, launch_ahead_for_s: float | None = None) -> None:
        depth, ahead = (3, 2) if launches else (2, 1)
        super().__init__(
            "carpool-device",
            depth=depth,
            failure="running a batch",
            ahead=ahead,
            launch_ahead_for_s=launch_ahead_for_s,
        )
