"""Celery's task semantics on carpool tasks, through real coordinator and worker processes: countdown
and eta, callbacks, error callbacks, chains and groups, and revoke.

Each is tried on ``carpool.infer`` (toy model) and on a ``@batched`` task, as a user of ``.delay()``
would write it.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import chain, group
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

from carpool.celery_app import app as carpool_app
from carpool.errors import InvalidInput, UnsupportedOption
from carpool.redis_edge.keys import Keys
from tests.integration.conftest import Processes, assert_same_vectors, server_of, start_stack, wait_for

pytestmark = pytest.mark.integration

IMPORTS = "tests.integration.batched_tasks"
ENV = {"CARPOOL_MODEL": "toy", "CARPOOL_IMPORTS": IMPORTS}


def _answered_at(result: AsyncResult) -> datetime:
    done = result.date_done
    assert isinstance(done, datetime)
    return done if done.tzinfo is not None else done.replace(tzinfo=UTC)


def test_countdown_and_eta_hold_a_request_until_then(processes: Processes) -> None:
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    sent = datetime.now(UTC)
    later = infer.apply_async(("later",), countdown=5)
    at = sent + timedelta(seconds=5)
    shouted = t.shout.apply_async(("at",), eta=at)
    now = infer.delay("now")
    # A request without an eta, sent after them, is answered while they wait.
    assert len(now.get(timeout=30)) == 32
    assert _answered_at(now) < at

    assert_same_vectors(later.get(timeout=30), infer.delay("later").get(timeout=30))
    assert shouted.get(timeout=30)["out"] == "AT"
    # Celery's countdown counts from its own clock reading at the send, just after ``sent``.
    assert _answered_at(later) >= at
    assert _answered_at(shouted) >= at


def test_a_request_expiring_before_its_eta_is_answered_expired_at_once(processes: Processes) -> None:
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    doomed = t.shout.apply_async(("x",), countdown=60, expires=2)
    t0 = time.monotonic()
    with pytest.raises(TaskRevokedError, match="expired"):  # Celery's answer, given at its eta
        doomed.get(timeout=30)
    assert doomed.state == "REVOKED" and time.monotonic() - t0 < 30


def test_a_held_request_survives_its_coordinators_crash(processes: Processes) -> None:
    from tests.integration import batched_tasks as t

    env = {**ENV, "CARPOOL_RECOVERY_TIMEOUT_S": "2"}
    start_stack(processes, **env)
    at = datetime.now(UTC) + timedelta(seconds=8)  # later than a new coordinator takes to start
    held = t.shout.apply_async(("held",), eta=at)
    client = redis.Redis.from_url(processes.broker_url)
    lease = Keys("carpool.requests").inflight_lease
    deadline = time.monotonic() + 20
    while client.zcard(lease) == 0:  # the coordinator took it into flight and holds it
        assert time.monotonic() < deadline, "the coordinator never took the request"
        time.sleep(0.05)
    processes.kill("coordinator")
    time.sleep(2.5)  # its lease runs out: the next coordinator's recovery requeues it
    processes.restart("coordinator")
    assert held.get(timeout=60)["out"] == "HELD"
    assert _answered_at(held) >= at


def test_chains_of_carpool_tasks_return_the_last_steps_result(processes: Processes) -> None:
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    two = chain(infer.s("one"), infer.si("two")).apply_async()
    assert_same_vectors(two.get(timeout=30), infer.delay("two").get(timeout=30))
    assert two.parent is not None and len(two.parent.get(timeout=30)) == 32
    assert (t.shout.s("four") | t.count.s()).apply_async().get(timeout=30) == 3  # {"out", "batch", "pid"}
    assert (
        chain(infer.s("a vector"), t.count.s(), t.shout.si("end")).apply_async().get(timeout=30)["out"]
        == "END"
    )


def test_run_time_rate_and_time_limits_are_refused_for_carpool_tasks_and_chains_go_on(
    processes: Processes,
) -> None:
    # Celery's handlers set the attribute and answered ok; then every chain step and callback the
    # worker sent to that task was refused as .delay() refuses a task with one (Flower's buttons).
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    control = carpool_app.control
    # A broadcast before the worker's remote control subscribed reaches nobody: wait until it answers.
    wait_for("the worker answering remote control", lambda: bool(control.ping(timeout=1)), 30)
    [reply] = control.rate_limit("carpool.infer", "100/s", reply=True, timeout=5)
    [(_, answer)] = reply.items()
    assert "error" in answer and "rate_limit='100/s' is not supported by carpool tasks" in answer["error"]
    [reply] = control.time_limit(t.naps.name, soft=1, hard=1.5, reply=True, timeout=5)
    [(_, answer)] = reply.items()
    assert "error" in answer and "time limits are not supported by carpool tasks" in answer["error"]
    for no_limit in (None, "0"):  # unsetting (`celery control rate_limit TASK 0` sends "0"): nothing to do
        [reply] = control.rate_limit("carpool.infer", no_limit, reply=True, timeout=5)
        assert "ok" in next(iter(reply.values())), no_limit
    [reply] = control.rate_limit("no.such.task", "1/s", reply=True, timeout=5)  # Celery's own handler
    assert next(iter(reply.values())) == {"error": "unknown task"}
    assert len((t.shout.s("x") | infer.si("after")).apply_async().get(timeout=30)) == 32
    callback = infer.si("linked").set(task_id=f"linked-{time.time()}")
    t.shout.apply_async(("y",), link=callback).get(timeout=30)
    assert len(AsyncResult(callback.id, app=carpool_app).get(timeout=30)) == 32


def test_a_failed_step_fails_the_rest_of_its_chain(processes: Processes) -> None:
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    with pytest.raises(ValueError, match="boom is not a word"):
        chain(t.fragile.s("boom"), t.count.s(), t.shout.s()).apply_async().get(timeout=30)
    # The next step refuses the result as its input: the chain's result says so.
    with pytest.raises(InvalidInput):
        (t.shout.s("x") | infer.s()).apply_async().get(timeout=30)


def test_callbacks_and_error_callbacks(processes: Processes) -> None:
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    counted = t.count.s()
    counted.freeze()
    twice = [t.count.s(), t.count.s()]
    for sig in twice:
        sig.freeze()
    vector = infer.apply_async(("linked",), link=counted)
    shouted = t.shout.apply_async(("hi",), link=twice)
    assert len(vector.get(timeout=30)) == 32
    assert carpool_app.AsyncResult(counted.id).get(timeout=30) == 32
    shouted.get(timeout=30)
    assert [carpool_app.AsyncResult(sig.id).get(timeout=30) for sig in twice] == [3, 3]

    # An error callback gets the failed request's id (an old-style errback), from the worker...
    on_error = t.shout.s()
    on_error.freeze()
    failed = t.fragile.apply_async(("boom",), link_error=on_error)
    with pytest.raises(ValueError):
        failed.get(timeout=30)
    assert carpool_app.AsyncResult(on_error.id).get(timeout=30)["out"] == failed.id.upper()
    # ...and from the coordinator, when it refuses the request.
    on_refusal = t.shout.s()
    on_refusal.freeze()
    refused = carpool_app.send_task("carpool.infer", args=[123], link_error=on_refusal)  # not a text
    with pytest.raises(InvalidInput):
        refused.get(timeout=30)
    assert carpool_app.AsyncResult(on_refusal.id).get(timeout=30)["out"] == refused.id.upper()
    # An expired request is revoked, as in Celery: no error callback runs.
    on_expiry = t.shout.s()
    on_expiry.freeze()
    expired = t.shout.apply_async(("x",), countdown=60, expires=1, link_error=on_expiry)
    with pytest.raises(TaskRevokedError, match="expired"):
        expired.get(timeout=30)
    time.sleep(1.0)
    assert not carpool_app.AsyncResult(on_expiry.id).ready()


def test_a_callback_that_cannot_be_sent_fails_under_its_own_id(processes: Processes) -> None:
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    # infer takes a text, and shout's result is a dict: only the worker holding it can tell.
    refusing, counted = infer.s(), t.count.s()
    for sig in (refusing, counted):
        sig.freeze()
    # A task no process knows, with no queue of its own: the coordinators answer it under its id.
    unknown = carpool_app.signature("nobody.knows")
    unknown.freeze()
    shouted = t.shout.apply_async(("hi",), link=[refusing, counted, unknown])
    assert shouted.get(timeout=30)["out"] == "HI"
    with pytest.raises(InvalidInput, match="text must be a str"):
        carpool_app.AsyncResult(refusing.id).get(timeout=30)
    with pytest.raises(InvalidInput, match=r"unknown task name 'nobody\.knows'.*CARPOOL_IMPORTS"):
        carpool_app.AsyncResult(unknown.id).get(timeout=30)
    assert carpool_app.AsyncResult(counted.id).get(timeout=30) == len(shouted.get(timeout=30))
    # carpool's own batch task as a link (refused at the call; send_task checks nothing): the worker
    # fails it under its id instead of pushing the caller's message onto the batch queue.
    forged = carpool_app.signature("carpool.run_batch")
    forged.freeze()
    carpool_app.send_task(t.shout.name, args=("hi",), link=forged).get(timeout=30)
    with pytest.raises(InvalidInput, match=r"carpool\.run_batch is carpool's own batch task"):
        carpool_app.AsyncResult(forged.id).get(timeout=30)

    # An old-style error callback is sent the failed request's id: with an argument of its own,
    # shout is given two items.
    two_items = t.shout.s("extra")
    two_items.freeze()
    failed = t.fragile.apply_async(("boom",), link_error=two_items)
    with pytest.raises(ValueError):
        failed.get(timeout=30)
    with pytest.raises(InvalidInput, match="exactly one item"):
        carpool_app.AsyncResult(two_items.id).get(timeout=30)


def test_groups_of_carpool_tasks(processes: Processes) -> None:
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    got = group(infer.s("one"), infer.s("two"), t.shout.s("x")).apply_async().get(timeout=30)
    assert len(got[0]) == len(got[1]) == 32 and got[2]["out"] == "X"


def test_a_revoked_request_never_runs(processes: Processes) -> None:
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    counted = t.count.s()
    counted.freeze()
    revoked = [
        infer.apply_async(("never",), countdown=2),
        t.shout.apply_async(("never",), countdown=2, link=counted),
    ]
    kept = t.shout.apply_async(("kept",), countdown=2)
    for r in revoked:
        r.revoke()
    for r in revoked:
        with pytest.raises(TaskRevokedError):
            r.get(timeout=30)
        assert r.state == "REVOKED"
    assert kept.get(timeout=30)["out"] == "KEPT"
    assert not carpool_app.AsyncResult(counted.id).ready(), "a revoked request's callbacks are not applied"


def test_a_revoke_never_overwrites_an_answer_and_is_readable_by_any_app(processes: Processes) -> None:
    """Every worker hears a revoke broadcast and Celery's handler stores REVOKED in each: through
    carpool's backend that store is write-once (one answer, the first) and JSON (the id may be
    another Celery app's on this Redis)."""
    from carpool.tasks import infer

    start_stack(processes, 2, **ENV)
    client = redis.Redis.from_url(processes.result_backend)
    answered = carpool_app.send_task("carpool.infer", args=[123])  # refused by the coordinator
    with pytest.raises(InvalidInput):
        answered.get(timeout=30)
    first = client.get(carpool_app.backend.get_key_for_task(answered.id))
    answered.revoke()
    foreign = "another-apps-task-0001"  # a plain Celery app's task on the same Redis
    carpool_app.control.revoke(foreign)
    key = carpool_app.backend.get_key_for_task(foreign)
    wait_for("a worker's REVOKED for the foreign id", lambda: client.get(key))
    time.sleep(1.0)  # both workers have handled the broadcast by now
    assert client.get(carpool_app.backend.get_key_for_task(answered.id)) == first, "the first answer stays"
    meta = json.loads(client.get(key) or b"")  # JSON, whatever CARPOOL_RESULT_SERIALIZER is
    assert meta["status"] == "REVOKED" and meta["task_id"] == foreign
    assert meta["result"]["exc_type"] == "TaskRevokedError"
    assert infer.delay("still serving").get(timeout=30)


