"""carpool.coordinator.metrics: what the Prometheus series say between the coordinator's depth writes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from carpool.coordinator.metrics import CoordinatorMetrics


def depth(registry: CollectorRegistry, model: str, bin_label: str) -> float | None:
    labels = {"task": "carpool.infer", "model": model, "bin": bin_label}
    return registry.get_sample_value("carpool_queue_depth", labels)


def test_a_bin_whose_requests_all_left_between_depth_writes_shows_depth_zero() -> None:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    metrics.set_depths({})
    # The whole burst arrived and left within one stats interval: no write ever saw it queued.
    metrics.batch_dispatched("toy", "1-16", 32, 512, 400, "full", [0.01] * 32)
    metrics.set_depths({})
    assert depth(registry, "toy", "1-16") == 0


def test_a_bin_emptied_after_a_write_goes_back_to_zero() -> None:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    metrics.set_depths({("toy", "17-32"): 7})
    assert depth(registry, "toy", "17-32") == 7
    metrics.set_depths({})
    assert depth(registry, "toy", "17-32") == 0
    assert depth(registry, "toy", "1-16") is None  # no series for a bin nothing went through
