"""Task events go out while some client receives them (``CARPOOL_EVENTS=auto``, the default).

Against the session's redis-server: a real Celery event receiver comes and goes, and the
probe's answer follows it; a coordinator and a worker serving with nobody listening publish only
the probes' empty lists (seen with MONITOR, which is not a subscriber), and with a listener every
request's events reach it; a producer's task-sent events follow the answers to its own publishes.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest
import redis

from carpool.celery_edge.app import app
from carpool.celery_edge.events import TaskEvents
from carpool.producer.gather import gather
from carpool.producer.submit import submit_many
from carpool.tools.embedded import EmbeddedRedis
from tests.integration.conftest import Processes, start_stack, wait_for

TOY = {"CARPOOL_MODEL": "toy", "CARPOOL_MODELS": "toy"}
EVENTS_PATTERN = "/0.celeryev/*"  # what kombu's Redis transport subscribes an event receiver to


@contextmanager
def celery_receiver() -> Iterator[list[dict[str, Any]]]:
    """Celery's own event receiver capturing in a thread; yields the events it has processed."""
    seen: list[dict[str, Any]] = []
    subscribed = threading.Event()
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": seen.append})
        thread = threading.Thread(
            target=receiver.capture,
            kwargs={"limit": None, "timeout": None, "wakeup": False},
            daemon=True,
        )
        receiver.on_consume_ready = lambda *a, **k: subscribed.set()
        thread.start()
        assert subscribed.wait(10), "the event receiver never subscribed"
        try:
            yield seen
        finally:
            receiver.should_stop = True
            thread.join(10)
            assert not thread.is_alive(), "the event receiver did not stop"


def test_events_are_built_only_while_a_receiver_listens(clean_redis: EmbeddedRedis) -> None:
    client = redis.Redis(port=clean_redis.port)
    events = TaskEvents(app, "probe-test@host", mode="auto", client=client)
    events.start()
    try:
        wait_for("no listener found", lambda: not events.enabled)
        events.received("unheard", "('nobody listens',)")
        assert events.take() is None, "an event built while nobody listens"

        with celery_receiver() as seen:
            wait_for("the receiver found", lambda: events.enabled)
            batch = events.fork()  # a worker's batch: its fork follows the same probe
            batch.received("heard", "('someone listens',)")
            message = batch.take()
            assert message is not None
            assert client.publish(*message) >= 1
            wait_for("the event processed", lambda: any(e.get("uuid") == "heard" for e in seen))
            time.sleep(0.3)  # a few more probes arrive meanwhile
        # The probes' empty lists are no events to a receiver: it processed exactly the one sent.
        assert [(e["type"], e["uuid"]) for e in seen] == [("task-received", "heard")], seen

        wait_for("the receiver gone", lambda: not events.enabled)
    finally:
        events.close()


def test_on_and_off_do_not_probe(clean_redis: EmbeddedRedis) -> None:
    client = redis.Redis(port=clean_redis.port)
    always = TaskEvents(app, "on@host", mode=True, client=client)
    never = TaskEvents(app, "off@host", mode=False, client=client)
    always.start()
    never.start()
    assert always.enabled and not never.enabled
    assert always._listeners is None and never._listeners is None, "a probe thread for a fixed mode"
    always.received("a", "()")
    never.received("b", "()")
    assert always.take() is not None and never.take() is None


@contextmanager
def monitored(port: int) -> Iterator[list[str]]:
    """Every command the server runs meanwhile (scripts' commands included), as MONITOR shows them."""
    lines: list[str] = []
    stop_word = "end-of-monitor"
    client = redis.Redis(port=port)
    ready = threading.Event()

    def watch() -> None:
        with client.monitor() as monitor:  # type: ignore[no-untyped-call]
            ready.set()
            for command in monitor.listen():
                text = str(command["command"])
                if stop_word in text:
                    return
                lines.append(text)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert ready.wait(10)
    time.sleep(0.2)  # MONITOR is in effect once the server answered it
    try:
        yield lines
    finally:
        client.echo(stop_word)
        thread.join(10)


def event_bodies(lines: list[str]) -> list[list[Any]]:
    """The event lists PUBLISHed on the task.multi topic, decoded."""
    out = []
    for line in lines:
        head, _, rest = line.partition(" ")
        if head.upper() != "PUBLISH" or not rest.startswith("/0.celeryev/task.multi "):
            continue
        envelope = json.loads(rest.split(" ", 1)[1])
        out.append(json.loads(base64.b64decode(envelope["body"])))
    return out


