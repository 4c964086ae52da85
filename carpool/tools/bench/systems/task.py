"""The systems of ``carpool bench --task``: one ``@batched`` task served three ways, sent the same items.

- ``carpool``: a coordinator and workers serving only the task (its module in ``CARPOOL_IMPORTS``);
- ``celery-batches``: :data:`~carpool.tools.bench.baselines.BATCHED_TASK_ITEMS` running the task's
  function on each flush, in arrival order;
- ``celery``: a plain Celery worker on the request queue running the task's own body, ``fn([item])``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from carpool.tools.bench.env import BenchEnv
from carpool.tools.bench.measure import padding_of_batches
from carpool.tools.bench.systems.base import SEND_CHUNK
from carpool.tools.bench.systems.baseline_workers import (
    CeleryBatchesSystem,
    PlainCelerySystem,
    send_to_batches,
    spawn_celery_worker,
)
from carpool.tools.bench.systems.carpool import CarpoolSystem

if TYPE_CHECKING:
    from celery.result import AsyncResult

TASK_SYSTEMS = ("carpool", "celery-batches", "celery")


@dataclass(frozen=True)
class BenchTask:
    """The task under the bench, and what every process serving it needs to know."""

    name: str  # the Celery task name
    module: str  # the module defining it: CARPOOL_IMPORTS of every process
    max_batch: int  # the batch limit of both batching systems: the task's own, else the bench's
    extra_env: Mapping[str, str] = field(default_factory=dict)  # e.g. where the task's model lives

    def child_env(self) -> dict[str, str]:
        from carpool.tools.bench.baselines import TASK_ENV

        return {**self.extra_env, "CARPOOL_IMPORTS": self.module, TASK_ENV: self.name}


def make_task_system(
    env: BenchEnv, name: str, task: BenchTask, warm_items: Sequence[Any], timeout_s: float
) -> TaskCarpoolSystem | TaskCeleryBatchesSystem | TaskPlainCelerySystem:
    """The system called ``name`` (one of TASK_SYSTEMS) serving ``task``, not started."""
    if name == "carpool":
        return TaskCarpoolSystem(env, task, warm_items, timeout_s)
    if name == "celery-batches":
        return TaskCeleryBatchesSystem(env, task, warm_items, timeout_s)
    if name == "celery":
        return TaskPlainCelerySystem(env, task, warm_items, timeout_s)
    raise ValueError(f"--task runs {', '.join(TASK_SYSTEMS)}, not {name!r}")


def _send_one(system: Any, item: Any, sent_at: float) -> AsyncResult:
    """One item as a request of the task, published as ``task.delay(item)`` publishes it."""
    from carpool.names import SENT_AT_HEADER
    from carpool.producer.submit import publish_tasks

    (result,) = publish_tasks(
        system.task.name, [((item,), {})], app=system.env.app, headers={SENT_AT_HEADER: sent_at}
    )
    return result


def _submit(system: Any, items: Sequence[Any], sent_at: float) -> list[AsyncResult]:
    """The items as requests of the task, as ``task.delay(item)`` sends them (to the request queue)."""
    from carpool.names import SENT_AT_HEADER
    from carpool.producer.submit import submit_many

    return submit_many(
        items,
        task=system.task.name,
        app=system.env.app,
        headers={SENT_AT_HEADER: sent_at},
        chunk_size=SEND_CHUNK,
    )


class TaskCarpoolSystem(CarpoolSystem):
    """carpool serving the task: a coordinator, and workers dedicated to it."""

    def __init__(self, env: BenchEnv, task: BenchTask, warm_items: Sequence[Any], timeout_s: float) -> None:
        super().__init__(env, timeout_s, extra_env={**task.child_env(), "CARPOOL_SERVE_TASKS": task.name})
        self.task = task
        self.warm_items = list(warm_items)

    def start(self) -> None:
        overrides = self.env.child_env(**self.extra_env)
        self.env.harness.start_stack(self.env.workers, prefix="carpool-", wait=False, **overrides)
        self.wait_workers()
        self.warm_up(self.warm_items)

    def send(self, texts: Sequence[Any], sent_at: float) -> list[AsyncResult]:
        return _submit(self, texts, sent_at)

    def send_one(self, text: Any, sent_at: float) -> AsyncResult:
        return _send_one(self, text, sent_at)


class TaskPlainCelerySystem(PlainCelerySystem):
    """A plain Celery worker on the request queue: the task's own Celery body, one item per task."""

    def __init__(self, env: BenchEnv, task: BenchTask, warm_items: Sequence[Any], timeout_s: float) -> None:
        super().__init__(env, timeout_s)
        self.task = task
        self.warm_items = list(warm_items)

    def start(self) -> None:
        queue = self.env.settings.request_queue
        spawn_celery_worker(self.env, "celery-plain", "bench-plain", queue, overrides=self.task.child_env())
        self.warm_up(self.warm_items)

    def send(self, texts: Sequence[Any], sent_at: float) -> list[AsyncResult]:
        return _submit(self, texts, sent_at)

    def send_one(self, text: Any, sent_at: float) -> AsyncResult:
        return _send_one(self, text, sent_at)


class TaskCeleryBatchesSystem(CeleryBatchesSystem):
    """celery-batches running the task's function on each flush (FIFO, at max batch or max wait)."""

    def __init__(self, env: BenchEnv, task: BenchTask, warm_items: Sequence[Any], timeout_s: float) -> None:
        super().__init__(env, timeout_s)
        self.task = task
        self.warm_items = list(warm_items)

    def start(self) -> None:
        # A prefetch of 0 reads as "not given" on the CLI; 10000 lets a flush fill up (see baselines).
        overrides = {**self.task.child_env(), "CARPOOL_MAX_BATCH": str(self.task.max_batch)}
        spawn_celery_worker(
            self.env,
            "celery-batches",
            "bench-batches",
            self._queue(),
            "--prefetch-multiplier",
            "10000",
            overrides=overrides,
        )
        self.warm_up(self.warm_items)

    def send(self, texts: Sequence[Any], sent_at: float) -> list[AsyncResult]:
        from carpool.tools.bench.baselines import BATCHED_TASK_ITEMS

        return send_to_batches(self.env, BATCHED_TASK_ITEMS, texts, sent_at)

    def snapshot(self) -> dict[str, float]:
        from carpool.tools.bench.baselines import BATCH_IDS_KEY

        assert self.env.app is not None
        return {"logged": float(self.env.app.backend.client.llen(BATCH_IDS_KEY))}

    def batches_since(
        self, before: dict[str, float], lengths: Sequence[int]
    ) -> tuple[Counter[int], int | None, int | None]:
        """From the request ids of each flush logged since ``before`` and the last run's lengths."""
        from carpool.tools.bench.baselines import BATCH_IDS_KEY

        assert self.env.app is not None
        raw = self.env.app.backend.client.lrange(BATCH_IDS_KEY, int(before.get("logged", 0)), -1)
        length_of = dict(zip(self.last_ids, lengths, strict=True))
        return padding_of_batches((json.loads(ids) for ids in raw), length_of)
