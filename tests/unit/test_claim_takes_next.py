"""A batch's claim may take the next batch message off the batch queue; the worker then runs it in
the same Celery task, as Celery would have delivered it. Here the worker's Redis edge is faked: the
claim hands out the messages of ``FakeStore.queues`` (the first of the lists it names holding one);
the message reading, the device stage and the finisher are the real ones."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from carpool.celery_edge.received import accepted, marker, read_task
from carpool.codec import loads_result as loads
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.store import Claimed
from carpool.wire import RequestSlot, batch_message
from tests.unit.fakes import AnswersByFinish
from tests.unit.messages import message

RUN_BATCH = "carpool.run_batch"
QUEUE = "carpool.batches"


class FakeStore(AnswersByFinish):
    """Claims everything; each claim asked to take gets the next message of the first of its lists
    holding one in ``queues``, if it holds the text asked for."""

    keys = Keys("carpool.requests")

    def __init__(self) -> None:
        self.queues: dict[str, list[bytes]] = {QUEUE: []}
        self.takes: list[str] = []  # what each claim was asked to take ('' = nothing)
        self.claimed: list[str] = []  # batch ids, in claim order
        self.stored: list[str] = []  # request ids whose results were stored, in order

    @property
    def queue(self) -> list[bytes]:
        return self.queues[QUEUE]

    @queue.setter
    def queue(self, messages: list[bytes]) -> None:
        self.queues[QUEUE] = messages

    def claim_fresh(
        self,
        batch_id: str,
        ids: Sequence[str],
        keys: Sequence[str],
        db: int,
        lists: Sequence[str],
        take: str = "",
    ) -> Claimed:
        self.takes.append(take)
        self.claimed.append(batch_id)
        queued = sum(len(self.queues.get(name, [])) for name in lists)
        first = next((name for name in lists if self.queues.get(name)), None)
        if not take or first is None or take.encode() not in self.queues[first][0]:
            return Claimed([1] * len(ids), queued)
        return Claimed([1] * len(ids), queued, (first, self.queues[first].pop(0)))

    def heartbeat(self, hostname: str, ttl_s: float, batch_queues: Sequence[str] | None = None) -> None:
        pass

    def leave(self, hostname: str) -> None:
        pass

    def renew_running(self, ids: list[str]) -> None:
        pass

    def finish(self, **kwargs: Any) -> list[int]:
        payloads = kwargs["writes"].payloads
        self.stored += [loads(p)["task_id"] for p in payloads]
        return list(range(1, len(payloads) + 1))


class FakeClient:
    def __init__(self) -> None:
        self.pushed: list[tuple[str, bytes]] = []

    def rpush(self, key: str, value: bytes) -> None:
        self.pushed.append((key, value))


HANG_S = 5.0  # a bound on waits that only a hang exceeds


def bare_runtime() -> Any:
    """A worker runtime on the fake Redis edge, without a device stage or a finisher."""
    from carpool.celery_edge.app import app
    from carpool.gpu_worker.runtime import WorkerRuntime

    rt: Any = WorkerRuntime(app)
    rt.device, rt.dbs, rt.events.mode = "cpu", (0, 1), False
    rt.store = FakeStore()
    rt.client = FakeClient()
    return rt


@pytest.fixture
def runtime() -> Iterator[Any]:
    """:func:`bare_runtime` with a device stage and a finisher, as a started worker has them."""
    from carpool.gpu_worker.stage import DeviceStage, Finisher

    rt = bare_runtime()
    rt._stage, rt._finisher = DeviceStage(), Finisher()
    yield rt
    settled(rt)


def settled(rt: Any) -> Any:
    """``rt`` once every batch handed to its device stage ran and had its results stored."""
    assert rt._stage.drain(HANG_S) and rt._finisher.drain(HANG_S)
    return rt


def batch(batch_id: str, *request_ids: str) -> Any:
    slots: list[RequestSlot] = [
        {"id": r, "item": [101, 7, 102], "len": 3, "sent_at": 1.7e9, "deadline": 2e9} for r in request_ids
    ]
    return batch_message(
        batch_id=batch_id,
        task="carpool.infer",
        model="toy",
        bin_label="1-16",
        flush="full",
        padded_len=8,
        dispatched_at=1.7e9,
        coordinator="c",
        requests=slots,
    )


def batch_task(task_id: str, batch_id: str, *request_ids: str, **options: Any) -> bytes:
    """A ``carpool.run_batch`` message as it waits on the batch queue's list."""
    return message(task_id, batch(batch_id, *request_ids), task=RUN_BATCH, **options)


