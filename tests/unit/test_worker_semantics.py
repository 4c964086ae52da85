"""The worker's side of Celery's semantics, with its Redis edge faked: revoked requests are answered
REVOKED without running, callbacks follow only the results this run stored, and a failure goes on
to the rest of its chain in the batch's one finish script."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import TaskRevokedError
from celery.worker import state

from carpool.celery_edge import links
from carpool.codec import loads_result as loads
from carpool.errors import DeadlineExceeded
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.store import Claimed
from carpool.wire import Links, RequestSlot, batch_message
from tests.unit.fakes import AnswersByFinish


class FakeStore(AnswersByFinish):
    """Claims everything; a finish stores the results at ``stored`` (1-based), all when None."""

    keys = Keys("carpool.requests")

    def __init__(self) -> None:
        self.stored: list[int] | None = None
        self.writes: list[tuple[str, dict[str, Any]]] = []
        self.queued = 0  # batch messages the claim finds queued behind the batch
        self.counted: list[list[str]] = []  # the lists each claim counted
        self.took: list[str] = []  # what each claim's next message had to hold to be taken ('' = none)

    def claim_fresh(
        self,
        batch_id: str,
        ids: Sequence[str],
        keys: Sequence[str],
        db: int,
        lists: Sequence[str],
        take: str = "",
    ) -> Claimed:
        self.counted.append(list(lists))
        self.took.append(take)
        return Claimed([1] * len(ids), self.queued)

    def finish(self, **kwargs: Any) -> list[int]:
        writes = kwargs["writes"]
        self.writes = [(loads(p)["task_id"], loads(p)) for p in writes.payloads]
        return self.stored if self.stored is not None else list(range(1, len(writes.payloads) + 1))


@pytest.fixture
def runtime() -> Any:
    from carpool.celery_edge.app import app
    from carpool.gpu_worker.runtime import WorkerRuntime

    rt = WorkerRuntime(app)
    rt.device = "cpu"
    rt.dbs = (0, 1)
    rt.events.mode = False
    rt.store = FakeStore()  # type: ignore[assignment]
    return rt


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """The links the worker applies: ("success", id, result) and ("failure", id, exception)."""
    out: list[tuple[str, str, Any]] = []

    def on_success(app: Any, request_id: str, lk: Links, result: Any, send: Any = None) -> list[Any]:
        assert callable(send), "the worker retries its sends while Redis is unreachable"
        out.append(("success", request_id, result))
        return []

    def on_failure(
        app: Any,
        request_id: str,
        task: str | None,
        lk: Links,
        exc: BaseException,
        hostname: str | None = None,
        send: Any = None,
    ) -> None:
        assert hostname is not None and hostname.startswith("carpool-gpu-"), "the worker's node name"
        assert callable(send), "the worker retries its sends while Redis is unreachable"
        out.append(("failure", request_id, exc))

    monkeypatch.setattr(links, "on_success", on_success)
    monkeypatch.setattr(links, "on_failure", on_failure)
    return out


@pytest.fixture
def revoked() -> Iterator[set[str]]:
    ids: set[str] = set()
    yield ids
    for task_id in ids:
        state.revoked.discard(task_id)


def slot(request_id: str, deadline: float = 2e9, **extra: Any) -> RequestSlot:
    fields = {"id": request_id, "item": [101, 7, 102], "len": 3, "sent_at": 1.7e9, "deadline": deadline}
    return {**fields, **extra}  # type: ignore[typeddict-item]


def batch(*slots: RequestSlot) -> Any:
    return batch_message(
        batch_id="batch-1",
        task="carpool.infer",
        model="toy",
        bin_label="1-16",
        flush="full",
        padded_len=8,
        dispatched_at=1.7e9,
        coordinator="c",
        requests=list(slots),
    )


def test_a_revoked_request_is_answered_revoked_without_running(
    runtime: Any, applied: list[Any], revoked: set[str]
) -> None:
    state.revoked.add("gone")
    revoked.add("gone")
    linked: Links = {"callbacks": [{"task": "x", "args": [], "kwargs": {}, "options": {}}]}
    report = runtime.run(batch(slot("gone", links=linked), slot("kept")))
    metas = dict(runtime.store.writes)
    assert metas["gone"]["status"] == "REVOKED"
    assert metas["gone"]["result"]["exc_type"] == "TaskRevokedError"
    assert metas["kept"]["status"] == "SUCCESS"
    assert report["size"] == 1, "only the kept request ran"
    assert applied == [], "a revoked request's callbacks are not applied"


def test_links_follow_only_the_results_this_run_stored(runtime: Any, applied: list[Any]) -> None:
    linked: Links = {"callbacks": [{"task": "x", "args": [], "kwargs": {}, "options": {}}]}
    runtime.store.stored = [2]  # "a" had a result already (another run stored it first)
    runtime.run(batch(slot("a", links=linked), slot("b", links=linked), slot("c")))
    assert [(kind, request_id) for kind, request_id, _ in applied] == [("success", "b")]
    assert isinstance(applied[0][2], list) and len(applied[0][2]) == 32


def test_a_failure_goes_on_to_its_chain_in_the_same_finish_then_to_its_error_callbacks(
    runtime: Any, applied: list[Any]
) -> None:
    step = {"task": "carpool.infer", "args": [], "kwargs": {}, "options": {"task_id": "next"}}
    linked: Links = {"chain": [step], "errbacks": [{"task": "e", "args": [], "kwargs": {}, "options": {}}]}
    runtime.run(batch(slot("late", deadline=1.0, links=linked)))
    metas = dict(runtime.store.writes)
    assert metas["late"]["status"] == metas["next"]["status"] == "FAILURE"
    assert metas["next"]["result"] == metas["late"]["result"]
    [(kind, request_id, exc)] = applied
    assert (kind, request_id) == ("failure", "late") and isinstance(exc, DeadlineExceeded)


class CountingClient:
    """Records the HINCRBYs the worker sends outside its finish script."""

    def __init__(self) -> None:
        self.counted: dict[str, int] = {}

    def hincrby(self, key: str, field: str, amount: int) -> int:
        self.counted[f"{key} {field}"] = self.counted.get(f"{key} {field}", 0) + amount
        return self.counted[f"{key} {field}"]


def test_results_write_once_refused_are_counted_in_the_stats_hash(runtime: Any) -> None:
    from carpool.redis_edge.keys import REJECTED_WRITES

    client = CountingClient()
    runtime.client = client
    runtime.run(batch(slot("a"), slot("b"), slot("c")))
    assert client.counted == {}, "nothing refused, nothing counted (and no extra round trip)"
    runtime.store.stored = [2]  # "a" and "c" were answered meanwhile by another run
    runtime.run(batch(slot("a"), slot("b"), slot("c")))
    assert client.counted == {f"{runtime.store.keys.stats} {REJECTED_WRITES}": 2}


class RecordingFinisher:
    """Runs each job at once, noting the ids of each batch handed to it; ``holding`` earlier batches
    still being stored, as it says."""

    def __init__(self) -> None:
        self.handed: list[list[str]] = []
        self.holding = 0

    def submit(self, job: Any, ids: list[str]) -> None:
        self.handed.append(ids)
        job()

    def held(self) -> int:
        return self.holding


def test_results_go_to_the_finisher_thread_when_another_batch_is_queued_or_earlier_ones_are_stored(
    runtime: Any,
) -> None:
    finisher = runtime._finisher = RecordingFinisher()
    runtime.run(batch(slot("alone")))
    assert finisher.handed == [], "nothing to overlap with: stored inline"
    assert [task_id for task_id, _ in runtime.store.writes] == ["alone"]
    [counted] = runtime.store.counted
    assert runtime.settings.batch_queue in counted, "the claim counts what waits on the worker's queues"
    runtime.store.queued = 1
    runtime.run(batch(slot("busy")))
    assert finisher.handed == [["busy"]]
    assert [task_id for task_id, _ in runtime.store.writes] == ["busy"]
    # Nothing queued, but the finisher still stores earlier batches: this one's results go behind
    # theirs, so results are stored in the order their batches ran.
    runtime.store.queued = 0
    finisher.holding = 1
    runtime.run(batch(slot("after")))
    assert finisher.handed == [["busy"], ["after"]]


class _SetForFirst:
    """A model whose first row's output is a set, which no result serializer stores."""

    pad_id = 0

    def forward(self, ids: Any, mask: Any) -> list[Any]:
        return [{"seen": {1}} if i == 0 else [0.5, float(i)] for i in range(len(ids))]


