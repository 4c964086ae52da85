"""Fault injection with real processes and a real Redis: nothing lost, one answer per request.

Each run sends a few hundred requests through a model that sleeps per batch (so the run lasts long
enough to kill something in the middle), injects the fault, brings the stack back, and checks that
every request has exactly its correct result.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import redis

from carpool.errors import DeadlineExceeded, InputTooLong, InvalidInput, ModelError, QueueFull, UnknownModel
from carpool.redis_edge.keys import Keys
from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.workload import mixed_texts
from tests.integration.conftest import Processes, as_bytes, requests_in, server_of, start_stack, wait_for
from tests.integration.models import EXPLODING, SLOW, UNSTORABLE
from tests.tolerances import VECTOR_ATOL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECOVERY = "3"  # CARPOOL_RECOVERY_TIMEOUT_S for these tests
SLOW_ENV = {
    "CARPOOL_MODEL": SLOW,
    "CARPOOL_MODELS": SLOW,
    "CARPOOL_MAX_BATCH": "8",
    "CARPOOL_RECOVERY_TIMEOUT_S": RECOVERY,
    "SLOW_TOY_DELAY_S": "0.05",
}
KEYS = Keys("carpool.requests")


def expected(texts: Sequence[str]) -> list[Any]:
    from carpool.gpu_worker.runner import loaded_model, run_padded

    model = loaded_model("toy")
    ids = model.encode(list(texts))
    return [run_padded(model, [i], [len(i)])[0] for i in ids]


def send(texts: Sequence[str], model: str = SLOW) -> list[Any]:
    from carpool.tasks import infer

    return [infer.delay(t, model=model) for t in texts]


def check_all_correct(results: Sequence[Any], texts: Sequence[str], timeout: float = 120) -> None:
    got = [r.get(timeout=timeout) for r in results]
    want = expected(texts)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.allclose(g, w, atol=VECTOR_ATOL), f"request {i} has a wrong result"


def record(fault: str, **figures: Any) -> None:
    """Append a fault run's figures to $CARPOOL_FAULT_REPORT (JSON lines) for docs/RELIABILITY.md."""
    path = os.environ.get("CARPOOL_FAULT_REPORT")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"fault": fault, **figures}) + "\n")


def in_flight(processes: Processes) -> int:
    return int(redis.Redis(port=server_of(processes).port).zcard(KEYS.inflight_lease))


def test_kill_9_coordinator_loses_nothing(processes: Processes) -> None:
    start_stack(processes, **SLOW_ENV)
    texts = mixed_texts(300, seed=11)
    results = send(texts)
    held = wait_for("the coordinator taking requests", lambda: (n := in_flight(processes)) > 50 and n, 30)
    processes.stop("coordinator", sig=signal.SIGKILL)
    t_kill = time.monotonic()
    processes.start("coordinator2", "coordinator", **SLOW_ENV)
    check_all_correct(results, texts)
    recovered_in = time.monotonic() - t_kill
    assert held > 0
    assert recovered_in < 60  # generous: catches a hang, not a timing target
    wait_for("no in-flight entry left", lambda: in_flight(processes) == 0, 10)
    record(
        "kill -9 coordinator",
        requests=len(texts),
        in_flight_at_fault=held,
        lost=0,
        all_done_after_fault_s=round(recovered_in, 2),
        recovery_timeout_s=float(RECOVERY),
    )


def test_kill_9_worker_mid_batch_loses_nothing(processes: Processes) -> None:
    env = {**SLOW_ENV, "SLOW_TOY_DELAY_S": "0.3"}
    start_stack(processes, 2, **env)
    texts = mixed_texts(200, seed=12)
    results = send(texts)
    time.sleep(1.0)  # both workers are inside a batch now
    held = in_flight(processes)
    processes.stop("worker0", sig=signal.SIGKILL)
    t_kill = time.monotonic()
    check_all_correct(results, texts, timeout=180)
    done_in = time.monotonic() - t_kill
    wait_for("no in-flight entry left", lambda: in_flight(processes) == 0, 10)
    record(
        "kill -9 worker (1 of 2) mid-batch",
        requests=len(texts),
        in_flight_at_fault=held,
        lost=0,
        all_done_after_fault_s=round(done_in, 2),
        recovery_timeout_s=float(RECOVERY),
    )