def test_celerys_publish_options_reach_the_message_and_the_answer(processes: Processes) -> None:
    from tests.integration import batched_tasks as t

    r = t.shout.apply_async(
        ("mine",),
        task_id="my-own-id",
        headers={"tenant": "a"},
        shadow="shout-for-tenant-a",
        retry=True,
        retry_policy={"max_retries": 2, "interval_start": 0},
    )
    assert r.id == "my-own-id"
    client = redis.Redis.from_url(processes.broker_url)
    (raw,) = client.lrange("carpool.requests", 0, -1)
    headers = json.loads(raw)["headers"]
    assert (headers["id"], headers["tenant"], headers["shadow"]) == ("my-own-id", "a", "shout-for-tenant-a")
    elsewhere = t.shout.apply_async(("elsewhere",), queue="team-b.requests")
    (raw,) = client.lrange("team-b.requests", 0, -1)  # for a coordinator of that queue
    assert json.loads(raw)["headers"]["id"] == elsewhere.id
    start_stack(processes, **ENV)
    assert carpool_app.AsyncResult("my-own-id").get(timeout=30)["out"] == "MINE"
    assert client.llen("team-b.requests") == 1, "a coordinator of carpool.requests leaves it alone"


def test_what_cannot_be_honoured_is_refused_at_the_call(processes: Processes) -> None:
    from celery import chord

    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    with pytest.raises(UnsupportedOption, match="chord"):
        chord([t.shout.s("a"), t.shout.s("b")], t.count.s()).apply_async()
    # In a chain, Celery makes a group followed by a task a chord: refused too, not left waiting.
    with pytest.raises(UnsupportedOption, match="chord"):
        chain(t.shout.s("a"), group(t.count.s(), t.count.s()), t.count.s()).apply_async()
    # Celery would send every item in one message, which no coordinator can batch.
    mapped: list[tuple[Any, str]] = [
        (t.count.map(["a", "bb"]), "celery.map"),
        (t.count.starmap([["a"], ["bb"]]), "celery.starmap"),
        (t.count.chunks([["a"], ["bb"], ["ccc"]], 2), "celery.starmap"),
    ]
    for canvas, sent_as in mapped:
        with pytest.raises(UnsupportedOption, match=rf"\.chunks\(\) \({sent_as}\).*submit_many"):
            canvas.apply_async()
    client = redis.Redis(port=server_of(processes).port)
    assert client.llen("carpool.requests") == 0, "nothing was sent"