def test_a_stack_sends_events_only_while_someone_listens(processes: Processes) -> None:
    start_stack(processes, **TOY)
    port = processes.server.port  # type: ignore[union-attr]
    gather(submit_many(["warm up"], model="toy"), timeout=60)
    time.sleep(0.5)  # both processes' probes have answered: nobody listens

    with monitored(port) as lines:
        results = submit_many([f"unheard request {i}" for i in range(40)], model="toy")
        assert len(gather(results, timeout=60)) == 40
        time.sleep(0.3)
    bodies = event_bodies(lines)
    assert bodies.count([]) >= 2, f"no probes seen in {len(lines)} commands"
    # The producer's task-sent events follow the answers to its own publishes (the last test here).
    served = [e for body in bodies for e in body if e["type"] != "task-sent"]
    assert served == [], served[:2]

    listener = cast("Any", redis.Redis(port=port)).pubsub()  # typed in some redis-py releases, not all
    listener.psubscribe(EVENTS_PATTERN)
    try:
        assert listener.get_message(timeout=10)["type"] == "psubscribe"  # in effect from here
        probed_by: set[str] = set()
        kinds: dict[str, set[str]] = {}

        def read_all() -> None:
            """Every message waiting (probes come ten times a second from each process)."""
            message = listener.get_message(timeout=0.2)
            while message is not None:
                if message["type"] == "pmessage":
                    envelope = json.loads(message["data"])
                    body = json.loads(base64.b64decode(envelope["body"]))
                    if body == []:
                        probed_by.add(envelope["headers"]["hostname"])
                    for event in body if isinstance(body, list) else [body]:
                        if event.get("uuid") in kinds:
                            kinds[event["uuid"]].add(event["type"])
                message = listener.get_message(timeout=0)

        def both_probed() -> bool:  # each process's probe reached the listener: it knows of it
            read_all()
            return len(probed_by) >= 2

        wait_for("a probe of the coordinator's and of the worker's", both_probed, timeout_s=30)
        results = submit_many([f"heard request {i}" for i in range(40)], model="toy")
        kinds.update({r.id: set() for r in results})
        assert len(gather(results, timeout=60)) == 40

        def all_heard() -> bool:
            read_all()
            return all({"task-received", "task-started", "task-succeeded"} <= k for k in kinds.values())

        wait_for("every request's received, started and succeeded events", all_heard, timeout_s=30)
    finally:
        listener.close()


def test_a_producer_sends_task_sent_events_while_its_last_ones_reached_someone(
    clean_redis: EmbeddedRedis,
) -> None:
    from carpool.celery_edge.app import create_app, settings_of, state_of
    from carpool.celery_edge.events import PROBE_INTERVAL_S, Heard
    from carpool.producer.submit import publish_tasks

    client = redis.Redis(port=clean_redis.port)
    settings = settings_of(app)

    def publishes(producer: Any, **options: Any) -> int:
        """The PUBLISH commands one small publish_tasks call sent."""
        before = int(client.info("commandstats").get("cmdstat_publish", {}).get("calls", 0))
        publish_tasks("carpool.infer", [(("a text",), {})], app=producer, subscribe=False, **options)
        return int(client.info("commandstats").get("cmdstat_publish", {}).get("calls", 0)) - before

    auto = create_app(settings.model_copy(update={"events": "auto"}))
    # The producer's belief on a clock moved by hand: a slow moment of this host's cannot age it.
    now = [0.0]
    state_of(auto).sent_heard = Heard(clock=lambda: now[0])
    assert publishes(auto) == 1, "the first publish sends its events, and hears nobody got them"
    assert publishes(auto) == 0, "nobody listened a moment ago: no events built"
    assert publishes(auto, sent_events=True) == 1, "sent_events given holds as given"
    now[0] += PROBE_INTERVAL_S
    assert publishes(auto) == 1, "asked again once the answer is a probe interval old"

    listener = cast("Any", client).pubsub()  # typed in some redis-py releases, not all
    listener.psubscribe(EVENTS_PATTERN)
    try:
        assert listener.get_message(timeout=10)["type"] == "psubscribe"  # in effect from here
        now[0] += PROBE_INTERVAL_S
        sent = [publishes(auto) for _ in range(5)]
        assert sent == [1] * 5, "someone listens: every publish sends its events"
        heard = []
        for _ in range(20):
            message = listener.get_message(timeout=1)
            if message and message["type"] == "pmessage":
                body = json.loads(base64.b64decode(json.loads(message["data"])["body"]))
                heard += [e["type"] for e in body]
            if len(heard) == 5:
                break
        assert heard == ["task-sent"] * 5, heard

        never = create_app(settings.model_copy(update={"events": False}))
        assert [publishes(never) for _ in range(3)] == [0, 0, 0], "CARPOOL_EVENTS=false: none"
        always = create_app(settings.model_copy(update={"events": True}))
    finally:
        listener.close()
    assert [publishes(always) for _ in range(3)] == [1, 1, 1], (
        "CARPOOL_EVENTS=true: nobody listens, still sent"
    )
    client.delete("carpool.requests")