def test_kill_9_redis_with_append_only_file(processes: Processes, tmp_path: Any) -> None:
    # A server of its own, on its own port, with the append-only file synced on every write.
    from carpool.tools.embedded import free_port

    directory = str(tmp_path / "aof")
    os.makedirs(directory)
    server = EmbeddedRedis(port=free_port(), appendonly=True, directory=directory)
    server.start()
    redis.Redis(port=server.port).config_set("appendfsync", "always")
    own = Processes(server, tmp_path)
    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings

    app = create_app(load_settings(broker_url=server.url(0), result_backend=server.url(1)))
    try:
        start_stack(own, **SLOW_ENV)
        texts = mixed_texts(200, seed=13)
        from carpool.validation import validate_infer

        settings = load_settings()
        for t in texts:
            validate_infer(t, SLOW, settings)
        results = [app.send_task("carpool.infer", args=[t, SLOW], queue="carpool.requests") for t in texts]
        time.sleep(1.0)
        held = int(redis.Redis(port=server.port).zcard(KEYS.inflight_lease))
        server.stop(kill=True)
        t_kill = time.monotonic()
        time.sleep(1.0)
        server.process = None
        server.start()
        redis.Redis(port=server.port).config_set("appendfsync", "always")
        got = [r.get(timeout=120) for r in results]
        record(
            "kill -9 redis-server, restart after 1 s (AOF, fsync always)",
            requests=len(texts),
            in_flight_at_fault=held,
            lost=0,
            all_done_after_fault_s=round(time.monotonic() - t_kill, 2),
            recovery_timeout_s=float(RECOVERY),
        )
        want = expected(texts)
        assert all(np.allclose(g, w, atol=VECTOR_ATOL) for g, w in zip(got, want, strict=True))
        for name, proc in own.procs.items():
            assert proc.poll() is None, f"{name} died with Redis:\n{own.log(name)}"
    finally:
        from carpool.tools.harness import release_result_consumer

        release_result_consumer(app)
        own.stop_all()
        server.cleanup()


def test_a_wait_that_starts_while_redis_is_down_gets_its_result_once_redis_is_back(tmp_path: Any) -> None:
    import threading

    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings
    from carpool.tools.embedded import free_port
    from carpool.tools.harness import release_result_consumer

    server = EmbeddedRedis(port=free_port(), directory=str(tmp_path))
    server.start()
    app = create_app(load_settings(broker_url=server.url(0), result_backend=server.url(1)))
    outcome: dict[str, Any] = {}

    def wait() -> None:  # a thread of its own: its first SUBSCRIBE meets Redis down
        try:
            outcome["value"] = app.AsyncResult("waited-on").get(timeout=40)
        except Exception as exc:
            outcome["error"] = exc

    try:
        server.stop(kill=True)
        server.process = None
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(2.0)
        server.start()
        app.backend.store_result("waited-on", {"ok": 1}, "SUCCESS")
        waiter.join(60)
        # Until 2026-12-06 the wait never connected again: TimeoutError, or no return without one.
        assert outcome == {"value": {"ok": 1}}
    finally:
        release_result_consumer(app)
        server.cleanup()