def test_a_revoke_reaches_requests_the_coordinator_holds(processes: Processes) -> None:
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    processes.start("coordinator", "coordinator", **ENV)  # no worker yet: it holds what it takes
    held_for_eta = t.shout.apply_async(("never",), countdown=600)
    no_worker_yet = infer.delay("never")
    kept = t.shout.delay("kept")
    client = redis.Redis.from_url(processes.broker_url)
    lease = Keys("carpool.requests").inflight_lease
    deadline = time.monotonic() + 30
    while client.zcard(lease) < 3:  # the coordinator took all three into flight
        assert time.monotonic() < deadline, "the coordinator never took the requests"
        time.sleep(0.05)
    held_for_eta.revoke()
    no_worker_yet.revoke()
    for r in (held_for_eta, no_worker_yet):  # answered long before the eta, with no worker up
        with pytest.raises(TaskRevokedError):
            r.get(timeout=30)
    # Revoked before it was sent: the coordinator remembers, and never batches it.
    before = t.shout.s("never")
    before.freeze()
    carpool_app.AsyncResult(before.id).revoke()
    time.sleep(0.5)
    before.apply_async()
    processes.start("worker0", "worker", **ENV)
    assert kept.get(timeout=60)["out"] == "KEPT"
    with pytest.raises(TaskRevokedError):
        carpool_app.AsyncResult(before.id).get(timeout=30)


