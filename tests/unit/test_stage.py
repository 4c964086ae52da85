"""The worker's stages: the device stage runs batches beside the next claim and the finisher stores
results beside the next batch, each in order, never more than its depth ahead, holding the leases of
what it holds; a failure leaves the requests to lease recovery."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from carpool.errors import DeadlineExceeded
from carpool.gpu_worker.stage import FINISHER_DEPTH, DeviceStage, Finisher, Stage
from tests.unit.test_worker_semantics import FakeStore, batch, slot

HANG_S = 5.0  # a bound on waits that only a hang exceeds


def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` (another thread's progress), failing only on a hang."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, "hung"
        time.sleep(0.005)


def test_jobs_run_in_order_and_a_new_one_waits_while_the_finisher_holds_its_depth() -> None:
    assert FINISHER_DEPTH == 3
    finisher = Finisher()
    release = threading.Event()
    done: list[str] = []

    def first() -> None:
        release.wait(5)
        done.append("first")

    finisher.submit(first, ["a", "b"])
    assert finisher.pending_ids() == ["a", "b"]  # still held: the heartbeat keeps renewing them
    finisher.submit(lambda: done.append("second"), ["c"])  # room: queued behind the first
    finisher.submit(lambda: done.append("third"), ["d"])
    assert finisher.pending_ids() == ["a", "b", "c", "d"]
    fourth_submitted = threading.Event()

    def submit_fourth() -> None:
        finisher.submit(lambda: done.append("fourth"), ["e"])
        fourth_submitted.set()

    threading.Thread(target=submit_fourth).start()
    assert not fourth_submitted.wait(0.2)  # blocked: three batches at most are held
    release.set()
    assert fourth_submitted.wait(5)
    assert finisher.drain(5)
    assert done == ["first", "second", "third", "fourth"] and finisher.pending_ids() == []


def test_a_failing_job_is_logged_and_the_finisher_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    finisher = Finisher()

    def broken() -> None:
        raise ConnectionError("redis went away for good")

    finisher.submit(broken, ["x"])
    assert finisher.drain(5)
    assert "lease recovery" in caplog.text and finisher.pending_ids() == []
    ran = threading.Event()
    finisher.submit(ran.set, ["y"])
    assert ran.wait(5)


def test_drain_reports_a_job_that_outlasts_it() -> None:
    finisher = Finisher()
    finisher.submit(lambda: time.sleep(0.5), ["slow"])
    assert finisher.drain(0.05) is False
    assert finisher.drain(5) is True


def test_the_device_stage_holds_one_batch_running_and_one_waiting_in_order() -> None:
    stage = DeviceStage()
    release = threading.Event()
    ran: list[str] = []

    def first() -> None:
        release.wait(HANG_S)
        ran.append("k")

    stage.submit(first, ["a"])
    stage.submit(lambda: ran.append("k+1"), ["b", "c"])
    assert stage.held() == 2 and not stage.idle()
    assert stage.pending_ids() == ["a", "b", "c"]
    until(lambda: stage.begun_ids() == ["a"])  # the heartbeat leaves the waiting batch's leases be
    assert stage.wait_for_room(0.05) is False, "full: the Celery thread waits before claiming more"
    release.set()
    assert stage.wait_for_room(HANG_S)
    assert stage.drain(HANG_S) and stage.idle() and stage.pending_ids() == stage.begun_ids() == []
    assert ran == ["k", "k+1"]


def test_a_failing_batch_leaves_the_device_thread_running(caplog: pytest.LogCaptureFixture) -> None:
    stage = DeviceStage()

    def broken() -> None:
        raise RuntimeError("device lost")

    stage.submit(broken, ["x"])
    done = threading.Event()
    stage.submit(done.set, ["y"])
    assert done.wait(HANG_S) and stage.drain(HANG_S)
    assert "running a batch failed" in caplog.text and "lease recovery" in caplog.text


def launching(name: str, log: list[str], gate: threading.Event | None = None) -> Callable[[], object]:
    """A job as a batch on an asynchronous device: it starts, and returns what completes it."""

    def start() -> Callable[[], None]:
        if gate is not None:
            assert gate.wait(HANG_S)
        log.append(f"start {name}")
        return lambda: log.append(f"complete {name}")

    return start


def test_an_asynchronous_device_stage_starts_the_next_batch_before_completing_the_previous() -> None:
    stage = DeviceStage(launches=True)
    log: list[str] = []
    go = threading.Event()
    stage.submit(launching("k", log, go), ["a"])
    stage.submit(launching("k+1", log), ["b"])
    stage.submit(launching("k+2", log), ["c"])
    assert stage.held() == 3 and stage.pending_ids() == ["a", "b", "c"]
    assert stage.wait_for_room(0.05) is False, "two started and one waiting: the Celery thread waits"
    assert stage.begun_ids() == ["a"], "k starting (at its gate); k+1 and k+2 wait"
    go.set()
    assert stage.drain(HANG_S) and stage.pending_ids() == []
    assert log == ["start k", "start k+1", "complete k", "start k+2", "complete k+1", "complete k+2"]


def test_no_batch_is_launched_behind_one_that_has_run_long_so_it_can_go_elsewhere() -> None:
    """Launched behind a slow or hung batch, a batch was held and leased with it: an idle worker
    never got it (found by the review of this change). It now waits unlaunched, unleased."""
    stage = DeviceStage(launches=True, launch_ahead_for_s=0.2)
    log: list[str] = []
    done = threading.Event()

    def slow() -> Callable[[], None]:
        log.append("start slow")

        def complete() -> None:
            done.wait(HANG_S)
            log.append("complete slow")

        return complete

    stage.add_started(slow(), ["a"])
    assert stage.may_start_here(), "a fresh batch: the next may be launched behind it"
    time.sleep(0.3)
    assert not stage.may_start_here(), "not behind one running past a quarter lease"
    stage.submit(launching("next", log), ["b"])
    time.sleep(0.1)
    assert stage.begun_ids() == ["a"] and log == ["start slow"], "the next waits, unlaunched"
    done.set()
    assert stage.drain(HANG_S) and log == ["start slow", "complete slow", "start next", "complete next"]
    assert stage.begun_ids() == [] and stage.may_start_here()


def test_a_batch_queued_behind_a_slow_one_counts_its_run_from_when_that_one_ended() -> None:
    """Its start time was its launch, long before it ran: the next batch waited for its collection
    instead of being launched behind it (found by the review of the mends)."""
    stage = DeviceStage(launches=True, launch_ahead_for_s=0.2)
    log: list[str] = []

    def slow_completion() -> None:
        time.sleep(0.4)  # past launch_ahead_for_s
        log.append("complete A")

    log.append("start A")
    stage.add_started(slow_completion, ["a"])
    assert stage.may_start_here()
    complete_b = launching("B", log)()  # launched behind A while A is fresh
    assert callable(complete_b)
    stage.add_started(complete_b, ["b"])
    stage.submit(launching("C", log), ["c"])
    assert stage.drain(HANG_S)
    assert log == ["start A", "start B", "complete A", "start C", "complete B", "complete C"], log


def test_ctrl_c_or_celerys_shutdown_raised_on_the_stage_thread_stops_the_worker_not_the_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The thread ended alone, and the worker, still heartbeating, waited on it for ever."""
    from celery.exceptions import WorkerShutdown
    from celery.worker import state as worker_state

    monkeypatch.setattr(worker_state, "should_stop", None)
    stage = DeviceStage()
    ran: list[str] = []

    def interrupted() -> None:
        raise KeyboardInterrupt

    def shut_down() -> None:
        raise WorkerShutdown(0)

    for job in (interrupted, shut_down, lambda: ran.append("next")):
        stage.submit(job, ["x"])
    assert stage.drain(HANG_S) and ran == ["next"], "the stage thread runs on"
    assert worker_state.should_stop == 1 and caplog.text.count("raised what stops the worker") == 2


