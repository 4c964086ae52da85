"""The two Celery baselines: a plain worker on the request queue, and a celery-batches worker.

Both run ``celery -A carpool.tools.bench.baselines worker`` (see that module for what each serves).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from carpool.tools.bench.env import BenchEnv
from carpool.tools.bench.measure import one_by_one_padding
from carpool.tools.bench.systems.base import SEND_CHUNK, CelerySystem, counters_since

if TYPE_CHECKING:
    from celery.result import AsyncResult


def spawn_celery_worker(
    env: BenchEnv,
    name: str,
    hostname: str,
    queue: str,
    *extra: str,
    overrides: Mapping[str, str] | None = None,
) -> None:
    """A baseline ``celery worker`` (solo pool, no gossip/mingle/heartbeat) on ``queue``;
    ``overrides``: environment variables over the bench's own (:meth:`BenchEnv.child_env`)."""
    argv = [
        "celery",
        "-A",
        "carpool.tools.bench.baselines",
        "worker",
        "-Q",
        queue,
        "--pool",
        "solo",
        *extra,
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--loglevel",
        "warning",
        "-n",
        f"{hostname}-{os.getpid()}@%h",
    ]
    env.harness.spawn(name, argv, **env.child_env(**(overrides or {})))


class PlainCelerySystem(CelerySystem):
    """A Celery worker on the request queue itself: ``carpool.infer``'s body, one task per request."""

    name = "celery"

    def start(self) -> None:
        from carpool.tools.workload import mixed_texts

        spawn_celery_worker(self.env, "celery-plain", "bench-plain", self.env.settings.request_queue)
        self.warm_up(mixed_texts(8, seed=999))

    def batches_since(
        self, before: dict[str, float], lengths: Sequence[int]
    ) -> tuple[Counter[int], int | None, int | None]:
        padded, real = one_by_one_padding(lengths)
        return Counter({1: len(lengths)}), padded, real


class CeleryBatchesSystem(CelerySystem):
    """celery-batches: the worker buffers requests and runs each flush as one FIFO batch."""

    name = "celery-batches"

    def start(self) -> None:
        from carpool.tools.workload import mixed_texts

        # A prefetch of 0 reads as "not given" on the CLI; 10000 lets a flush fill up (see docs).
        spawn_celery_worker(
            self.env, "celery-batches", "bench-batches", self._queue(), "--prefetch-multiplier", "10000"
        )
        self.warm_up(mixed_texts(4 * self.env.max_batch, seed=999))

    @staticmethod
    def _queue() -> str:
        from carpool.tools.bench.baselines import BATCHED_QUEUE

        return BATCHED_QUEUE

    def send(self, texts: Sequence[str], sent_at: float) -> list[AsyncResult]:
        from carpool.tools.bench.baselines import BATCHED_TASK

        return send_to_batches(self.env, BATCHED_TASK, texts, sent_at)

    def snapshot(self) -> dict[str, float]:
        from carpool.tools.bench.baselines import STATS_KEY

        assert self.env.app is not None
        raw = self.env.app.backend.client.hgetall(STATS_KEY)
        return {k.decode(): float(v) for k, v in raw.items()}

    def batches_since(
        self, before: dict[str, float], lengths: Sequence[int]
    ) -> tuple[Counter[int], int | None, int | None]:
        return counters_since(before, self.snapshot())


def send_to_batches(env: BenchEnv, task: str, items: Sequence[object], sent_at: float) -> list[AsyncResult]:
    """One request of ``task`` per item, with one positional argument each, onto celery-batches' queue."""
    from carpool.names import SENT_AT_HEADER
    from carpool.producer.submit import publish_tasks
    from carpool.tools.bench.baselines import BATCHED_QUEUE

    return publish_tasks(
        task,
        [((item,), {}) for item in items],
        app=env.app,
        queue=BATCHED_QUEUE,
        headers={SENT_AT_HEADER: sent_at},
        chunk_size=SEND_CHUNK,
    )
