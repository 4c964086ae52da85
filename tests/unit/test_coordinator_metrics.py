"""carpool.coordinator.metrics: what the Prometheus series say between the coordinator's depth writes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics

from carpool.coordinator.metrics import TIME_BUCKETS, BatchHistogram, CoordinatorMetrics


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


def _exposition(registry: CollectorRegistry) -> tuple[list[str], list[str]]:
    """The registry's text exposition: its lines bar the ``_created`` ones, and those."""
    lines = generate_latest(registry).decode().splitlines()
    return [x for x in lines if "_created" not in x], [x for x in lines if "_created" in x]


values = st.floats(min_value=-1.0, max_value=100.0, allow_nan=False) | st.sampled_from(TIME_BUCKETS)


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.lists(values, max_size=40)), max_size=6))
def test_a_batch_histogram_exposes_what_prometheus_clients_histogram_does(
    batches: list[tuple[str, list[float]]],
) -> None:
    """Values observed a batch at a time come out as the same series, bucket counts, counts and sums
    as prometheus_client's Histogram fed them one by one (bounds inclusive, negatives in the first
    bucket, values past the last bound only in +Inf); only the creation times differ."""
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = BatchHistogram("w_seconds", "Waits.", ("task", "model"), TIME_BUCKETS, ours_registry)
    theirs = Histogram(
        "w_seconds", "Waits.", ["task", "model"], buckets=TIME_BUCKETS, registry=theirs_registry
    )
    for model, batch in batches:
        ours.observe_all(("t", model), batch)
        series = theirs.labels("t", model)  # as the coordinator did: the series exists from its first batch
        for value in batch:
            series.observe(value)
    ours_lines, ours_created = _exposition(ours_registry)
    their_lines, their_created = _exposition(theirs_registry)
    assert ours_lines == their_lines
    assert [x.rsplit(" ", 1)[0] for x in ours_created] == [x.rsplit(" ", 1)[0] for x in their_created]


def test_a_batch_histogram_refuses_the_wrong_number_of_labels() -> None:
    histogram = BatchHistogram("w_seconds", "Waits.", ("task", "model"), TIME_BUCKETS, CollectorRegistry())
    with pytest.raises(ValueError, match="takes labels"):
        histogram.observe_all(("t",), [0.1])


def test_the_coordinators_wait_histogram_counts_every_request_of_a_batch() -> None:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    metrics.batch_dispatched("toy", "1-16", 3, 48, 40, "full", [0.002, 0.02, 7.0])
    labels = {"task": "carpool.infer", "model": "toy"}
    assert registry.get_sample_value("carpool_wait_seconds_count", labels) == 3
    assert registry.get_sample_value("carpool_wait_seconds_sum", labels) == pytest.approx(7.022)
    assert registry.get_sample_value("carpool_wait_seconds_bucket", {**labels, "le": "0.0025"}) == 1
    assert registry.get_sample_value("carpool_wait_seconds_bucket", {**labels, "le": "5.0"}) == 2
    assert registry.get_sample_value("carpool_wait_seconds_bucket", {**labels, "le": "+Inf"}) == 3


def test_a_batch_histogram_is_registered_by_name_and_follows_the_created_series_setting() -> None:
    registry = CollectorRegistry()
    BatchHistogram("w_seconds", "Waits.", ("task",), TIME_BUCKETS, registry).observe_all(("t",), [0.2])
    with pytest.raises(ValueError, match="Duplicated"):
        BatchHistogram("w_seconds", "Waits.", ("task",), TIME_BUCKETS, registry)
    scraped = generate_latest(registry.restricted_registry(["w_seconds_bucket"])).decode()
    assert 'w_seconds_bucket{le="0.25",task="t"} 1.0' in scraped
    cast("Any", prometheus_metrics).disable_created_metrics()  # untyped
    try:
        assert "_created" not in generate_latest(registry).decode()
    finally:
        cast("Any", prometheus_metrics).enable_created_metrics()
    assert "w_seconds_created" in generate_latest(registry).decode()


def test_values_that_fail_partway_leave_the_count_and_the_sum_agreeing() -> None:
    registry = CollectorRegistry()
    histogram = BatchHistogram("w_seconds", "Waits.", ("task",), TIME_BUCKETS, registry)

    def values() -> Iterator[float]:
        yield 0.5
        raise RuntimeError("a broken iterable")

    with pytest.raises(RuntimeError):
        histogram.observe_all(("t",), values())
    assert registry.get_sample_value("w_seconds_count", {"task": "t"}) == 1
    assert registry.get_sample_value("w_seconds_sum", {"task": "t"}) == 0.5


def test_the_healthcheck_passes_while_the_loop_reaches_redis_and_fails_once_it_stops(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import socket
    import time

    from carpool.coordinator.metrics import healthcheck

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert healthcheck(port) == 1 and "unreachable" in capsys.readouterr().err
    metrics = CoordinatorMetrics()
    metrics.serve(port)
    assert healthcheck(port) == 1 and "last reached Redis: not yet" in capsys.readouterr().err
    metrics.housekept.set(time.time())
    assert healthcheck(port) == 0
    metrics.housekept.set(time.time() - 120)  # a loop stuck, or without Redis, for two minutes
    assert healthcheck(port) == 1 and "last reached Redis: 120s ago" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("raw", "said"), [("0", "turns the coordinator's metrics off"), ("abc", "not a port")]
)
def test_the_healthcheck_names_a_metrics_port_it_cannot_use(
    raw: str, said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from carpool.coordinator.metrics import healthcheck

    monkeypatch.setenv("CARPOOL_METRICS_PORT", raw)
    assert healthcheck() == 1
    err = capsys.readouterr().err
    assert said in err and "CARPOOL_METRICS_PORT" in err