def test_a_lone_started_batch_is_completed_without_waiting_for_another() -> None:
    stage = DeviceStage(launches=True)
    log: list[str] = []
    stage.submit(launching("alone", log), ["a"])
    assert stage.drain(HANG_S) and log == ["start alone", "complete alone"]


def test_a_batch_done_at_its_start_is_released_while_an_earlier_one_is_still_running() -> None:
    stage = DeviceStage(launches=True)
    release = threading.Event()
    done: list[str] = []
    began = threading.Event()

    def running() -> Callable[[], None]:
        began.set()

        def complete() -> None:
            assert release.wait(HANG_S)
            done.append("k")

        return complete

    stage.submit(running, ["a"])
    stage.submit(lambda: done.append("k+1"), ["b"])  # a synchronous batch: complete when it returns
    until(lambda: done == ["k+1"])
    assert began.is_set() and stage.pending_ids() == ["a"], "k stays leased until it completes"
    release.set()
    assert stage.drain(HANG_S) and done == ["k+1", "k"] and stage.pending_ids() == []


def test_a_completion_that_fails_is_logged_and_the_stage_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    stage = DeviceStage(launches=True)
    log: list[str] = []

    def broken() -> Callable[[], None]:
        def complete() -> None:
            raise RuntimeError("device lost while copying back")

        return complete

    stage.submit(broken, ["x"])
    stage.submit(launching("next", log), ["y"])
    assert stage.drain(HANG_S) and stage.pending_ids() == []
    assert log == ["start next", "complete next"]
    assert "running a batch failed" in caplog.text and "device lost" in caplog.text


