"""Prometheus metrics of the coordinator, served on ``CARPOOL_METRICS_PORT`` (0 turns them off).

Workers report each batch's run time to the coordinator (through the batch reports it already reads
for its latency model), so one scrape target shows the whole pipeline: batch sizes formed, padded
vs real tokens, queue depth per bin, waiting and run times, why batches left, why requests failed.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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
        self.requests = Counter(
            "carpool_requests", "Requests taken from the request queue, again when taken again.", registry=r
        )
        self.requeued = Counter(
            "carpool_requeued",
            "Requests put back on the request queue to be taken again, by why.",
            ["reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "carpool_queue_depth",
            "Requests waiting in the coordinator, per bin.",
            ["task", "model", "bin"],
            registry=r,
        )
        self.wait_seconds = BatchHistogram(
            "carpool_wait_seconds",
            "Time from send to dispatch, per request.",
            ("task", "model"),
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
        self.links_resent = Counter(
            "carpool_links_resent",
            "Requests whose links (callbacks, chains, error callbacks) a coordinator sent from the links"
            " outbox, because the process that stored the result died before sending them.",
            registry=r,
        )
        self.housekept = Gauge(
            HOUSEKEEPING_GAUGE,
            "When the coordinator's loop last finished its housekeeping with Redis (Unix time; about"
            " once a second while it runs): its healthcheck's proof that the loop turns and reaches Redis.",
            registry=r,
        )
        self.batch_queue_workers = Gauge(
            "carpool_batch_queue_workers",
            "Live workers consuming each batch queue this coordinator dispatches to (0: its batches"
            " wait unserved), as their heartbeats say; read every 10 s.",
            ["queue"],
            registry=r,
        )
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
        self.wait_seconds.observe_all((task, model), waits_s)

    def batch_ran(self, model: str, device: str, run_s: float) -> None:
        self.batch_run_seconds.labels(self.task_of(model), model, device).observe(run_s)

    def failed(self, reason: str, count: int = 1) -> None:
        self.failures.labels(reason).inc(count)

    def put_back(self, reason: str, count: int) -> None:
        self.requeued.labels(reason).inc(count)

    def set_depths(self, depths: Mapping[tuple[str, str], int]) -> None:
        for model, bin_label in self._depth_keys - set(depths):
            self.queue_depth.labels(self.task_of(model), model, bin_label).set(0)
        for (model, bin_label), depth in depths.items():
            self.queue_depth.labels(self.task_of(model), model, bin_label).set(depth)
        self._depth_keys |= set(depths)


class BatchHistogram(Collector):
    """A histogram exposed as prometheus_client's :class:`~prometheus_client.Histogram` exposes one
    (``_bucket``, ``_count``, ``_sum`` and ``_created`` series), observed many values at a time:
    the coordinator observes every request of a batch, and prometheus_client takes a lock per
    value and series (about 0.9 µs a value) where this takes one per batch."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = sorted(float(b) for b in buckets if b != float("inf"))
        self._series: dict[tuple[str, ...], _Series] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def observe_all(self, labels: tuple[str, ...], values: Iterable[float]) -> None:
        """Observe each of ``values`` in the series of ``labels`` (one value per label name)."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels!r}")
        bounds = self.bounds
        with self._lock:
            series = self._series.get(labels)
            if series is None:
                series = self._series[labels] = _Series(len(bounds) + 1)
            counts = series.counts  # the last: above every bound (+Inf only)
            total = series.sum
            try:
                for value in values:
                    counts[bisect_left(bounds, value)] += 1  # the first bucket whose bound is >= value
                    total += value  # one value at a time, as a Histogram adds them
            finally:  # what was counted is summed, whatever ``values`` raised
                series.sum = total

    def describe(self) -> Iterator[Metric]:
        """Its name, for the registry: a second one of the name is refused, and a scrape of it by
        name finds it, as for prometheus_client's own metrics."""
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            snapshot = [(labels, list(s.counts), s.sum, s.created) for labels, s in self._series.items()]
        go_string = cast("Callable[[float], str]", floatToGoString)  # untyped: how le values are written
        les = [go_string(b) for b in self.bounds] + ["+Inf"]
        for labels, counts, total, created in snapshot:
            cumulative, running = [], 0
            for le, count in zip(les, counts, strict=True):
                running += count
                cumulative.append((le, float(running)))
            family.add_metric(list(labels), cumulative, total)
            if not _created_series():
                continue
            family.add_sample(
                f"{self.name}_created", dict(zip(self.labelnames, labels, strict=True)), created
            )
        yield family


class _Series:
    __slots__ = ("counts", "created", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.sum = 0.0
        self.created = time.time()


def _created_series() -> bool:
    """Whether ``_created`` series are written: prometheus_client's setting
    (``disable_created_metrics()``, ``PROMETHEUS_DISABLE_CREATED_SERIES``), read as its metrics read it."""
    from prometheus_client import metrics

    return bool(getattr(metrics, "_use_created", True))


HOUSEKEEPING_GAUGE = "carpool_coordinator_housekeeping_timestamp_seconds"


def healthcheck(port: int | None = None, max_age_s: float = 30.0) -> int:
    """A container's healthcheck of the coordinator on this host: 0 when its loop finished its
    housekeeping with Redis within ``max_age_s`` (about once a second while it runs), 1 otherwise,
    saying why on stderr. The metrics server answers from a thread of its own, so that it answers
    proves nothing of the loop: stuck, or unable to reach Redis, its last housekeeping grows old."""
    import os
    import sys
    import urllib.request

    if not port:
        raw = os.environ.get("CARPOOL_METRICS_PORT", "9808")
        try:
            port = int(raw)
        except ValueError:
            print(f"CARPOOL_METRICS_PORT={raw!r} is not a port number", file=sys.stderr)
            return 1
        if port == 0:
            print(
                "CARPOOL_METRICS_PORT=0 turns the coordinator's metrics off, and this healthcheck reads"
                " them: give it a port",
                file=sys.stderr,
            )
            return 1
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError as exc:
        print(f"coordinator metrics on port {port} unreachable: {exc}", file=sys.stderr)
        return 1
    for line in text.splitlines():
        if line.startswith(HOUSEKEEPING_GAUGE + " "):
            at = float(line.split()[1])
            age = time.time() - at
            if age <= max_age_s:
                return 0
            when = f"{age:.0f}s ago" if at else "not yet"
            print(f"the coordinator's loop last reached Redis: {when}", file=sys.stderr)
            return 1
    print(f"no {HOUSEKEEPING_GAUGE} in the coordinator's metrics", file=sys.stderr)
    return 1