def test_a_wait_whose_subscription_missed_the_publish_reads_the_stored_result(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A SUBSCRIBE that takes effect in Redis after the result's PUBLISH (its packet late; from another
    # thread than the sender's, a .get() subscribes only as it starts) hears nothing; until
    # 2026-12-06 the wait then read the stored result only once, at its start, and waited for good.
    import threading

    import redis.client

    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings
    from carpool.tools.harness import release_result_consumer

    real = redis.client.PubSub.subscribe

    def losing(self: Any, *channels: Any, **kwargs: Any) -> Any:
        kept = [c for c in channels if b"missed-publish" not in (c if isinstance(c, bytes) else c.encode())]
        return real(self, *kept, **kwargs) if kept or kwargs else None

    monkeypatch.setattr(redis.client.PubSub, "subscribe", losing)
    app = create_app(load_settings(broker_url=clean_redis.url(0), result_backend=clean_redis.url(1)))
    stored = threading.Timer(0.3, app.backend.store_result, ("missed-publish", {"ok": 2}, "SUCCESS"))
    try:
        stored.start()
        t0 = time.monotonic()
        assert app.AsyncResult("missed-publish").get(timeout=20) == {"ok": 2}
        assert time.monotonic() - t0 < 10
    finally:
        stored.join()
        release_result_consumer(app)


def test_two_coordinators_share_the_queue_without_duplicates(processes: Processes) -> None:
    # The default lease: a stall of a loaded host must not turn into a recovery and a second dispatch.
    env = {**SLOW_ENV, "CARPOOL_RECOVERY_TIMEOUT_S": "30"}
    start_stack(processes, 1, **env)
    processes.start("coordinator2", "coordinator", **env)
    texts = mixed_texts(300, seed=14)
    results = send(texts)
    check_all_correct(results, texts)
    client = redis.Redis(port=server_of(processes).port)
    wait_for("the stats written", lambda: int(client.hget(KEYS.stats, "dispatched") or 0) >= 300, 5)
    time.sleep(0.5)
    assert int(client.hget(KEYS.stats, "dispatched") or 0) == 300  # each request dispatched once


def test_sigterm_coordinator_hands_back_what_it_holds(processes: Processes) -> None:
    # No worker: the coordinator holds everything; on SIGTERM it must put it all back.
    processes.start("coordinator", "coordinator", **SLOW_ENV)
    texts = mixed_texts(100, seed=15)
    results = send(texts)
    wait_for("the coordinator taking the requests", lambda: in_flight(processes) == 100, 30)
    assert processes.stop("coordinator", sig=signal.SIGTERM) == 0
    client = redis.Redis(port=server_of(processes).port)
    assert client.llen("carpool.requests") == 100
    assert in_flight(processes) == 0
    start_stack(processes, **SLOW_ENV)
    check_all_correct(results, texts)


def test_requests_a_coordinator_held_go_back_to_their_priority_lists(processes: Processes) -> None:
    from carpool.redis_edge.store import RequestStore
    from carpool.tasks import infer

    client = redis.Redis(port=server_of(processes).port)
    high_list, base_list = KEYS.request_lists[0], KEYS.request_queue  # priority 9, priority 0
    low_texts = mixed_texts(30, seed=18)
    high_texts = [f"urgent request number {i}" for i in range(20)]
    low = send(low_texts)
    high = [infer.apply_async((t,), {"model": SLOW}, priority=9) for t in high_texts]
    assert client.llen(high_list) == len(high)

    def held_then(stop: Any) -> None:
        # No worker: the coordinator holds everything until it is stopped.
        processes.start("coordinator", "coordinator", **SLOW_ENV)
        wait_for("the coordinator taking the requests", lambda: in_flight(processes) == 50, 30)
        assert client.llen(high_list) == client.llen(base_list) == 0
        stop()
        assert (client.llen(high_list), client.llen(base_list)) == (len(high), len(low))
        assert in_flight(processes) == 0 and client.hlen(KEYS.inflight_origin) == 0

    # Killed: its leases run out and a reap (any process's) puts each request back where it was.
    def kill_and_reap() -> None:
        processes.stop("coordinator", sig=signal.SIGKILL)
        store = RequestStore(client, KEYS, float(RECOVERY))
        wait_for("the leases running out", lambda: store.reap() >= 0 and in_flight(processes) == 0, 30)

    held_then(kill_and_reap)
    # Stopped: it hands back what it holds, each request to its own list.
    held_then(lambda: processes.stop("coordinator", sig=signal.SIGTERM))

    start_stack(processes, **SLOW_ENV)
    check_all_correct(high, high_texts)
    check_all_correct(low, low_texts)


def test_bad_input_fails_only_itself_fast_with_a_clear_error(processes: Processes) -> None:
    from carpool.celery_edge.app import app
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy", CARPOOL_MAX_INPUT_BYTES="5000")
    # Rejected at .delay(), before anything is sent:
    with pytest.raises(InvalidInput, match="text must be a str"):
        infer.delay(123, model="toy")
    with pytest.raises(InvalidInput, match="lone surrogate"):
        infer.delay("bad \udc80 text", model="toy")
    with pytest.raises(UnknownModel, match="unknown model 'gpt'"):
        infer.delay("fine", model="gpt")
    # Sent by a client that skips validation (send_task): fail as stored errors, each named.
    bad = {
        "non-string": (app.send_task("carpool.infer", args=[123, "toy"]), InvalidInput, "text must be a str"),
        "surrogate": (
            app.send_task("carpool.infer", args=["x \ud800 y", "toy"]),
            InvalidInput,
            "lone surrogate",
        ),
        "model": (
            app.send_task("carpool.infer", args=["fine", "nope"]),
            UnknownModel,
            "unknown model 'nope'",
        ),
        "big": (app.send_task("carpool.infer", args=["é" * 3000, "toy"]), InputTooLong, "6000 bytes"),
        "args": (app.send_task("carpool.infer", args=[]), InvalidInput, "needs a text"),
    }
    texts = mixed_texts(100, seed=16)
    good = [infer.delay(t, model="toy") for t in texts]
    t0 = time.monotonic()
    for name, (result, error, needle) in bad.items():
        with pytest.raises(error, match=needle):
            result.get(timeout=10)
        assert result.state == "FAILURE", name
    assert time.monotonic() - t0 < 10
    check_all_correct(good, texts)
    # still serving afterwards
    assert len(infer.delay("still here", model="toy").get(timeout=10)) == 32


def test_overlong_text_truncated_by_default_or_rejected_when_configured(processes: Processes) -> None:
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy", CARPOOL_TRUNCATE="false")
    with pytest.raises(InputTooLong, match="over the 256-token window of toy"):
        infer.delay("word " * 400, model="toy").get(timeout=10)
    assert len(infer.delay("word " * 100, model="toy").get(timeout=10)) == 32


def test_garbage_in_the_request_queue_is_dead_lettered(processes: Processes) -> None:
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy")
    client = redis.Redis(port=server_of(processes).port)
    client.lpush("carpool.requests", b"\xff\xfe not json at all")
    client.lpush("carpool.requests", b'{"headers": {"task": "someone.else", "id": "x1"}, "body": ""}')
    client.lpush("carpool.requests", b'["a", "list"]')
    # A well-formed request for a task no coordinator serves is answered, not dead-lettered.
    elsewhere = infer.app.send_task("someone.else", args=("hi",), queue="carpool.requests")
    result = infer.delay("after the garbage", model="toy")
    assert len(result.get(timeout=10)) == 32
    with pytest.raises(InvalidInput, match=r"unknown task name 'someone\.else'.*CARPOOL_IMPORTS"):
        elsewhere.get(timeout=10)
    # So is one that names its id, whatever its body holds.
    with pytest.raises(InvalidInput, match="message body does not decode"):
        infer.app.AsyncResult("x1").get(timeout=10)
    wait_for("the garbage dead-lettered", lambda: client.llen(KEYS.dead_letter) == 2, 5)
    reasons = [as_bytes(e).decode() for e in client.lrange(KEYS.dead_letter, 0, -1)]
    assert any("not JSON" in r for r in reasons)
    assert any("not a Celery message: no headers" in r for r in reasons)
    # the good request is acked just after its result is stored: allow the worker that moment
    wait_for("no in-flight entry left", lambda: in_flight(processes) == 0, 5)


def test_a_model_error_fails_only_the_culprits(processes: Processes) -> None:
    from carpool.tasks import infer

    start_stack(
        processes,
        CARPOOL_MODEL=EXPLODING,
        CARPOOL_MODELS=EXPLODING,
        CARPOOL_MAX_BATCH="16",
        CARPOOL_POLICY="fifo",
        CARPOOL_MAX_WAIT_S="0.2",
        CARPOOL_WAIT_FACTOR="10",
    )
    texts = [f"request number {i}" for i in range(40)]
    texts[5] = "this one says boom"
    texts[23] = "boom"
    results = [infer.delay(t, model=EXPLODING) for t in texts]
    want = expected(texts)
    for i, r in enumerate(results):
        if i in (5, 23):
            with pytest.raises(ModelError, match="cannot digest the word 'boom'"):
                r.get(timeout=30)
        else:
            assert np.allclose(r.get(timeout=30), want[i], atol=VECTOR_ATOL)


def test_a_model_output_the_serializer_cannot_store_fails_only_its_request(processes: Processes) -> None:
    """Before, one such output made the whole batch's store raise: no result stored, the batch
    retried through lease recovery for ever, every caller in it waiting."""
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL=UNSTORABLE, CARPOOL_MODELS=UNSTORABLE, CARPOOL_MAX_WAIT_S="0.3")
    texts = ["ab", "c~d", "efg", "h"]
    results = [infer.delay(t) for t in texts]  # one batch (they arrive within the wait)
    with pytest.raises(ModelError, match=r"result dict .* cannot be stored as msgpack .*numpy array"):
        results[1].get(timeout=30)
    for i in (0, 2, 3):
        assert results[i].get(timeout=30) == {"sum": sum(map(ord, texts[i])), "len": len(texts[i])}
    assert infer.delay("ok").get(timeout=30) == {"sum": ord("o") + ord("k"), "len": 2}
    wait_for("no in-flight entry left", lambda: in_flight(processes) == 0, 5)