def test_the_submitting_thread_may_start_a_job_while_the_stage_thread_waits_to_complete_one() -> None:
    stage = DeviceStage(launches=True)
    assert stage.may_start_here(), "nothing held: a job would start at once"
    log: list[str] = []
    device_done = threading.Event()

    def completion(name: str) -> Callable[[], None]:
        def complete() -> None:
            assert device_done.wait(HANG_S)  # the stage's thread waits on the device
            log.append(f"complete {name}")

        return complete

    stage.add_started(completion("k"), ["a"])
    until(lambda: stage._completing)  # the thread now waits on k: it would start nothing else
    assert stage.may_start_here(), "none waiting to start and none started beside k"
    stage.add_started(completion("k+1"), ["b"])
    assert stage.may_start_here(), "one started beside k: room for another ahead"
    stage.add_started(completion("k+2"), ["c"])
    assert not stage.may_start_here(), "the stage holds its depth"
    assert stage.pending_ids() == ["a", "b", "c"], "started here, leased like the others"
    device_done.set()
    assert stage.drain(HANG_S) and stage.pending_ids() == []
    assert log == ["complete k", "complete k+1", "complete k+2"], "completed in the order started"


def test_a_job_waiting_to_start_is_started_by_the_stage_thread_not_the_submitter() -> None:
    stage = DeviceStage(launches=True)
    log: list[str] = []
    gate = threading.Event()
    stage.submit(launching("k", log, gate), ["a"])  # the stage's thread is starting it
    until(lambda: stage.held() == 1 and not stage._started)
    assert not stage.may_start_here(), "k is being started: a job submitted now starts after it"
    stage.submit(launching("k+1", log), ["b"])
    assert not stage.may_start_here()
    gate.set()
    assert stage.drain(HANG_S)
    assert log == ["start k", "start k+1", "complete k", "complete k+1"]


def test_a_stage_needs_room_for_one_job() -> None:
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        Stage("nothing", 0, "nothing")
    with pytest.raises(ValueError, match="ahead must be an integer from 1 to depth"):
        Stage("too far", 2, "too far", ahead=3)