def test_an_output_that_cannot_be_stored_fails_its_request_in_the_store_events_report_and_links(
    runtime: Any, applied: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from carpool.celery_edge.events import TaskEvents
    from carpool.errors import ModelError
    from carpool.gpu_worker import runner

    monkeypatch.setitem(runner._loaded, "toy", _SetForFirst())
    shown: list[tuple[str, str]] = []
    outcomes = TaskEvents.outcomes

    def recording(self: TaskEvents, entries: list[tuple[str, str, Any]], runtime_s: float) -> None:
        shown.extend((task_id, state) for task_id, state, _ in entries)
        outcomes(self, entries, runtime_s)

    monkeypatch.setattr(TaskEvents, "outcomes", recording)
    step = {"task": "carpool.infer", "args": [], "kwargs": {}, "options": {"task_id": "next"}}
    linked: Links = {"chain": [step], "errbacks": [{"task": "e", "args": [], "kwargs": {}, "options": {}}]}
    report = runtime.run(batch(slot("odd", links=linked), slot("fine", links=linked)))
    metas = dict(runtime.store.writes)
    assert metas["odd"]["status"] == metas["next"]["status"] == "FAILURE", "its chain fails with it"
    assert "cannot be stored as msgpack" in metas["odd"]["result"]["exc_message"][0]
    assert metas["fine"]["status"] == "SUCCESS" and metas["fine"]["result"] == [0.5, 1.0]
    assert shown == [("odd", "FAILURE"), ("fine", "SUCCESS")], "its task event says what is stored"
    assert report["failed_model"] == 1
    assert [(kind, request_id) for kind, request_id, _ in applied] == [
        ("failure", "odd"),
        ("success", "fine"),
    ]
    assert isinstance(applied[0][2], ModelError)
    # The worker's log names it as a Celery worker names a task that raised (found by the ops
    # review: a failed request left no line in the worker's log).
    [logged] = [r for r in caplog.records if r.levelname == "ERROR" and "[odd]" in r.getMessage()]
    assert logged.getMessage().startswith("Task carpool.infer[odd] raised: ModelError: ")
    assert "fine" not in caplog.text


def test_a_batchs_failures_are_logged_one_by_one_up_to_a_bound(caplog: pytest.LogCaptureFixture) -> None:
    from carpool.errors import DeadlineExceeded, InvalidInput
    from carpool.gpu_worker.finish import LOGGED_FAILURES, log_failures

    def raised() -> ValueError:
        try:
            raise ValueError("boom in batch")
        except ValueError as exc:
            return exc

    entries = [("ok", "SUCCESS", 1), ("late", "FAILURE", DeadlineExceeded("deadline passed"))]
    entries += [(f"bad{i}", "FAILURE", raised()) for i in range(LOGGED_FAILURES + 2)]
    entries += [("odd", "FAILURE", InvalidInput("not a text"))]
    log_failures("my.task", "b1", entries)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == ("WARNING", "Task my.task[late] failed: DeadlineExceeded: deadline passed")
    assert lines[1] == ("ERROR", "Task my.task[bad0] raised: ValueError: boom in batch")
    assert len(lines) == LOGGED_FAILURES + 1
    assert lines[-1] == ("ERROR", "batch b1: 4 more requests of my.task failed (InvalidInput, ValueError)")
    assert 'raise ValueError("boom in batch")' in caplog.text, "with its traceback"
    assert "[ok]" not in caplog.text


class _Unreadable(Exception):
    def __str__(self) -> str:
        raise AttributeError("the message was never set")


class _RaisesForFirst:
    """A model that raises an exception whose message cannot be read for any batch holding the
    token 7 (the runner then runs each row alone, to fail only the culprit)."""

    pad_id = 0

    def forward(self, ids: Any, mask: Any) -> list[Any]:
        if (ids == 7).any():
            raise _Unreadable()
        return [[0.5] for _ in range(len(ids))]


def test_a_model_error_whose_message_cannot_be_read_fails_its_request_alone(
    runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from carpool.gpu_worker import runner

    monkeypatch.setitem(runner._loaded, "toy", _RaisesForFirst())
    runtime.run(batch(slot("culprit", item=[101, 7, 102]), slot("fine", item=[101, 3, 102])))
    metas = dict(runtime.store.writes)
    assert metas["fine"]["status"] == "SUCCESS" and metas["fine"]["result"] == [0.5], metas
    assert metas["culprit"]["status"] == "FAILURE"
    assert metas["culprit"]["result"]["exc_message"] == ["_Unreadable (its message could not be read)"]


class _RaisesOnSeven:
    """A model that raises for any batch holding the token 7, and is slow enough to time."""

    pad_id = 0

    def forward(self, ids: Any, mask: Any) -> list[Any]:
        if (ids == 7).any():
            raise ValueError("cannot take 7")
        time.sleep(0.01)
        return [[0.5] for _ in range(len(ids))]


def test_the_requests_of_a_split_batch_show_how_long_it_ran_not_zero(
    runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure splits the batch and leaves the report's run time out (it says nothing about the
    latency model), but each request's event still carries the batch's: Flower leaves a runtime of
    0 out of its figures."""
    from carpool.celery_edge.events import TaskEvents
    from carpool.gpu_worker import runner

    monkeypatch.setitem(runner._loaded, "toy", _RaisesOnSeven())
    runtimes: list[float] = []
    outcomes = TaskEvents.outcomes

    def recording(self: TaskEvents, entries: list[tuple[str, str, Any]], runtime_s: float) -> None:
        runtimes.append(runtime_s)
        outcomes(self, entries, runtime_s)

    monkeypatch.setattr(TaskEvents, "outcomes", recording)
    report = runtime.run(batch(slot("fine", item=[101, 3, 102]), slot("culprit", item=[101, 7, 102])))
    assert report["run_s"] is None and report["failed_model"] == 1
    assert runtimes and runtimes[0] >= 0.01


def test_a_worker_learns_at_start_the_revokes_coordinators_recorded(
    runtime: Any, applied: list[Any], revoked: set[str]
) -> None:
    """Revoked after its batch was dispatched, before this worker started: Celery's remote control
    never told this worker, the coordinators' record in Redis does."""
    import time

    revoked.add("recorded")
    runtime.store.revoked_since = lambda since_s: [("recorded", time.time() - 60.0)]
    runtime._learn_revokes()
    report = runtime.run(batch(slot("recorded"), slot("kept")))
    metas = dict(runtime.store.writes)
    assert metas["recorded"]["status"] == "REVOKED" and metas["kept"]["status"] == "SUCCESS"
    assert report["size"] == 1


def test_a_request_revoked_while_its_batch_runs_is_answered_and_shown_revoked(
    runtime: Any, applied: list[Any], revoked: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery's revoke handler stores REVOKED (write-once here) as soon as it hears the broadcast, so
    a request revoked while its batch runs keeps that answer: its events say revoked, not succeeded,
    and its callbacks do not run."""
    from carpool.celery_edge.events import TaskEvents

    shown: list[tuple[str, str]] = []
    outcomes = TaskEvents.outcomes

    def recording(self: TaskEvents, entries: list[tuple[str, str, Any]], runtime_s: float) -> None:
        shown.extend((task_id, status) for task_id, status, _ in entries)
        outcomes(self, entries, runtime_s)

    monkeypatch.setattr(TaskEvents, "outcomes", recording)
    forward = runtime._forward

    def revoked_during_the_run(*args: Any, **kwargs: Any) -> Any:
        state.revoked.add("late")  # what Celery's revoke handler does first, on its own thread
        revoked.add("late")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runtime, "_forward", revoked_during_the_run)
    linked: Links = {"callbacks": [{"task": "x", "args": [], "kwargs": {}, "options": {}}]}
    report = runtime.run(batch(slot("late", links=linked), slot("kept", links=linked)))
    metas = dict(runtime.store.writes)
    assert metas["late"]["status"] == "REVOKED" and metas["kept"]["status"] == "SUCCESS"
    assert sorted(shown) == [("kept", "SUCCESS"), ("late", "REVOKED")]
    assert report["size"] == 2, "both ran: the revoke came after the batch started"
    assert [a[:2] for a in applied] == [("success", "kept")]


@pytest.fixture
def answered_meanwhile(runtime: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Of a batch of "gone", "done" and "kept", the claim finds "gone" answered REVOKED (Celery's
    revoke handler stored it) and "done" answered SUCCESS (a rerun after recovery); returns the ids
    said revoked in events (see :func:`hear_revoked`)."""
    from carpool.celery_edge.events import TaskEvents

    stored = {
        runtime.backend.get_key_for_task(task_id): runtime.backend.meta_for(task_id, status, value, "2026")
        for task_id, status, value in [
            ("gone", "REVOKED", TaskRevokedError("revoked")),
            ("done", "SUCCESS", [1.0]),
        ]
    }
    monkeypatch.setattr(
        runtime.backend, "client", SimpleNamespace(mget=lambda keys: [stored.get(k) for k in keys])
    )
    flags = {"gone": 2, "done": 2, "kept": 1}
    monkeypatch.setattr(
        runtime.store, "claim_fresh", lambda batch_id, ids, *a, **k: Claimed([flags[i] for i in ids], 0)
    )
    shown: list[str] = []
    monkeypatch.setattr(TaskEvents, "revoked", lambda self, task_id, expired=False: shown.append(task_id))
    return shown


def hear_revoked(revoked: set[str]) -> None:
    """This worker hears "gone" and "done" revoked (the second after its answer)."""
    for task_id in ("gone", "done"):
        state.revoked.add(task_id)
        revoked.add(task_id)


def test_a_request_found_answered_revoked_at_its_claim_is_shown_revoked(
    runtime: Any, answered_meanwhile: list[str], revoked: set[str]
) -> None:
    """Revoked while its batch waited for this worker: the claim finds the REVOKED Celery's handler
    stored, and the batch's events say so (Flower showed it received for ever). A request answered
    otherwise (a rerun after recovery) gets no second event."""
    hear_revoked(revoked)
    report = runtime.run(batch(slot("gone"), slot("done"), slot("kept")))
    assert answered_meanwhile == ["gone"]
    assert [task_id for task_id, _ in runtime.store.writes] == ["kept"] and report["size"] == 1


def test_a_request_revoked_while_its_batch_waited_behind_a_long_one_is_shown_revoked(
    runtime: Any, answered_meanwhile: list[str], revoked: set[str]
) -> None:
    """A batch that waited in the device stage longer than a quarter lease is claimed again as it
    starts; a request that claim finds answered REVOKED gets its task-revoked event (Flower showed it
    received for ever), one answered otherwise none."""
    from carpool.gpu_worker.claimed import claimed_batch

    message = batch(slot("gone"), slot("done"), slot("kept"))
    waited = claimed_batch(message, [1, 1, 1], 1, None, 0.0, runtime.events.fork())
    waited.claimed_at = time.perf_counter() - runtime.settings.recovery_timeout_s  # waited past a quarter
    hear_revoked(revoked)  # while it waited
    runtime._claim_again_if_waited(waited)
    assert answered_meanwhile == ["gone"]
    assert [r["id"] for r in waited.to_run] == ["kept"] and waited.answered == ["gone", "done"]


def test_outcomes_of_requests_answered_meanwhile_are_dropped_or_said_revoked() -> None:
    from carpool.celery_edge.events import answered_elsewhere

    header = {"hostname": "w", "timestamp": 1.0, "clock": 3}
    events = [
        {**header, "type": "task-started", "uuid": "revoked"},
        {**header, "type": "task-succeeded", "uuid": "revoked", "result": "[1]", "runtime": 0.1},
        {**header, "type": "task-failed", "uuid": "reran", "exception": "E()", "traceback": "tb"},
        {**header, "type": "task-succeeded", "uuid": "kept", "result": "[2]", "runtime": 0.1},
        {**header, "type": "task-succeeded", "uuid": "batch-1", "result": "{}", "runtime": 0.2},
    ]
    out = answered_elsewhere(events, refused={"revoked", "reran"}, revoked={"revoked"})
    assert [(e["type"], e["uuid"]) for e in out] == [
        ("task-started", "revoked"),
        ("task-revoked", "revoked"),
        ("task-succeeded", "kept"),
        ("task-succeeded", "batch-1"),
    ]
    said = out[1]
    assert said["expired"] is False and said["terminated"] is False and "result" not in said
    assert said["hostname"] == "w" and said["clock"] == 3
    assert events[1]["type"] == "task-succeeded", "the events given are left as they were"


@pytest.mark.parametrize("multiple", [1, 16])
def test_a_batched_tasks_report_counts_padding_with_its_own_pad_multiple(runtime: Any, multiple: int) -> None:
    """The coordinator predicts a batch's time from its padded tokens counted with the task's
    ``pad_multiple``; the worker's report, which its latency model learns from, counts them so too
    (until 2026-12-06 with carpool.infer's 8: a @batched task's batches were predicted 8x short)."""
    from carpool.registry import BatchedSpec

    def fn(items: list[Any]) -> list[Any]:
        return items

    fn.pad_multiple = multiple  # type: ignore[attr-defined]
    spec = BatchedSpec("unit.padded_counts", fn, len)
    runtime.specs = {**runtime.specs, spec.name: spec}
    runtime.served = frozenset({*runtime.served, spec.name})
    message = batch(slot("a", item="abc", len=3), slot("b", item="hello", len=5))
    message["task"], message["model"] = spec.name, spec.name
    report = runtime.run(message)
    assert report["padded_len"] == (5 if multiple == 1 else 16)
    assert report["padded_tokens"] == 2 * report["padded_len"]
    assert dict(runtime.store.writes)["b"]["result"] == "hello"


class _LosesTheDevice:
    """A model whose device fails for good at its first batch, as CUDA after a device-side assert."""

    pad_id = 0

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, ids: Any, mask: Any) -> list[Any]:
        import torch

        self.calls += 1
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")


def test_a_device_lost_for_good_fails_its_batch_whole_and_stops_the_worker(
    runtime: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Splitting would call a device that fails every call, and a worker that went on would answer
    every batch it takes with the same error while it heartbeats: it stops, to be restarted."""
    from celery.worker import state as worker_state

    from carpool.gpu_worker import runner

    model = _LosesTheDevice()
    monkeypatch.setitem(runner._loaded, "toy", model)
    monkeypatch.setattr(worker_state, "should_stop", None)
    report = runtime.run(batch(slot("a"), slot("b"), slot("c")))
    metas = dict(runtime.store.writes)
    assert {metas[i]["result"]["exc_type"] for i in "abc"} == {"DeviceLost"}
    assert "device-side assert triggered" in metas["a"]["result"]["exc_message"][0]
    assert model.calls == 1, "not split: no half would run either"
    assert report["failed_model"] == 3
    assert worker_state.should_stop == 1 and "this worker stops (exit status 1)" in caplog.text
    assert runtime._take is False, "its claims take no more batch messages"


def test_running_out_of_device_memory_a_library_status_or_a_models_own_error_is_not_a_lost_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from carpool.errors import device_lost

    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert device_lost(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert not device_lost(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not device_lost(cublas)  # worded as a CUDA error by torch, but the context is fine
    assert not device_lost(RuntimeError("CUDA error: device-side assert triggered"))  # not torch's class
    assert not device_lost(RuntimeError("shape mismatch"))
    monkeypatch.delattr(torch, "AcceleratorError")  # torch before 2.8, which words them all so
    assert device_lost(RuntimeError("CUDA error: device-side assert triggered"))
    assert not device_lost(cublas)
    assert not device_lost(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
