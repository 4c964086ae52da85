"""A worker killed between storing a batch's results and sending their links (callbacks, chains,
error callbacks): a coordinator sends them a lease later, from the links outbox."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import redis
from celery import chain
from celery.result import AsyncResult

from carpool.celery_app import app as carpool_app
from carpool.redis_edge.keys import Keys
from tests.integration.conftest import Processes, start_stack, wait_for

pytestmark = pytest.mark.integration

IMPORTS = "tests.integration.batched_tasks,tests.integration.dying_links"
ENV = {"CARPOOL_MODEL": "toy", "CARPOOL_IMPORTS": IMPORTS, "CARPOOL_RECOVERY_TIMEOUT_S": "2"}
KEYS = Keys("carpool.requests")


def test_the_links_a_killed_worker_did_not_send_are_sent_by_a_coordinator(processes: Processes) -> None:
    from tests.integration import batched_tasks as t

    start_stack(processes, **ENV)
    client = redis.Redis.from_url(processes.broker_url)
    # A worker that lives sends the links itself and empties the outbox.
    assert (t.shout.s("alive") | t.count.s()).apply_async().get(timeout=30) == 3
    wait_for("the outbox emptied", lambda: client.exists(KEYS.links_due, KEYS.links_pending) == 0, 10)

    processes.restart("worker0", CARPOOL_TEST_DIE_BEFORE_LINKS="3")  # killed at the third batch
    stamp = f"{time.time()}"
    callback = t.shout.si("called back").set(task_id=f"callback-{stamp}")
    errback = t.shout.si("errback").set(task_id=f"errback-{stamp}")
    first = t.shout.apply_async(("first",), link=callback)
    two_steps = chain(t.shout.s("chained"), t.count.s()).apply_async()
    failing = t.fragile.apply_async(("boom",), link_error=errback)
    # The worker stored the three results (three batches: two tasks, and a chain's first step after
    # the other shout), sent none of their links, and was killed at the third.
    assert first.get(timeout=30)["out"] == "FIRST"
    assert two_steps.parent is not None and two_steps.parent.get(timeout=30)["out"] == "CHAINED"
    with pytest.raises(ValueError, match="boom is not a word"):
        failing.get(timeout=30)
    wait_for("the worker's death", lambda: processes.procs["worker0"].poll() is not None, 30)
    wait_for("the coordinator sending them", lambda: client.exists(KEYS.links_pending) == 0, 15)
    # Sent as a worker sends them: nobody in the coordinator waits on their results, so it subscribes
    # to none (its ACL user may not; found by the review of the outbox).
    numsub = dict(client.pubsub_numsub(f"celery-task-meta-{callback.id}", f"celery-task-meta-{errback.id}"))
    assert set(numsub.values()) == {0}, numsub

    processes.restart("worker0", CARPOOL_TEST_DIE_BEFORE_LINKS="")
    assert AsyncResult(callback.id, app=carpool_app).get(timeout=30)["out"] == "CALLED BACK"
    assert two_steps.get(timeout=30) == 3
    assert AsyncResult(errback.id, app=carpool_app).get(timeout=30)["out"] == "ERRBACK"
    wait_for("the outbox emptied", lambda: client.exists(KEYS.links_due, KEYS.links_pending) == 0, 10)
    sent = re.findall(
        r"sent the links of (\d+) requests whose worker or coordinator stopped before sending them",
        processes.log("coordinator"),
    )
    assert sum(map(int, sent)) == 3, "each request's links sent once, by the coordinator"


def test_the_error_callbacks_of_a_refusal_survive_its_coordinator_killed_before_sending_them(
    processes: Processes,
) -> None:
    from carpool.errors import InvalidInput
    from tests.integration import batched_tasks as t

    start_stack(processes, **{**ENV, "CARPOOL_IMPORTS": f"{IMPORTS},tests.integration.dying_refusals"})
    client = redis.Redis.from_url(processes.broker_url)
    processes.restart("coordinator", CARPOOL_TEST_DIE_BEFORE_ERRBACKS="1")
    errback = t.shout.si("refused").set(task_id=f"errback-{time.time()}")
    # Not a text: the coordinator refuses it, stores the refusal, and is killed before its errback.
    refused = carpool_app.send_task("carpool.infer", args=[123], link_error=errback)
    with pytest.raises(InvalidInput, match="text must be a str"):
        refused.get(timeout=30)
    wait_for("the coordinator's death", lambda: processes.procs["coordinator"].poll() is not None, 30)
    assert client.hexists(KEYS.links_pending, refused.id), "filed in the outbox with the refusal"
    assert not client.hexists(KEYS.inflight_raw, refused.id), "acknowledged with the refusal"

    processes.restart("coordinator", CARPOOL_TEST_DIE_BEFORE_ERRBACKS="")
    assert AsyncResult(errback.id, app=carpool_app).get(timeout=30)["out"] == "REFUSED"
    wait_for("the outbox emptied", lambda: client.exists(KEYS.links_due, KEYS.links_pending) == 0, 10)
    assert "sent the links of 1 requests" in processes.log("coordinator")


def test_a_slow_error_callback_called_in_the_coordinator_does_not_hold_its_batching(
    processes: Processes, tmp_path: Path
) -> None:
    """Celery calls an error callback taking ``(request, exc, traceback)`` where the request failed:
    for a refusal, in the coordinator. It runs on the coordinator's link thread: requests sent while
    it runs are batched and answered."""
    from carpool.errors import InvalidInput
    from carpool.tasks import infer
    from tests.integration.slow_errbacks import waits_for_release

    folder = tmp_path / "errbacks"
    folder.mkdir()
    imports = "tests.integration.slow_errbacks"
    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_IMPORTS=imports, CARPOOL_TEST_ERRBACK_DIR=str(folder))
    refused = carpool_app.send_task(
        "carpool.infer", args=[123], link_error=waits_for_release.s()
    )  # not a text
    with pytest.raises(InvalidInput):
        refused.get(timeout=30)
    wait_for("the error callback running", lambda: (folder / f"started-{refused.id}").exists(), 30)
    # Until it is released (30 s at most) it runs: a request sent now is answered meanwhile.
    assert len(infer.delay("sent while the error callback runs").get(timeout=20)) == 32
    assert not (folder / f"done-{refused.id}").exists()
    (folder / "release").touch()
    wait_for("the error callback done", lambda: (folder / f"done-{refused.id}").exists(), 30)
    assert "text must be a str" in (folder / f"done-{refused.id}").read_text()


def test_an_error_callback_that_kills_each_coordinator_calling_it_is_dropped_after_its_tries(
    processes: Processes,
) -> None:
    """A refusal's error callback that takes down the coordinator calling it is taken again from the
    links outbox by the coordinators started after it, LINKS_TRIES times, then dropped, named in an
    ERROR: the next coordinator lives and serves."""
    from carpool.errors import InvalidInput
    from carpool.redis_edge.store import LINKS_TRIES
    from carpool.tasks import infer
    from tests.integration.slow_errbacks import kills_its_process

    env = {"CARPOOL_MODEL": "toy", "CARPOOL_IMPORTS": "tests.integration.slow_errbacks"}
    start_stack(processes, **env, CARPOOL_RECOVERY_TIMEOUT_S="2")
    client = redis.Redis.from_url(processes.broker_url)
    refused = carpool_app.send_task("carpool.infer", args=[123], link_error=kills_its_process.s())
    with pytest.raises(InvalidInput):
        refused.get(timeout=30)
    deaths = 0
    deadline = time.monotonic() + 120
    while "were taken" not in processes.log("coordinator") and time.monotonic() < deadline:
        if processes.procs["coordinator"].poll() is not None:  # it died: start another, as compose would
            deaths += 1
            processes.restart("coordinator")
        time.sleep(0.2)
    assert deaths == 1 + LINKS_TRIES, "the refusing coordinator, then one per try from the outbox"
    assert f"request {refused.id}: its links were taken {LINKS_TRIES} times" in processes.log("coordinator")
    assert client.exists(KEYS.links_due, KEYS.links_pending, KEYS.links_tries) == 0
    assert len(infer.delay("served after").get(timeout=30)) == 32
    assert processes.procs["coordinator"].poll() is None