class LeaseStore(FakeStore):
    """:class:`FakeStore` whose finish waits for ``gate``, recording the leases the heartbeat renews."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.renewed: list[str] = []
        self.order: list[str] = []
        self.all_writes: list[tuple[str, dict[str, Any]]] = []

    def heartbeat(self, hostname: str, ttl_s: float, batch_queues: Sequence[str] | None = None) -> None:
        pass

    def leave(self, hostname: str) -> None:
        pass

    def renew_running(self, ids: list[str]) -> None:
        self.renewed = list(ids)

    def finish(self, **kwargs: Any) -> list[int]:
        assert self.gate.wait(HANG_S)
        stored = super().finish(**kwargs)
        self.order += [task_id for task_id, _ in self.writes]
        self.all_writes += self.writes
        return stored


@pytest.fixture
def staged() -> Any:
    from carpool.celery_edge.app import app
    from carpool.gpu_worker.runtime import WorkerRuntime

    rt = WorkerRuntime(app)
    rt.device, rt.dbs, rt.events.mode = "cpu", (0, 1), False
    rt.store = LeaseStore()  # type: ignore[assignment]
    rt._stage, rt._finisher = DeviceStage(), Finisher()
    return rt


def test_batches_run_beside_the_next_claim_and_every_claimed_request_stays_leased(staged: Any) -> None:
    store = staged.store
    store.queued = 1  # a batch queued behind each: hand over to the device thread
    assert staged.run(batch(slot("a"), slot("b"))) is None, "handed to the device stage"
    assert staged.run(batch(slot("c"))) is None
    # "a" and "b" are being stored (their store is held up), "c" waits in the finisher behind them.
    until(lambda: staged._finisher.held() == 2 and staged._stage.idle())
    staged._beat()
    assert sorted(store.renewed) == ["a", "b", "c"]
    store.gate.set()
    staged.stop()
    assert store.order == ["a", "b", "c"], "stored in the order claimed"
    staged._beat()
    assert store.renewed == [], "nothing held once stored"


def test_a_lone_batch_runs_inline_on_the_celery_thread(staged: Any) -> None:
    staged.store.gate.set()
    report = staged.run(batch(slot("alone")))  # nothing queued behind it, device thread idle
    assert report is not None and report["size"] == 1
    assert staged.store.order == ["alone"] and staged._stage.idle()


def test_deadlines_are_checked_when_the_batch_starts_on_the_device(staged: Any) -> None:
    store = staged.store
    store.gate.set()
    store.queued = 1
    busy = threading.Event()
    staged._stage.submit(lambda: busy.wait(HANG_S), [])  # the device is running another batch
    assert staged.run(batch(slot("late", deadline=time.time() + 0.05), slot("ok"))) is None
    time.sleep(0.1)  # its deadline passes while it waits for the device
    busy.set()
    assert staged._stage.drain(HANG_S) and staged._finisher.drain(HANG_S)
    metas = dict(store.writes)
    assert metas["ok"]["status"] == "SUCCESS" and metas["late"]["status"] == "FAILURE"
    assert metas["late"]["result"]["exc_type"] == DeadlineExceeded.__name__


class _Held:
    """Device memory that stays in use while this object lives, as a CUDA tensor's does."""

    def __init__(self, in_use: list[int], units: int) -> None:
        in_use[0] += units
        weakref.finalize(self, _Held.free, in_use, units)

    @staticmethod
    def free(in_use: list[int], units: int) -> None:
        in_use[0] -= units


