"""@batched tasks through real coordinator and worker processes: results, binning, errors, dedicated
workers, and infer served beside them."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from carpool.redis_edge.keys import REJECTED_WRITES, Keys
from tests.integration.conftest import Processes, server_of, start_stack, wait_for

IMPORTS = "tests.integration.batched_tasks"
BINS = {(1, 4), (5, 16), (17, 10**9)}


def _bin_of(length: int) -> tuple[int, int]:
    return next(b for b in BINS if b[0] <= length <= b[1])


def test_two_tasks_side_by_side_with_infer_binned_by_length(processes: Processes) -> None:
    import carpool
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, CARPOOL_IMPORTS=IMPORTS, CARPOOL_MODEL="toy", CARPOOL_MAX_WAIT_S="0.2")
    words = ["a", "bb", "hello", "some longer text", "x" * 30, "mid size", "z", "another medium"] * 4
    pairs: list[dict[str, list[float]]] = [
        {"a": list(range(i % 5)), "b": [0.5, 1.25] * (i % 3)} for i in range(20)
    ]
    shouted = carpool.submit_many(words, task=t.shout)
    summed = carpool.submit_many(pairs, task=t.pair_sum)
    one = t.shout.delay("solo")
    text = infer.delay("a text for the model", "toy")

    got = carpool.gather(shouted, timeout=60)
    assert [g["out"] for g in got] == [w.upper() for w in words]
    for g, w in zip(got, words, strict=True):
        assert len(w) in g["batch"]
        # every member of the batch came from the same length bin as this request
        assert {_bin_of(n) for n in g["batch"]} == {_bin_of(len(w))}
        assert len(g["batch"]) <= 8  # the task's own max_batch
    sums = carpool.gather(summed, timeout=60)
    assert [s["sum"] for s in sums] == [sum(p["a"]) + sum(p["b"]) for p in pairs]
    assert max(s["size"] for s in sums) > 1  # batched, not one at a time
    assert one.get(timeout=30)["out"] == "SOLO"
    assert len(text.get(timeout=30)) == 32  # the toy model's output, served by the same worker


def test_items_travel_as_json_and_outputs_come_back_exactly(processes: Processes) -> None:
    from tests.integration import batched_tasks as t

    start_stack(processes, CARPOOL_IMPORTS=IMPORTS, CARPOOL_MODEL="toy")
    from carpool.errors import ModelError

    xs = [0.1, 1 / 3, 2.0**-1074, 1e307, -0.0, 4611686018427387904]
    results = [t.by_declared_length.delay({"n": i + 1, "x": x}) for i, x in enumerate(xs)]
    got = [r.get(timeout=30) for r in results]
    assert got == [x * 2 for x in xs]
    assert [type(g) for g in got] == [type(x) for x in xs]
    assert str(got[4]) == "-0.0"  # the sign of zero survives
    overflow = t.by_declared_length.delay({"n": 1, "x": 1e308})  # 2e308 is inf: JSON cannot carry it
    with pytest.raises(ModelError, match="non-finite float"):
        overflow.get(timeout=30)
    too_big = t.by_declared_length.delay({"n": 1, "x": 2**63})  # 2**64 is past 64 bits
    with pytest.raises(ModelError, match="64-bit"):
        too_big.get(timeout=30)
    # Workers ran @batched functions under inference_mode: autograd failed there alone.
    assert [r.get(timeout=30) for r in [t.slopes.delay(x) for x in (1.0, 2.0, -3.0)]] == [3.0, 12.0, 27.0]


def test_bad_items_and_failing_functions_fail_alone(processes: Processes) -> None:
    from carpool.errors import InvalidInput, ModelError
    from tests.integration import batched_tasks as t

    start_stack(processes, CARPOOL_IMPORTS=IMPORTS, CARPOOL_MODEL="toy", CARPOOL_MAX_WAIT_S="0.3")
    fine = [t.fragile.delay(w) for w in ("one", "two", "three")]
    boom = t.fragile.delay("boom")
    # The function's own exception, as Celery stores a task's: its type, message and traceback.
    with pytest.raises(ValueError, match="boom is not a word I take"):
        boom.get(timeout=60)
    assert boom.state == "FAILURE" and isinstance(boom.info, ValueError)
    assert "batched_tasks.py" in boom.traceback and 'raise ValueError("boom is not' in boom.traceback
    assert [r.get(timeout=30) for r in fine] == ["eno", "owt", "eerht"]

    with pytest.raises(ModelError, match=r"returned \d+ outputs for \d+ items"):
        rs = [t.miscounting.delay(w) for w in ("a", "b")]
        for r in rs:
            r.get(timeout=60)

    kept, lost = t.unstorable.delay("keep"), t.unstorable.delay("set")
    with pytest.raises(ModelError, match="cannot be stored as JSON"):
        lost.get(timeout=60)
    assert kept.get(timeout=30) == "keep"

    # length() failing on the coordinator: that request alone gets InvalidInput naming the task.
    bad = t.by_declared_length.delay({"x": 1.0})  # no "n": the length function raises KeyError
    wrong = t.by_declared_length.delay({"n": "7", "x": 1.0})  # a str, not an int
    good = t.by_declared_length.delay({"n": 3, "x": 1.5})
    with pytest.raises(InvalidInput, match=r"by_declared_length: length\(\) raised KeyError"):
        bad.get(timeout=60)
    with pytest.raises(InvalidInput, match="not an int"):
        wrong.get(timeout=60)
    assert good.get(timeout=30) == 3.0

    # A BaseException that is no Exception (asyncio's CancelledError out of asyncio.run) fails its
    # own request; it stopped the worker, then each worker its batch reached, or the coordinator.
    before = [t.cancelling.delay(w) for w in ("x", "yy")]
    cancelled, cancelled_length = t.cancelling.delay("cancel"), t.cancelling.delay("cancel-length")
    after = [t.cancelling.delay(w) for w in ("zzz", "w")]
    with pytest.raises(ModelError, match="raised CancelledError, a BaseException that is not an Exception"):
        cancelled.get(timeout=60)
    with pytest.raises(InvalidInput, match=r"cancelling: length\(\) raised CancelledError"):
        cancelled_length.get(timeout=60)
    assert [r.get(timeout=30) for r in before + after] == ["X", "YY", "ZZZ", "W"]
    processes.check_alive()
    assert t.cancelling.delay("later").get(timeout=30) == "LATER"


def test_dedicated_workers_run_only_their_tasks(processes: Processes) -> None:
    import carpool
    from tests.integration import batched_tasks as t

    env: dict[str, Any] = {"CARPOOL_IMPORTS": IMPORTS, "CARPOOL_MODEL": "toy"}
    processes.start("coordinator", "coordinator", **env)
    pairs_worker = processes.start("pairs", "worker", CARPOOL_SERVE_TASKS="tests.pairs", **env)
    text_worker = processes.start("texts", "worker", CARPOOL_SERVE_TASKS=f"{IMPORTS}.shout", **env)
    processes.wait_workers(2)
    summed = carpool.gather(carpool.submit_many([{"a": [1], "b": [2]}] * 12, task=t.pair_sum), timeout=60)
    shouted = carpool.gather(carpool.submit_many(["hey"] * 12, task=t.shout), timeout=60)
    assert {s["pid"] for s in summed} == {pairs_worker.pid}
    assert {s["pid"] for s in shouted} == {text_worker.pid}
    assert all(s["sum"] == 3 for s in summed) and all(s["out"] == "HEY" for s in shouted)


def test_a_batch_queue_no_live_worker_consumes_is_named_until_one_does(processes: Processes) -> None:
    # Batches of a task whose dedicated worker is down waited on its batch queue, unanswered, and
    # nothing said so (found by the review of deployments with several parts).
    import carpool
    from carpool.tools.status import as_dict, collect
    from tests.integration import batched_tasks as t

    env: dict[str, Any] = {"CARPOOL_IMPORTS": IMPORTS, "CARPOOL_MODEL": "toy"}
    processes.start("coordinator", "coordinator", **env)
    processes.start("texts", "worker", CARPOOL_SERVE_TASKS=f"{IMPORTS}.shout", **env)
    processes.wait_workers(1)
    results = carpool.submit_many([{"a": [1], "b": [2]}] * 6, task=t.pair_sum)
    said = "which no live worker consumes"
    log = wait_for(
        "the coordinator naming the queue",
        lambda: (text := processes.log("coordinator")) and said in text and text,
        40,
    )
    [line] = [line for line in log.splitlines() if said in line]
    assert "ERROR" in line and "batch queue carpool.batches.pairs" in line and "tests.pairs" in line, line
    assert "the live ones consume carpool.batches" in line, line
    client = redis.Redis(port=server_of(processes).port)
    keys = Keys("carpool.requests")
    status = as_dict(collect(client, keys), None, keys.request_queue)
    assert status["batch_queues_unserved"] == ["carpool.batches.pairs"]
    assert status["batch_queue_workers"] == {"carpool.batches": 1, "carpool.batches.pairs": 0}
    assert not any(r.ready() for r in results)

    processes.start("pairs", "worker", CARPOOL_SERVE_TASKS="tests.pairs", **env)
    assert [s["sum"] for s in carpool.gather(results, timeout=60)] == [3] * 6
    wait_for(
        "the coordinator saying the queue has a worker again",
        lambda: "batch queue carpool.batches.pairs has a worker again" in processes.log("coordinator"),
        40,
    )
    assert as_dict(collect(client, keys), None, keys.request_queue)["batch_queues_unserved"] == []
    assert processes.log("coordinator").count(said) == 1, "said once, not at every check"


def test_a_worker_whose_consumer_was_cancelled_is_not_counted_as_consuming_its_queue(
    processes: Processes,
) -> None:
    # Its heartbeat said the queues it started with: after cancel_consumer (Flower's button) status
    # and the coordinator went on counting it, and requests waited with nothing said.
    import carpool
    from carpool.celery_app import app
    from carpool.tools.status import as_dict, collect

    start_stack(processes, CARPOOL_MODEL="toy")
    assert len(carpool.gather(carpool.submit_many(["first"]), timeout=30)[0]) == 32
    [reply] = app.control.cancel_consumer("carpool.batches", reply=True, timeout=5)
    assert "ok" in next(iter(reply.values()))
    results = carpool.submit_many(["a", "b", "c"])
    said = "batches of carpool.infer wait on batch queue carpool.batches, which no live worker consumes"
    log = wait_for(
        "the coordinator naming the queue",
        lambda: (t := processes.log("coordinator")) and said in t and t,
        40,
    )
    assert "(the live ones consume no batch queue)" in log, log
    client = redis.Redis(port=server_of(processes).port)
    keys = Keys("carpool.requests")
    assert as_dict(collect(client, keys), None, keys.request_queue)["batch_queues_unserved"] == [
        "carpool.batches"
    ]
    assert not any(r.ready() for r in results)
    app.control.add_consumer("carpool.batches", reply=True, timeout=5)
    assert [len(v) for v in carpool.gather(results, timeout=60)] == [32] * 3
    wait_for(
        "the coordinator saying the queue has a worker again",
        lambda: "batch queue carpool.batches has a worker again" in processes.log("coordinator"),
        40,
    )


def test_two_deployments_with_their_own_request_queues_share_one_redis_database(processes: Processes) -> None:
    # With the batch queue left at its default both ran each other's batches, whose requests
    # their workers skipped as belonging elsewhere: not one request of either was answered.
    from tests.integration import batched_tasks as t

    env: dict[str, Any] = {"CARPOOL_IMPORTS": IMPORTS, "CARPOOL_MODEL": "toy"}
    workers = {}
    for name in ("app_a", "app_b"):
        queue = f"{name}.requests"
        processes.start(f"{name}_coordinator", "coordinator", CARPOOL_REQUEST_QUEUE=queue, **env)
        workers[queue] = processes.start(f"{name}_worker", "worker", CARPOOL_REQUEST_QUEUE=queue, **env)
    for queue in workers:
        processes.wait_workers(1, request_queue=queue)
    sent = {q: [t.shout.apply_async(args=(f"{q}-{i}",), queue=q) for i in range(10)] for q in workers}
    for queue, results in sent.items():
        outs = [r.get(timeout=60) for r in results]
        assert [o["out"] for o in outs] == [f"{queue}-{i}".upper() for i in range(10)]
        assert {o["pid"] for o in outs} == {workers[queue].pid}, "each deployment's own worker"


def test_a_batch_waiting_behind_a_slow_one_goes_to_an_idle_worker(processes: Processes) -> None:
    """The heartbeat renewed the leases of a batch waiting in the device stage behind a slow (or
    hung) one: an idle worker never got it, and its expires= never fired (found by the review of
    slow work). Now they run out, its requests go to the idle worker, and the first worker, once
    its slow batch ends, claims the waiting one again and runs none of them twice."""
    import carpool
    from tests.integration import batched_tasks as t

    env: dict[str, Any] = {
        "CARPOOL_IMPORTS": IMPORTS,
        "CARPOOL_MODEL": "toy",
        "CARPOOL_RECOVERY_TIMEOUT_S": "3",
    }
    start_stack(processes, **env)
    first = processes.procs["worker0"]
    assert carpool.gather(carpool.submit_many([{"tag": "w", "s": 0.01}] * 4, task=t.naps), timeout=60)
    slow = [{"tag": f"A{i}", "s": 20} for i in range(4)]
    quick = [{"tag": f"B{i}", "s": 0.05} for i in range(4)]
    results = carpool.submit_many(slow + quick, task=t.naps)  # two batches of four, the slow one first
    time.sleep(1.0)  # both claimed by the first worker: A running, B waiting behind it
    second = processes.start("worker1", "worker", **env)
    quick_outs = [r.get(timeout=60) for r in results[4:]]
    assert [o["tag"] for o in quick_outs] == [q["tag"] for q in quick]
    assert {o["pid"] for o in quick_outs} == {second.pid}, "the idle worker ran the waiting batch"
    assert all(not r.ready() for r in results[:4]), "before the slow batch ended"
    slow_outs = [r.get(timeout=60) for r in results[:4]]
    assert {o["pid"] for o in slow_outs} == {first.pid}
    log = wait_for(
        "the first worker claiming the waiting batch again",
        lambda: (text := processes.log("worker0")) and "went back to the coordinators" in text and text,
        timeout_s=30,
    )
    assert "4 of its 4 requests to run went back" in log, log
    client = redis.Redis(port=server_of(processes).port)
    assert int(client.hget(Keys("carpool.requests").stats, REJECTED_WRITES) or 0) == 0, "none ran twice"


_SEND_BY_NAME = """
import sys
from carpool.celery_app import app  # not the tasks' module: the name is all this producer knows
from carpool.registry import spec_for