def test_a_batch_taken_by_a_claim_runs_in_the_same_task_then_the_one_its_own_claim_took(
    runtime: Any,
) -> None:
    from celery.worker import state

    store = runtime.store
    store.queue = [batch_task("t2", "b2", "c", "d"), batch_task("t3", "b3", "e")]
    counted = state.total_count[RUN_BATCH]
    runtime.run(batch("b1", "a", "b"))
    assert store.claimed == ["b1", "b2", "b3"]
    assert settled(runtime).store.stored == ["a", "b", "c", "d", "e"]
    assert store.queue == []
    assert store.takes == [marker(RUN_BATCH)] * 3, "each claim may take the next"
    # In Celery's own totals (`celery inspect stats`) as if Celery had delivered them; the batch
    # Celery delivered is counted by Celery itself, not here.
    assert state.total_count[RUN_BATCH] - counted == 2


def test_a_message_not_to_run_now_goes_back_to_the_front_of_its_list(runtime: Any) -> None:
    later = batch_task("t2", "b2", "c", eta="2099-01-01T00:00:00+00:00")
    runtime.store.queue = [later]
    runtime.run(batch("b1", "a"))
    assert settled(runtime).store.stored == ["a"], "the countdown's batch did not run"
    assert runtime.client.pushed == [(QUEUE, later)], "pushed back where BRPOP takes the next from"


def test_a_taken_batch_the_worker_cannot_read_is_left_to_recovery_and_the_task_still_succeeds(
    runtime: Any, caplog: pytest.LogCaptureFixture
) -> None:
    unreadable = message("t2", {"version": 999, "id": "b2"}, task=RUN_BATCH)
    runtime.store.queue = [unreadable, batch_task("t3", "b3", "e")]
    with caplog.at_level(logging.ERROR):
        runtime.run(batch("b1", "a"))
    assert settled(runtime).store.stored == ["a"]
    assert "refusing batch t2" in caplog.text
    assert runtime.client.pushed == [], "a message this release cannot read is left to recovery"
    assert runtime.store.queue == [batch_task("t3", "b3", "e")], "the run of taken batches ended there"


def test_no_batch_is_taken_once_the_worker_is_shutting_down(runtime: Any) -> None:
    runtime.store.queue = [batch_task("t2", "b2", "c")]
    runtime.shutting_down()
    runtime.run(batch("b1", "a"))
    assert runtime.store.takes == [""] and len(runtime.store.queue) == 1