class LaunchingSpec:
    """``carpool.infer`` on an asynchronous device that the test drives: each launch is recorded
    and returns at once; each collect is recorded, waits for ``device_done`` and gives one output
    per item (its length), or raises for a batch holding ``fails_on``."""

    name = "carpool.infer"
    pad_multiple = 8
    checks_outputs = False
    raises_as_raised = False
    may_change_items = False
    inference_mode = True

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.first_launch_gate = threading.Event()
        self.device_done = threading.Event()  # every collect waits for it
        self.device_done.set()
        self.launched_on: list[str] = []  # the thread each launch ran on
        self.fails_on: str | None = None
        self.drops_one = False  # collect gives one output fewer than the batch's items
        self.device_memory: list[int] = [0]  # units a failed collect's frame holds while it lives
        self.memory_at_sync: list[int] = []  # units still held as each synchronous run starts

    def keys(self, settings: Any) -> tuple[str, ...]:
        return ("toy",)

    def launch_function(self, key: str, device: str, settings: Any) -> Callable[..., Any]:
        def launch(items: list[Any], lengths: list[int]) -> Callable[[], list[float]]:
            if not self.log:
                assert self.first_launch_gate.wait(HANG_S)
            name = ",".join(str(n) for n in lengths)
            self.log.append(f"launch {name}")
            self.launched_on.append(threading.current_thread().name)

            def collect() -> list[float]:
                assert self.device_done.wait(HANG_S)
                self.log.append(f"collect {name}")
                if self.fails_on is not None and int(self.fails_on) in lengths:
                    held = _Held(self.device_memory, 4)  # noqa: F841  (the failed run's tensors)
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                outputs = [float(n) for n in lengths]
                return outputs[1:] if self.drops_one else outputs

            return collect

        return launch

    def batch_function(self, key: str, device: str, settings: Any) -> Callable[..., Any]:
        def run(items: list[Any], lengths: list[int]) -> list[float]:
            self.log.append("sync " + ",".join(str(n) for n in lengths))
            self.memory_at_sync.append(self.device_memory[0])
            return [float(-n) for n in lengths]

        return run


@pytest.fixture
def launching_worker(staged: Any) -> tuple[Any, LaunchingSpec]:
    log: list[str] = []
    spec = LaunchingSpec(log)
    staged.specs = {"carpool.infer": spec}
    staged._stage = DeviceStage(launches=staged._launches())
    assert staged._stage.ahead == 2, "a worker serving a launching task starts batches ahead"
    staged.store.gate.set()
    staged.store.queued = 1
    return staged, spec


def test_the_worker_launches_the_next_batch_before_collecting_the_one_on_the_device(
    launching_worker: tuple[Any, LaunchingSpec],
) -> None:
    worker, spec = launching_worker
    spec.first_launch_gate.set()
    spec.device_done.clear()  # the device runs the first batch until the test says
    for n in (3, 5, 7):  # a batch per length: each request's result is its batch's length
        assert worker.run(batch(slot(f"r{n}", len=n))) is None, "handed to the device stage"
        until(lambda: worker._stage._completing)  # the device thread waits on the oldest batch
    assert spec.log == ["launch 3", "launch 5", "launch 7"], "all queued on the device before any collect"
    assert worker._stage.held() == 3 and worker._stage.pending_ids() == ["r3", "r5", "r7"]
    spec.device_done.set()
    assert worker._stage.drain(HANG_S) and worker._finisher.drain(HANG_S)
    assert spec.log[3:] == ["collect 3", "collect 5", "collect 7"], spec.log
    assert worker.store.order == ["r3", "r5", "r7"], "stored in the order claimed"
    metas = dict(worker.store.writes)
    assert metas["r7"]["status"] == "SUCCESS" and metas["r7"]["result"] == 7.0


def test_a_batch_claimed_while_the_device_thread_waits_to_collect_is_launched_by_the_celery_thread(
    launching_worker: tuple[Any, LaunchingSpec],
) -> None:
    worker, spec = launching_worker
    spec.first_launch_gate.set()
    busy = threading.Event()
    worker._stage.submit(lambda: busy.wait(HANG_S), [])  # the device thread is running another job
    worker.run(batch(slot("waits", len=3)))  # so this one waits for the device thread to start it
    spec.device_done.clear()
    busy.set()
    until(lambda: worker._stage._completing and spec.log == ["launch 3"])  # collecting "waits" now
    worker.run(batch(slot("next", len=5)))
    assert spec.log == ["launch 3", "launch 5"], "launched while the device thread waits on the device"
    assert spec.launched_on == ["carpool-device", threading.current_thread().name]
    spec.device_done.set()
    assert worker._stage.drain(HANG_S) and worker._finisher.drain(HANG_S)
    assert worker.store.order == ["waits", "next"]