def test_overload_is_rejected_fast_with_queue_full(processes: Processes) -> None:
    env = {**SLOW_ENV, "CARPOOL_MAX_PENDING": "50"}
    coordinator = processes.start("coordinator", "coordinator", **env)  # no worker yet: nothing drains
    processes.wait_coordinator(coordinator.pid)  # the bound below is the refusal's, not the start's
    texts = mixed_texts(200, seed=17)
    results = send(texts)
    t0 = time.monotonic()
    rejected = 0
    for r in results[50:]:
        with pytest.raises(QueueFull, match="CARPOOL_MAX_PENDING"):
            r.get(timeout=10)
        rejected += 1
    assert rejected == 150 and time.monotonic() - t0 < 15
    processes.start("worker0", "worker", **env)
    check_all_correct(results[:50], texts[:50])


def test_late_requests_fail_with_deadline_exceeded_and_expired_ones_are_revoked(processes: Processes) -> None:
    from celery.exceptions import TaskRevokedError

    from carpool.tasks import infer

    # No worker: they can only run out of time.
    env = {**SLOW_ENV, "CARPOOL_DEFAULT_DEADLINE_S": "0.5"}
    coordinator = processes.start("coordinator", "coordinator", **env)
    processes.wait_coordinator(coordinator.pid)
    late = infer.apply_async(("too late",), {"model": SLOW})
    expiring = infer.apply_async(("expiring",), {"model": SLOW}, expires=0.5)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="deadline passed"):  # carpool's default deadline
        late.get(timeout=10)
    with pytest.raises(TaskRevokedError, match="expired"):  # its caller's expires=, as Celery answers
        expiring.get(timeout=10)
    assert expiring.state == "REVOKED" and late.state == "FAILURE"
    assert time.monotonic() - t0 < 5


def test_sigterm_worker_finishes_its_batch(processes: Processes) -> None:
    env = {**SLOW_ENV, "SLOW_TOY_DELAY_S": "1.5"}
    start_stack(processes, **env)
    texts = [f"finish me {i}" for i in range(6)]
    results = send(texts)
    client = redis.Redis(port=server_of(processes).port)
    # wait until a worker has claimed the batch, then ask it to stop
    wait_for("a claim", lambda: len(requests_in(client, KEYS.inflight_claimed)) > 0, 30)
    assert processes.stop("worker0", sig=signal.SIGTERM, timeout_s=30) == 0
    done = [r for r in results if r.ready()]
    assert done, "the batch that was running should have finished before the worker exited"
    for r in done:
        assert r.successful()
