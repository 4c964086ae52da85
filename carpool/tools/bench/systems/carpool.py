"""carpool itself under the bench: its coordinators and ``workers`` GPU-worker processes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from carpool.tools.bench.env import BenchEnv
from carpool.tools.bench.systems.base import CelerySystem, counters_since

if TYPE_CHECKING:
    from celery.result import AsyncResult

COORDINATOR = "carpool-coordinator"


class CarpoolSystem(CelerySystem):
    """carpool itself: ``coordinators`` coordinators (one unless the bench asks for more) and
    ``workers`` GPU-worker processes on one request queue."""

    name = "carpool"

    def __init__(
        self, env: BenchEnv, timeout_s: float = 600.0, extra_env: dict[str, str] | None = None
    ) -> None:
        super().__init__(env, timeout_s)
        self.extra_env = dict(extra_env or {})

    def start(self) -> None:
        from carpool.tools.workload import mixed_texts

        overrides = self.env.child_env(**self.extra_env)
        self.env.harness.start_stack(self.env.workers, prefix="carpool-", wait=False, **overrides)
        for i in range(1, self.env.coordinators):
            self.env.harness.start(f"{COORDINATOR}{i}", "coordinator", **overrides)
        self.wait_workers()
        self.warm_up(mixed_texts(4 * self.env.max_batch, seed=999))

    def send_one(self, text: Any, sent_at: float) -> AsyncResult:
        """One request, published as ``infer.delay(text, model)`` publishes it once it has checked
        it (on the bench's own app, which does not bind carpool's task objects)."""
        from carpool.names import INFER_TASK, SENT_AT_HEADER
        from carpool.producer.submit import publish_tasks

        (result,) = publish_tasks(
            INFER_TASK, [((text, self.model), {})], app=self.env.app, headers={SENT_AT_HEADER: sent_at}
        )
        return result

    def restart_coordinator(self, **overrides: str) -> None:
        """New batching settings: a fresh coordinator (workers keep their loaded model)."""
        from carpool.tools.workload import mixed_texts

        self.env.harness.restart(COORDINATOR, **overrides)
        self.warm_up(mixed_texts(4 * self.env.max_batch, seed=998))

    def wait_workers(self, timeout_s: float = 300.0) -> None:
        self.env.harness.wait_workers(
            self.env.workers, timeout_s=timeout_s, request_queue=self.env.settings.request_queue
        )

    def snapshot(self) -> dict[str, float]:
        from carpool.redis_edge.keys import Keys

        raw = self.env.redis_client(0).hgetall(Keys(self.env.settings.request_queue).stats)
        return {k.decode(): float(v) for k, v in raw.items()}

    def batches_since(
        self, before: dict[str, float], lengths: Sequence[int]
    ) -> tuple[Counter[int], int | None, int | None]:
        return counters_since(before, self.snapshot())