def test_a_batch_that_fails_on_the_device_runs_again_synchronously_and_the_next_is_unaffected(
    launching_worker: tuple[Any, LaunchingSpec],
) -> None:
    worker, spec = launching_worker
    spec.fails_on = "3"
    spec.first_launch_gate.set()
    worker.run(batch(slot("bad-luck", len=3), slot("neighbour", len=4)))
    worker.run(batch(slot("later", len=6)))
    assert worker._stage.drain(HANG_S) and worker._finisher.drain(HANG_S)
    assert "sync 3,4" in spec.log, "rerun synchronously, where a failure can be isolated"
    results = {task_id: meta["result"] for task_id, meta in worker.store.all_writes}
    assert results == {"bad-luck": -3.0, "neighbour": -4.0, "later": 6.0}
    assert spec.memory_at_sync == [0], "the failed run's memory is not kept for its rerun"


def test_a_launched_batch_with_the_wrong_number_of_outputs_fails_whole_and_is_not_rerun(
    launching_worker: tuple[Any, LaunchingSpec],
) -> None:
    worker, spec = launching_worker
    spec.drops_one = True
    spec.first_launch_gate.set()
    worker.run(batch(slot("x", len=3), slot("y", len=4)))
    worker.run(batch(slot("z", len=5)))  # queued behind: the stage, not the inline path
    assert worker._stage.drain(HANG_S) and worker._finisher.drain(HANG_S)
    metas = dict(worker.store.all_writes)
    assert {metas[i]["status"] for i in ("x", "y", "z")} == {"FAILURE"}
    assert "1 outputs for 2 items" in metas["x"]["result"]["exc_message"][0]
    assert not any(step.startswith("sync") for step in spec.log), "splitting cannot say whose output"


class ListEncoder:
    """Stands in for the kombu envelope: a message is the list of its events' types and ids."""

    topic = "events"

    def encode(self, events: list[dict[str, Any]]) -> bytes:
        return repr([(e["type"], e.get("uuid")) for e in events]).encode()


def test_each_batch_takes_only_its_own_events_and_forks_share_the_encoder() -> None:
    from carpool.celery_edge.app import app
    from carpool.celery_edge.events import TaskEvents

    events = TaskEvents(app, "worker@host")
    events._encoder = ListEncoder()
    running, claimed = events.fork(), events.fork()
    running.started(["a"])
    claimed.received("batch-2", "()")
    running.succeeded("a", [0.5], 0.01)
    assert running.take() == ("events", b"[('task-started', 'a'), ('task-succeeded', 'a')]")
    assert claimed.take() == ("events", b"[('task-received', 'batch-2')]")
    assert events.take() is None and running.take() is None


def test_a_batch_of_a_request_a_worker_died_running_runs_with_nothing_beside_it(
    launching_worker: tuple[Any, LaunchingSpec],
) -> None:
    """Its flush says "alone": the worker claims it only once the batches before it are done, takes
    no batch behind it, and runs it there and then; should the worker die, that request is the one it
    died running."""
    worker, spec = launching_worker
    spec.first_launch_gate.set()
    spec.device_done.clear()  # the device runs the first batch until the test says
    worker.run(batch(slot("before", len=3)))
    until(lambda: worker._stage._completing)
    lone = batch(slot("lone", len=5))
    lone["flush"] = "alone"
    done: list[Any] = []
    runner = threading.Thread(target=lambda: done.append(worker.run(lone)))
    runner.start()
    time.sleep(0.3)
    assert spec.log == ["launch 3"] and len(worker.store.counted) == 1, "not claimed while one runs"
    spec.device_done.set()
    runner.join(HANG_S)
    assert not runner.is_alive() and done == [None]
    assert spec.log.index("collect 3") < min(i for i, step in enumerate(spec.log) if step.endswith(" 5"))
    assert worker._stage.idle(), "run on the Celery thread, not handed to the device stage"
    assert worker._finisher.idle() and dict(worker.store.all_writes)["lone"]["result"] == 5.0, "stored"
    again = batch(slot("lone-again", len=6))
    again["flush"] = "alone"
    worker.store.gate.clear()  # its results' store waits until the test says
    second = threading.Thread(target=worker.run, args=(again,))
    second.start()  # with nothing running: claimed at once
    time.sleep(0.3)
    assert second.is_alive(), "the Celery thread claims nothing more before its results are stored"
    worker.store.gate.set()
    second.join(HANG_S)
    assert dict(worker.store.all_writes)["lone-again"]["result"] == 6.0
    assert worker.store.took[0] and not any(worker.store.took[1:]), "its claim takes no batch behind it"


