"""The messages between coordinator and worker: one schema, versioned, read by both sides."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from carpool.codec import loads
from carpool.errors import CarpoolError, WireError, WireVersionMismatch
from carpool.redis_edge.store import Claimed
from carpool.wire import (
    WIRE_VERSION,
    BatchMessage,
    RequestSlot,
    batch_message,
    batch_report,
    read_batch,
    read_report,
)
from tests.unit.fakes import AnswersByFinish


def slot(request_id: str, ids: list[int] | None = None, deadline: float = 2e9) -> RequestSlot:
    ids = ids if ids is not None else [101, 7, 102]
    return {"id": request_id, "item": ids, "len": len(ids), "sent_at": 1.7e9, "deadline": deadline}


def message(requests: list[RequestSlot], **overrides: Any) -> BatchMessage:
    fields: dict[str, Any] = {
        "batch_id": "batch-1",
        "task": "carpool.infer",
        "model": "toy",
        "bin_label": "1-16",
        "flush": "full",
        "padded_len": 8,
        "dispatched_at": 1.7e9,
        "coordinator": "carpool-coordinator-1@host",
        "requests": requests,
    }
    fields.update(overrides)
    return batch_message(**fields)


def report(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "batch_id": "batch-1",
        "model": "toy",
        "worker": "host:1",
        "device": "cpu",
        "bin_label": "1-16",
        "flush": "full",
        "size": 2,
        "padded_len": 8,
        "real_tokens": 9,
        "run_s": 0.004,
        "failed_model": 0,
        "failed_deadline": 1,
        "done_at": 1.7e9,
    }
    fields.update(overrides)
    return dict(batch_report(**fields))


# --- round trips --------------------------------------------------------------------------------
def test_a_batch_message_survives_json_and_reads_back_equal() -> None:
    sent = message([slot("a"), slot("b", ids=None)])
    assert sent["version"] == WIRE_VERSION
    received = read_batch(loads(json.dumps(sent)))
    assert received == sent
    assert [r["id"] for r in received["requests"]] == ["a", "b"]


def test_a_batch_report_survives_json_and_reads_back_equal() -> None:
    sent = report()
    assert sent["padded_tokens"] == 16  # padded length x requests run
    assert read_report(loads(json.dumps(sent))) == sent


# --- versions -----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [WIRE_VERSION + 1, WIRE_VERSION - 1])
def test_a_batch_of_another_version_is_refused_naming_both_versions(version: int) -> None:
    other = {**message([slot("a")]), "version": version}
    with pytest.raises(WireVersionMismatch) as caught:
        read_batch(other)
    text = str(caught.value)
    assert f"wire version {version}" in text and f"reads wire version {WIRE_VERSION}" in text
    assert "coordinator" in text and "another carpool release" in text
    assert "Run one release on every coordinator and worker" in text


def test_a_batch_from_before_versions_is_refused() -> None:
    legacy = dict(message([slot("a")]))
    del legacy["version"]
    with pytest.raises(WireVersionMismatch, match="has no wire version"):
        read_batch(legacy)


def test_a_report_of_another_version_is_refused_naming_the_worker() -> None:
    with pytest.raises(WireVersionMismatch, match=r"the worker that wrote it runs another carpool release"):
        read_report({**report(), "version": WIRE_VERSION + 1})


def test_wire_errors_are_carpool_errors() -> None:
    assert issubclass(WireVersionMismatch, WireError) and issubclass(WireError, CarpoolError)


# --- malformed ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ([1, 2], "is a list, not a JSON object"),
        ("batch", "is a str, not a JSON object"),
        ({"version": WIRE_VERSION, "id": "b"}, "lacks bin, coordinator, dispatched_at, flush, model"),
    ],
)
def test_a_malformed_batch_is_refused_saying_what_is_wrong(value: object, needle: str) -> None:
    with pytest.raises(WireError, match=needle) as caught:
        read_batch(value)
    assert not isinstance(caught.value, WireVersionMismatch)


def test_a_batch_whose_requests_are_not_a_list_is_refused() -> None:
    with pytest.raises(WireError, match="no list of requests"):
        read_batch({**message([]), "requests": {"a": 1}})


def test_a_report_missing_a_field_is_refused() -> None:
    partial = report()
    del partial["run_s"]
    with pytest.raises(WireError, match="lacks run_s"):
        read_report(partial)


# --- the worker, writer of reports and reader of batches ----------------------------------------
class FakeStore(AnswersByFinish):
    """The worker's Redis edge, recording instead of talking to Redis."""

    def __init__(self) -> None:
        self.claimed: list[tuple[str, list[str]]] = []
        self.finished: list[dict[str, Any]] = []

    def claim_fresh(
        self,
        batch_id: str,
        ids: Sequence[str],
        result_keys: Sequence[str],
        db: int,
        lists: Sequence[str],
        take: str = "",
    ) -> Claimed:
        self.claimed.append((batch_id, list(ids)))
        return Claimed([1] * len(ids), 0)

    def claim(self, batch_id: str, ids: Sequence[str]) -> list[bool]:
        self.claimed.append((batch_id, list(ids)))
        return [True] * len(ids)

    def finish(self, **kwargs: Any) -> list[int]:
        self.finished.append(kwargs)
        return list(range(1, len(kwargs["writes"].payloads) + 1))  # every result stored


