"""The intake stage: a large take -> chunks run through ``take_in`` on threads, while the loop goes on.

The loop hands a take over (``submit``); each chunk of ``INTAKE_CHUNK`` requests runs through
:func:`~carpool.coordinator.intake.take_in` on one of the stage's threads (HF tokenizers release the
GIL while they encode), so the loop keeps reading reports and dispatching meanwhile, and it admits
the chunks as they finish (``finished``). A chunk counts toward ``CARPOOL_MAX_PENDING`` from the
moment it is submitted (``reserved``), and its requests stay leased by this coordinator until they
are admitted (``held_ids``) or handed back (``drain``). No I/O here: the chunk function is passed in.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

from carpool.coordinator.intake import Intake

INTAKE_CHUNK = 64  # requests per chunk: one chunk's tokenizing is a few ms of one core
MAX_AUTO_THREADS = 4

# (the chunk's (request id, raw message) pairs, how many of them may join the policy) -> its intake
ChunkFunction = Callable[[Sequence[tuple[str, bytes]], int], Intake]


def auto_threads(setting: int) -> int:
    """Threads for ``CARPOOL_TOKENIZER_THREADS``: the setting, or for 0 half the cores this process
    may run on (at least 1, at most ``MAX_AUTO_THREADS``): the loop, Redis and workers need the rest."""
    if setting > 0:
        return setting
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_AUTO_THREADS, cores // 2))


@dataclass(slots=True)
class _Chunk:
    ids: list[str]
    reserved: int
    future: Future[Intake]


class IntakeStage:
    """Chunks of taken requests being turned into policy requests."""

    def __init__(
        self, run: ChunkFunction, threads: int, *, chunk: int = INTAKE_CHUNK, executor: Executor | None = None
    ) -> None:
        self._run = run
        self._chunk = chunk
        self._executor = executor or ThreadPoolExecutor(threads, thread_name_prefix="carpool-intake")
        self._chunks: list[_Chunk] = []
        #: set when a chunk finishes: the loop's waits end on it while chunks are out
        self.ready = threading.Event()

    def __len__(self) -> int:
        """Requests taken and not yet admitted."""
        return sum(len(c.ids) for c in self._chunks)

    @property
    def busy(self) -> bool:
        return bool(self._chunks)

    @property
    def reserved(self) -> int:
        """Room in the policy that the chunks out may fill (``CARPOOL_MAX_PENDING``)."""
        return sum(c.reserved for c in self._chunks)

    def submit(self, taken: Sequence[tuple[str, bytes]], room: int) -> None:
        """Start turning ``taken`` into requests, chunk by chunk; at most ``room`` of them may join the
        policy (the rest are refused as the queue being full, in take order)."""
        for start in range(0, len(taken), self._chunk):
            part = taken[start : start + self._chunk]
            reserved = min(len(part), max(0, room))
            room -= reserved
            future = self._executor.submit(self._run, part, reserved)
            future.add_done_callback(self._finished_one)
            self._chunks.append(_Chunk([request_id for request_id, _ in part], reserved, future))

    def _finished_one(self, _: Future[Intake]) -> None:
        self.ready.set()

    def finished(self) -> tuple[list[Intake], list[BaseException]]:
        """The intakes of the chunks finished since the last call, and the errors of those whose
        function raised: a failed chunk's requests, no longer held, return to the queue when their
        lease runs out (a chunk that always fails would otherwise come straight back)."""
        self.ready.clear()
        intakes: list[Intake] = []
        errors: list[BaseException] = []
        out: list[_Chunk] = []
        for chunk in self._chunks:
            if not chunk.future.done():
                out.append(chunk)
            elif (error := chunk.future.exception()) is not None:
                errors.append(error)
            else:
                intakes.append(chunk.future.result())
        self._chunks = out
        return intakes, errors

    def held_ids(self) -> list[str]:
        """Ids of the requests taken and not yet admitted: their leases are ours to renew."""
        return [request_id for c in self._chunks for request_id in c.ids]

    def drain(self) -> list[str]:
        """Forget every chunk (those not started are cancelled); the ids of their requests."""
        ids = self.held_ids()
        for c in self._chunks:
            c.future.cancel()
        self._chunks.clear()
        return ids

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