class RecordingMarks:
    """The worker's device marks, recorded in the log its device writes to, and those marked now."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.marked: set[str] = set()

    def begin(self, batch_id: str) -> None:
        self.log.append(f"begin {batch_id}")
        self.marked.add(batch_id)

    def end(self, batch_id: str) -> None:
        self.log.append(f"end {batch_id}")
        self.marked.discard(batch_id)

    def flush(self) -> None:
        pass


class BlockingSpec(LaunchingSpec):
    """``carpool.infer`` on a synchronous device that runs each batch until ``device_done``."""

    def launch_function(self, key: str, device: str, settings: Any) -> Any:
        return None

    def batch_function(self, key: str, device: str, settings: Any) -> Callable[..., Any]:
        def run(items: list[Any], lengths: list[int]) -> list[float]:
            self.log.append("sync " + ",".join(str(n) for n in lengths))
            assert self.device_done.wait(HANG_S)
            return [float(n) for n in lengths]

        return run


@pytest.mark.parametrize("launches", [False, True], ids=["synchronous", "asynchronous"])
def test_a_batch_is_marked_running_only_while_the_device_runs_it_or_its_results_are_stored(
    staged: Any, launches: bool
) -> None:
    """Should the worker die, its requests are counted as the ones it died running: not those of the
    batch claimed and waiting behind it, nor those of a batch waiting for the finisher; those of a
    batch whose results are being stored are (encoding a result too large for the worker's memory
    kills it)."""
    log: list[str] = []
    spec = (LaunchingSpec if launches else BlockingSpec)(log)
    marks = RecordingMarks(log)
    staged.specs = {"carpool.infer": spec}
    staged.marks = marks
    staged._stage = DeviceStage(
        launches=launches, launch_ahead_for_s=0.0
    )  # one batch on the device at a time
    store = staged.store
    store.queued = 1  # a batch queued behind each: hand over to the device thread, store on the finisher
    marked_at_store: list[set[str]] = []
    finish = store.finish

    def finish_marked(**kwargs: Any) -> Any:
        marked_at_store.append(set(marks.marked))
        return finish(**kwargs)

    store.finish = finish_marked
    spec.first_launch_gate.set()
    spec.device_done.clear()
    running, waiting = batch(slot("r", len=3)), batch(slot("w", len=5))
    running["id"], waiting["id"] = "running", "waiting"
    staged.run(running)
    until(lambda: len(log) == 2)
    time.sleep(0.05)  # the stage may start the first batch's completion meanwhile
    staged.run(waiting)
    time.sleep(0.2)
    assert marks.marked == {"running"}, "claimed, waiting for the device: not marked"
    spec.device_done.set()
    until(lambda: len(marked_at_store) == 1)  # the first batch's results are being stored
    assert "running" in marked_at_store[0]
    until(lambda: "end waiting" in log)  # run, and handed to the finisher behind the first
    assert marks.marked == {"running"}, "waiting to be stored: not marked"
    store.gate.set()
    assert staged._stage.drain(HANG_S) and staged._finisher.drain(HANG_S)
    assert len(marked_at_store) == 2 and "waiting" in marked_at_store[1]
    assert marks.marked == set(), "every mark ended once its batch's results were stored"
    ran = "collect" if launches else "sync"
    assert log.index("begin running") < log.index(f"{ran} 3") and log.index("begin waiting") < log.index(
        f"{ran} 5"
    )