def test_with_events_off_celerys_own_publish_sends_no_task_sent_event_either(
    clean_redis: EmbeddedRedis,
) -> None:
    """CARPOOL_EVENTS=false: a send through Celery's own publish (countdown, send_task, callbacks)
    must not announce a task Flower would then show PENDING for good."""
    from carpool.celery_edge.app import create_app
    from carpool.config import Settings

    for events, announced in ((False, 0), (True, 2)):
        settings = Settings(
            broker_url=clean_redis.url(0), result_backend=clean_redis.url(1), events=events, model="toy"
        )
        producer = create_app(settings)
        with monitored(clean_redis.port) as lines:
            producer.send_task("carpool.infer", ("hello",), queue="carpool.requests", countdown=30)
            producer.send_task("carpool.infer", ("there",), queue="carpool.requests")
        sent = [line for line in lines if line.upper().startswith("PUBLISH ") and "task.sent" in line]
        pushed = [line for line in lines if line.upper().startswith("LPUSH ")]
        assert len(pushed) == 2 and len(sent) == announced, (events, lines)
        producer.close()


def test_a_request_revoked_by_another_worker_while_its_lone_batch_runs_is_said_revoked(
    processes: Processes,
) -> None:
    """The idle worker's revoke handler stores REVOKED at once; the busy one's Celery thread runs the
    lone batch and hears the revoke only after it, so write-once refuses its result. Its task events
    said succeeded (Flower showed SUCCESS while the caller got REVOKED) and the refusal counted as a
    rerun (found by the Flower review)."""
    from celery.exceptions import TaskRevokedError

    from carpool.redis_edge.keys import REJECTED_WRITES, Keys
    from tests.integration import batched_tasks as t

    env = {
        "CARPOOL_MODEL": "toy",
        "CARPOOL_IMPORTS": "tests.integration.batched_tasks",
        "CARPOOL_EVENTS": "true",
    }
    start_stack(processes, 2, **env)
    client = redis.Redis(port=processes.server.port)  # type: ignore[union-attr]
    listener = cast("Any", client).pubsub()
    listener.psubscribe(EVENTS_PATTERN)
    seen: dict[str, list[str]] = {}
    try:
        assert listener.get_message(timeout=10)["type"] == "psubscribe"
        slow = t.naps.delay({"tag": "lone", "s": 3})
        keys = Keys("carpool.requests")
        wait_for("the lone batch claimed", lambda: client.hexists(keys.inflight_claimed, slow.id))
        time.sleep(0.3)  # running now, on the Celery thread of the worker that claimed it
        slow.revoke()
        with pytest.raises(TaskRevokedError):
            slow.get(timeout=30)
        outcome_kinds = ("task-succeeded", "task-failed", "task-revoked")

        def outcomes() -> list[str]:
            read_events(listener, seen)
            return [kind for kind in seen.get(slow.id, []) if kind in outcome_kinds]

        wait_for("the slow batch's outcome", outcomes, timeout_s=30)
        time.sleep(0.5)  # anything else it sent arrives meanwhile
        assert outcomes() == ["task-revoked"], seen[slow.id]
    finally:
        listener.close()
    assert int(client.hget(keys.stats, REJECTED_WRITES) or 0) == 0, "no request ran twice"
    logs = processes.log("worker0") + processes.log("worker1")
    assert "1 request(s) revoked while it ran; their REVOKED answer stands" in logs


def read_events(listener: Any, seen: dict[str, list[str]]) -> None:
    """Every event message waiting on ``listener``, each event's type appended under its task id."""
    message = listener.get_message(timeout=0.2)
    while message is not None:
        if message["type"] == "pmessage":
            body = json.loads(base64.b64decode(json.loads(message["data"])["body"]))
            for event in body if isinstance(body, list) else [body]:
                if "uuid" in event:
                    seen.setdefault(event["uuid"], []).append(event["type"])
        message = listener.get_message(timeout=0)


def test_a_batch_functions_exception_shows_in_flower_with_its_traceback() -> None:
    from carpool.celery_edge.events import TaskEvents
    from carpool.errors import ModelError

    def fragile() -> None:
        raise ValueError("boom is not a word I take")

    try:
        fragile()
    except ValueError as exc:
        raised: BaseException = exc
    events = TaskEvents(app, "worker@host", mode=True)
    events.outcomes(
        [("raised", "FAILURE", raised), ("found", "FAILURE", ModelError("returned 2 outputs"))], 0.5
    )
    assert events._buffer[0]["uuid"] == "raised" and events._buffer[1]["uuid"] == "found"
    assert 'raise ValueError("boom is not a word I take")' in events._buffer[0]["traceback"]
    assert events._buffer[1]["traceback"] is None  # made to describe a failure, never raised