@pytest.fixture
def runtime() -> Any:
    from carpool.celery_edge.app import app
    from carpool.gpu_worker.runtime import WorkerRuntime

    rt = WorkerRuntime(app)
    rt.device = "cpu"
    rt.dbs = (0, 1)  # results on the broker's server: one finish script
    rt.events.mode = False
    rt.store = FakeStore()  # type: ignore[assignment]
    return rt


def test_the_worker_refuses_a_batch_of_another_version_before_claiming_anything(runtime: Any) -> None:
    other = {**message([slot("a"), slot("b")]), "version": WIRE_VERSION + 1}
    with pytest.raises(WireVersionMismatch):
        runtime.run(other)
    # Nothing claimed or acknowledged: the requests stay leased and return through lease recovery.
    assert runtime.store.claimed == [] and runtime.store.finished == []
    assert runtime._inline_ids == []


def test_the_workers_report_is_what_the_coordinator_reads(runtime: Any) -> None:
    late = slot("late", deadline=1.0)  # its deadline passed long before the batch started
    expired: RequestSlot = {**slot("expired", deadline=1.0), "expires": True}  # its caller's expires=
    sent = message([slot("a", ids=[1, 5, 9]), slot("b", ids=[1, 6]), late, expired])
    returned = runtime.run(loads(json.dumps(sent)))
    assert runtime.store.claimed == [("batch-1", ["a", "b", "late", "expired"])]
    [finish] = runtime.store.finished
    assert finish["coordinator"] == "carpool-coordinator-1@host"
    assert finish["ack_ids"] == ["a", "b", "late", "expired"]
    metas = {m["task_id"]: m for m in map(runtime.backend.decode, finish["writes"].payloads)}
    statuses = {k: m["status"] for k, m in metas.items()}
    assert statuses == {"a": "SUCCESS", "b": "SUCCESS", "late": "FAILURE", "expired": "REVOKED"}
    assert metas["late"]["result"]["exc_type"] == "DeadlineExceeded"
    expired_as = metas["expired"]["result"]
    assert (expired_as["exc_type"], expired_as["exc_message"]) == ("TaskRevokedError", ["expired"])
    got = read_report(loads(json.dumps(finish["report"])))
    assert got == returned
    assert got["batch_id"] == "batch-1" and got["bin"] == "1-16" and got["flush"] == "full"
    assert got["size"] == 2 and got["real_tokens"] == 5
    assert got["padded_len"] == 8 and got["padded_tokens"] == 16
    assert got["failed_deadline"] == 2 and got["failed_model"] == 0
    assert got["run_s"] is not None and got["run_s"] > 0