TAKEN = re.compile(r"batches its claims took: (\d+)")


def test_a_revoke_heard_before_a_restart_is_remembered_by_the_next_coordinator_and_worker(
    processes: Processes,
) -> None:
    """Celery's workers learn the revokes their peers heard when they start (mingle). A coordinator
    records those it hears in Redis, where a coordinator or worker started later reads them: here
    both started after the broadcast, which neither could hear."""
    from tests.integration import batched_tasks as t

    first = processes.start("coordinator", "coordinator", **ENV)
    processes.wait_coordinator(first.pid)
    before = t.shout.s("never")
    before.freeze()
    carpool_app.AsyncResult(before.id).revoke()
    client = redis.Redis.from_url(processes.broker_url)
    revoked = Keys("carpool.requests").revoked
    wait_for("the revoke recorded", lambda: client.zscore(revoked, before.id) is not None, 10)
    processes.stop("coordinator")
    start_stack(processes, prefix="next-", **ENV)
    before.apply_async()
    kept = t.shout.delay("kept")
    assert kept.get(timeout=60)["out"] == "KEPT"
    with pytest.raises(TaskRevokedError):
        carpool_app.AsyncResult(before.id).get(timeout=30)


def test_a_revoke_heard_while_its_batch_is_on_the_device_answers_it_revoked(processes: Processes) -> None:
    """Celery's revoke handler stores REVOKED at once in every worker that hears it, and carpool's
    write-once results keep that answer: a request revoked while its batch waits for or runs on the
    device thread is answered REVOKED (with or without ``terminate``), and its batch runs on for
    the others."""
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from tests.integration.models import SLOW

    slow = {"CARPOOL_MODEL": SLOW, "CARPOOL_MODELS": SLOW, "CARPOOL_MAX_BATCH": "8", "SLOW_TOY_DELAY_S": "4"}
    start_stack(processes, **slow)
    # Sixteen in one publish: one take, two full batches dispatched together, so the worker hands
    # both to its device thread (a lone batch would run on the Celery thread, which reads remote
    # control only after it, as Celery's solo pool does). The second may be taken by the first's
    # claim and handed over in the same Celery task, whose log line then counts it.
    results = submit_many([f"text {i}" for i in range(16)], model=SLOW)

    def handed() -> int:
        lines = [
            line for line in processes.log("worker0").splitlines() if "handed to the device stage" in line
        ]
        return sum(1 + int(m.group(1)) if (m := TAKEN.search(line)) else 1 for line in lines)

    wait_for("both batches handed to the device thread", lambda: handed() >= 2)
    for i, r in enumerate(results[:12]):
        r.revoke(terminate=i % 2 == 0)
    outcomes = gather(results, timeout=60, return_exceptions=True)
    assert all(isinstance(o, TaskRevokedError) for o in outcomes[:12]), outcomes[:12]
    assert all(isinstance(o, list) and len(o) == 32 for o in outcomes[12:]), outcomes[12:]


def test_chains_between_carpool_and_plain_celery_tasks(processes: Processes) -> None:
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    plain_worker = ["celery", "-A", "carpool.celery_app", "worker", "--include", IMPORTS]
    plain_worker += ["--queues", t.PLAIN_QUEUE, "--pool", "solo", "--without-mingle", "--without-gossip"]
    processes.spawn("plain-worker", plain_worker, **ENV)
    assert (infer.s("to a plain worker") | t.describe.s()).apply_async().get(timeout=60) == "list of 32"
    # ...and back: the plain worker's tracer sends the carpool step, which a batch worker runs.
    assert (t.describe.s("abc") | t.count.s()).apply_async().get(timeout=60) == len("str of 3")
    # A plain task's link is applied by Celery's tracer: carpool's batch task as one reaches the
    # coordinators, which answer it under its id, not the batch queue.
    forged = carpool_app.signature("carpool.run_batch")
    forged.freeze()
    assert t.describe.apply_async(("abc",), link=forged).get(timeout=60) == "str of 3"
    with pytest.raises(InvalidInput, match="only coordinators send, with the batch they made"):
        carpool_app.AsyncResult(forged.id).get(timeout=60)