def test_a_warm_shutdown_waits_for_the_batch_on_the_device_however_long_saying_so(
    runtime: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """It gave a batch on the device thread up after 30 s; the worker exited 0 and the batch ran
    again on another worker. Celery's warm shutdown waits for the task it runs."""
    import threading

    from carpool.gpu_worker import runtime as module

    monkeypatch.setattr(module, "SHUTDOWN_REPORT_S", 0.05)
    release, ran = threading.Event(), []
    runtime._stage.submit(lambda: ran.append(release.wait(HANG_S)), ["r1"])
    stopping = threading.Thread(target=runtime.stop)
    with caplog.at_level(logging.INFO, logger=module.__name__):
        stopping.start()
        stopping.join(0.5)  # ten report intervals
        assert stopping.is_alive() and not ran, "stop() waits for the batch on the device"
        release.set()
        stopping.join(HANG_S)
    assert not stopping.is_alive() and ran == [True], "the batch ran to its end before the worker left"
    assert "stopping once 1 batches on the device are done" in caplog.text


def test_a_task_takes_batches_for_a_bounded_time_then_returns_to_celery(
    runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from carpool.gpu_worker import runtime as module

    monkeypatch.setattr(module, "TAKE_FOR_S", 0.0)
    runtime.store.queue = [batch_task("t2", "b2", "c")]
    runtime.run(batch("b1", "a"))
    assert runtime.store.takes == [""] and len(runtime.store.queue) == 1


def test_with_claim_takes_next_off_every_batch_comes_through_celery() -> None:
    from carpool.celery_edge.app import app
    from carpool.gpu_worker.runtime import WorkerRuntime
    from carpool.gpu_worker.stage import DeviceStage, Finisher

    saved = app.carpool.settings
    app.carpool.settings = saved.model_copy(update={"claim_takes_next": False})
    try:
        off: Any = WorkerRuntime(app)
    finally:
        app.carpool.settings = saved
    off.device, off.dbs, off.events.mode = "cpu", (0, 1), False
    off.store, off.client = FakeStore(), FakeClient()
    off._stage, off._finisher = DeviceStage(), Finisher()
    off.store.queue = [batch_task("t2", "b2", "c")]
    off.run(batch("b1", "a"))
    assert settled(off).store.takes == [""] and off.store.stored == ["a"] and len(off.store.queue) == 1


def test_without_a_device_stage_nothing_is_taken() -> None:
    """Batches run one at a time on the Celery thread: a batch taken would wait for this one to run
    while another worker could have it."""
    rt = bare_runtime()
    rt.store.queue = [batch_task("t2", "b2", "c")]
    rt.run(batch("b1", "a"))
    assert rt.store.takes == [""] and rt.store.stored == ["a"] and len(rt.store.queue) == 1


def test_takes_go_round_the_batch_queues_as_kombus_consumer_does(runtime: Any) -> None:
    runtime.batch_lists = ["q1", "q2"]
    runtime.store.queues = {
        "q1": [batch_task(f"t1{i}", f"b1{i}", f"x{i}") for i in range(3)],
        "q2": [batch_task(f"t2{i}", f"b2{i}", f"y{i}") for i in range(3)],
    }
    runtime.run(batch("b0", "a"))
    assert runtime.store.claimed == ["b0", "b10", "b20", "b11", "b21", "b12", "b22"]


def test_a_taken_message_goes_back_when_its_batch_fails_before_its_claim(
    runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A taken message whose batch never reached its claim (here the worker told to stop at once
    while it waited for the device stage) goes back for another worker; the exception goes on."""
    taken = batch_task("t2", "b2", "c")
    runtime.store.queue = [taken]
    waits = iter([None])

    def wait_for_room(timeout: float | None = None) -> None:
        if next(waits, "stop") == "stop":
            raise SystemExit(1)

    monkeypatch.setattr(runtime._stage, "wait_for_room", wait_for_room)
    with pytest.raises(SystemExit):
        runtime.run(batch("b1", "a"))
    assert runtime.store.claimed == ["b1"]
    assert runtime.client.pushed == [(QUEUE, taken)]


def test_a_taken_message_goes_back_when_its_claims_answer_cannot_be_sorted(
    runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from carpool.gpu_worker import runtime as module

    taken = batch_task("t2", "b2", "c")
    runtime.store.queue = [taken]

    def broken(*args: Any) -> Any:
        raise RuntimeError("cannot sort the claim")

    monkeypatch.setattr(module, "claimed_batch", broken)
    with pytest.raises(RuntimeError):
        runtime.run(batch("b1", "a"))
    assert runtime.client.pushed == [(QUEUE, taken)]


def test_a_revoked_batch_task_goes_back_for_celery_to_drop(runtime: Any) -> None:
    from celery.worker import state

    revoked = batch_task("t2", "b2", "c")
    runtime.store.queue = [revoked]
    state.revoked.add("t2")
    try:
        runtime.run(batch("b1", "a"))
    finally:
        state.revoked.discard("t2")
    assert settled(runtime).store.stored == ["a"]
    assert runtime.client.pushed == [(QUEUE, revoked)]


# --- reading a taken message ----------------------------------------------------------------


def test_read_task_gives_the_arguments_and_the_request_fields_the_runtime_reads() -> None:
    raw = message(
        "t1",
        {"id": "b1"},
        task=RUN_BATCH,
        extra_headers={"argsrepr": "size=1", "root_id": "r", "parent_id": "p", "retries": 2},
    )
    task = read_task(raw, RUN_BATCH, accepted(["json"]))
    assert task is not None
    assert task.args == [{"id": "b1"}] and task.kwargs == {}
    request = task.request
    assert (request.id, request.argsrepr, request.kwargsrepr) == ("t1", "size=1", "{}")
    assert (request.root_id, request.parent_id, request.retries) == ("r", "p", 2)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (message("t", 1, task="other.task"), "another task's"),
        (message("t", 1, task=RUN_BATCH, eta="2099-01-01T00:00:00+00:00"), "to run later"),
        (message("t", 1, task=RUN_BATCH, expires="2099-01-01T00:00:00+00:00"), "expires"),
        (message("t", 1, task=RUN_BATCH, extra_headers={"compression": "zlib"}), "compressed"),
        (message("t", 1, task=RUN_BATCH, embed={"callbacks": [{"task": "x"}]}), "with callbacks"),
        (b"not json", "not an envelope"),
        (b'{"headers": {"task": "carpool.run_batch"}}', "no body"),
    ],
)
def test_read_task_leaves_what_celery_must_deliver_itself(raw: bytes, why: str) -> None:
    assert read_task(raw, RUN_BATCH, accepted(["json"])) is None, why


def test_read_task_refuses_a_content_type_the_app_does_not_accept() -> None:
    raw = message("t", 1, task=RUN_BATCH)
    assert read_task(raw, RUN_BATCH, accepted(["json"])) is not None
    assert read_task(raw, RUN_BATCH, accepted(["pickle"])) is None