assert spec_for(sys.argv[1]) is None
fine = app.send_task(sys.argv[1], args=["abc"])
too_big = app.send_task(sys.argv[1], args=[[2**70]])
print(fine.get(timeout=60))
try:
    too_big.get(timeout=60)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_send_task_by_name_from_a_producer_without_the_tasks_module_is_batched(
    processes: Processes,
) -> None:
    # Celery routes a name it cannot look up to the app's default queue: the request queue, whose
    # coordinators check and batch it (the worker's tracer would run it alone, unchecked).
    import subprocess
    import sys

    from tests.integration import batched_tasks as t

    start_stack(processes, CARPOOL_IMPORTS=IMPORTS, CARPOOL_MODEL="toy")
    done = subprocess.run(
        [sys.executable, "-c", _SEND_BY_NAME, t.count.name],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    fine, refused = done.stdout.splitlines()
    assert fine == "3"
    assert refused.startswith("InvalidInput") and "64" in refused, refused


def test_a_request_that_kills_its_worker_runs_alone_and_the_others_batched_with_it_are_served(
    processes: Processes,
) -> None:
    """Each time a worker dies, a new one starts, as a supervisor (compose's restart policy) starts
    one: the requests of the batch it died running come back after their leases and run one per
    batch, so the four others are answered; the one that kills workers is named in the
    coordinator's log and ends at its deadline."""
    import carpool
    from carpool.errors import DeadlineExceeded
    from tests.integration import batched_tasks as t

    env = {
        "CARPOOL_IMPORTS": IMPORTS,
        "CARPOOL_MAX_WAIT_S": "0.5",
        "CARPOOL_RECOVERY_TIMEOUT_S": "2",
        "CARPOOL_DEFAULT_DEADLINE_S": "20",
    }
    start_stack(processes, **env)
    items = ["a", "b", "hog", "c", "d"]
    results = carpool.submit_many(items, task=t.greedy)
    worker, started = "worker0", 1
    deadline = time.monotonic() + 150
    while not all(r.ready() for r in results) and time.monotonic() < deadline:
        if processes.procs[worker].poll() is not None:  # it died: start another
            processes.stop(worker)
            worker, started = f"worker{started}", started + 1
            processes.start(worker, "worker", **env)
        time.sleep(0.2)
    got = carpool.gather(results, timeout=10, return_exceptions=True)
    assert [g for i, g in enumerate(got) if i != 2] == ["A", "B", "C", "D"]
    assert isinstance(got[2], DeadlineExceeded)
    assert started >= 3, "killed in its batch, then alone"
    assert f"request {results[2].id} (tests.greedy) came back" in processes.log("coordinator")
    client = redis.Redis(port=server_of(processes).port)
    assert not client.exists(Keys("carpool.requests").inflight_deaths)
