"""Prometheus metrics of the coordinator, served on ``CARPOOL_METRICS_PORT`` (0 turns them off).

Workers report each batch's run time to the coordinator (through the batch reports it already reads
for its latency model), so one scrape target shows the whole pipeline: batch sizes formed, padded
vs real tokens, queue depth per bin, waiting and run times, why batches left, why requests failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from carpool.names import INFER_TASK

log = logging.getLogger(__name__)

SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _infer_only(key: str) -> str:
    return INFER_TASK


class CoordinatorMetrics:
    """Series labelled by ``task`` and ``model``: a ``@batched`` task's requests carry its name in
    both (its batches are keyed by task), ``carpool.infer``'s the model that runs them."""

    def __init__(
        self, registry: CollectorRegistry | None = None, task_of: Callable[[str], str] = _infer_only
    ) -> None:
        self.task_of = task_of
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.batch_size = Histogram(
            "carpool_batch_size",
            "Requests per dispatched batch.",
            ["task", "model", "bin"],
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.padded_tokens = Counter(
            "carpool_padded_tokens", "Padded tokens dispatched (rows x width).", ["task", "model"], registry=r
        )
        self.real_tokens = Counter(
            "carpool_real_tokens", "Real (unpadded) tokens dispatched.", ["task", "model"], registry=r
        )
        self.requests = Counter("carpool_requests", "Requests taken from the request queue.", registry=r)
        self.queue_depth = Gauge(
            "carpool_queue_depth",
            "Requests waiting in the coordinator, per bin.",
            ["task", "model", "bin"],
            registry=r,
        )
        self.wait_seconds = Histogram(
            "carpool_wait_seconds",
            "Time from send to dispatch, per request.",
            ["task", "model"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.batch_run_seconds = Histogram(
            "carpool_batch_run_seconds",
            "Model time per batch (workers).",
            ["task", "model", "device"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.flushes = Counter(
            "carpool_flushes", "Batches dispatched, by why they left.", ["reason"], registry=r
        )
        self.failures = Counter(
            "carpool_failures", "Requests that failed, by reason.", ["reason"], registry=r
        )
        self.workers = Gauge("carpool_workers", "Workers with a live heartbeat.", registry=r)
        self._depth_keys: set[tuple[str, str]] = set()

    def serve(self, port: int) -> None:
        if not port:
            return
        try:
            start_http_server(port, registry=self.registry)
        except OSError as exc:
            # Metrics are for watching; a taken port must not stop the coordinator from serving.
            log.error("metrics not served: port %d unavailable (%s); set CARPOOL_METRICS_PORT", port, exc)
            return
        log.info("metrics on :%d/metrics", port)

    def batch_dispatched(
        self, model: str, bin_label: str, size: int, padded: int, real: int, reason: str, waits_s: list[float]
    ) -> None:
        task = self.task_of(model)
        self.batch_size.labels(task, model, bin_label).observe(size)
        self.padded_tokens.labels(task, model).inc(padded)
        self.real_tokens.labels(task, model).inc(real)
        self.flushes.labels(reason).inc()
        # A bin whose requests all left between two depth writes still gets its (zero) depth series.
        self._depth_keys.add((model, bin_label))
        hist = self.wait_seconds.labels(task, model)
        for w in waits_s:
            hist.observe(w)

    def batch_ran(self, model: str, device: str, run_s: float) -> None:
        self.batch_run_seconds.labels(self.task_of(model), model, device).observe(run_s)

    def failed(self, reason: str, count: int = 1) -> None:
        self.failures.labels(reason).inc(count)

    def set_depths(self, depths: Mapping[tuple[str, str], int]) -> None:
        for model, bin_label in self._depth_keys - set(depths):
            self.queue_depth.labels(self.task_of(model), model, bin_label).set(0)
        for (model, bin_label), depth in depths.items():
            self.queue_depth.labels(self.task_of(model), model, bin_label).set(depth)
        self._depth_keys |= set(depths)
