"""The bench's service rate: what the service completed once the producer's publish had returned."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from carpool.tools.bench.systems import base
from carpool.tools.bench.systems.base import CelerySystem


class _Streamed(CelerySystem):
    """Sends nothing: each result's date_done is given, as if its publish streamed in chunks and the
    service answered the first ones while the producer was still publishing."""

    name = "streamed"

    def __init__(self, publish_s: float, done_after: Sequence[float]) -> None:
        env = SimpleNamespace(model="null", cpu_seconds=lambda: {"_wall": time.time(), "_busy": 0.0})
        super().__init__(env)  # type: ignore[arg-type]
        self.publish_s = publish_s
        self.done_after = done_after

    def send(self, texts: Sequence[str], sent_at: float) -> list[Any]:
        self.sent_at = sent_at  # the burst's start
        time.sleep(self.publish_s)
        return [SimpleNamespace(id=str(i), date_done=None) for i in range(len(texts))]

    def _commandstats(self) -> dict[str, int]:
        return {}


def test_requests_served_during_a_streamed_publish_are_not_in_the_service_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    system = _Streamed(publish_s=0.05, done_after=[0.01, 0.02, 0.5, 0.5, 1.05])
    offsets = iter(system.done_after)
    monkeypatch.setattr(base, "_done_at", lambda _result: system.sent_at + next(offsets))
    monkeypatch.setattr("carpool.producer.gather.gather", lambda results, **_: [None] * len(results))
    monkeypatch.setattr(base, "SETTLE_S", 0.0)
    record = system.burst(["t"] * 5, [1] * 5)
    # 0.01 and 0.02 came back while the publish (0.05 s and a little) went on: the service rate is
    # the other three over the time from the publish's return to the last answer.
    assert record.extra["served_during_publish"] == 2
    assert 0.05 <= record.extra["publish_s"] < 0.5
    assert record.extra["service_rps"] == pytest.approx(3 / (1.05 - record.extra["publish_s"]))
