"""Callbacks, chains and error callbacks of carpool requests, applied as Celery's tracer would: what
gets sent, with which arguments and ids (sends recorded, nothing reaches a broker)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import group

from carpool.celery_edge import links
from carpool.celery_edge.app import app
from carpool.errors import InvalidInput, ModelError
from carpool.tasks import infer
from carpool.wire import Links

seen_by_new_style: list[tuple[str, str]] = []


seen_requests: list[Any] = []
seen_tracebacks: list[Any] = []


@app.task(name="unit.links.on_error")  # type: ignore[untyped-decorator, unused-ignore]
def on_error(request: Any, exc: Any, traceback: Any) -> None:
    """A new-style error callback: Celery calls it in the process that stored the failure."""
    seen_by_new_style.append((request.id, str(exc)))
    seen_requests.append(request)
    seen_tracebacks.append(traceback)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every task message the app would send: name, args and options."""
    out: list[dict[str, Any]] = []

    def send_task(name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        out.append({"name": name, "args": tuple(args or ()), **options})
        return app.AsyncResult(options.get("task_id") or "sent")

    monkeypatch.setattr(app, "send_task", send_task)
    # A group's apply_async subscribes to its members' results (Celery's barrier); no Redis here.
    # On the backend's class: each thread has a backend of its own (a coordinator's link thread).
    monkeypatch.setattr(type(app.backend), "add_pending_result", lambda *args, **kwargs: None)
    return out


def sig(name: str, *args: Any, task_id: str | None = None) -> dict[str, Any]:
    """A signature of a task this process does not know, sent to a plain Celery worker's queue."""
    signature = app.signature(name, args=args, options={"queue": "plain"})
    if task_id:
        signature.set(task_id=task_id)
    return dict(signature)


def test_a_callback_gets_the_result_with_the_request_as_parent(sent: list[dict[str, Any]]) -> None:
    lk: Links = {"callbacks": [sig("other.task", "first")], "root_id": "root"}
    assert links.on_success(app, "req", lk, [1.5]) == []
    [call] = sent
    assert call["name"] == "other.task" and call["args"] == ([1.5], "first")  # result first, as Celery
    assert call["parent_id"] == "req" and call["root_id"] == "root"


def test_without_a_root_id_the_request_is_the_root(sent: list[dict[str, Any]]) -> None:
    links.on_success(app, "req", {"callbacks": [sig("other.task")]}, "out")
    assert sent[0]["root_id"] == "req"


@pytest.mark.parametrize("inherit", [True, False])
def test_the_next_steps_inherit_the_requests_priority_when_the_app_says_so(
    sent: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, inherit: bool
) -> None:
    from carpool.celery_edge import requests as protocol
    from tests.unit.messages import message

    monkeypatch.setitem(app.conf, "task_inherit_parent_priority", inherit)
    embed = {
        "callbacks": [sig("callback.task")],
        "errbacks": None,
        "chain": [sig("next.step")],
        "chord": None,
    }
    raw = message("req", "hi", embed=embed, priority=7)
    lk = protocol.decode(raw).links
    assert lk is not None and lk.get("priority") == 7
    links.on_success(app, "req", lk, "out")
    assert [(c["name"], c.get("priority")) for c in sent] == [
        ("callback.task", 7 if inherit else None),
        ("next.step", 7 if inherit else None),
    ]


def test_several_callbacks_are_sent_together(sent: list[dict[str, Any]]) -> None:
    nested = dict(group(app.signature("g.one", queue="plain"), app.signature("g.two", queue="plain")))
    lk: Links = {"callbacks": [sig("a.task"), sig("b.task"), nested]}
    links.on_success(app, "req", lk, 7)
    assert sorted(c["name"] for c in sent) == ["a.task", "b.task", "g.one", "g.two"]
    assert all(c["args"] == (7,) and c["parent_id"] == "req" for c in sent)


def test_the_chains_next_step_gets_the_result_and_the_rest_of_the_chain(sent: list[dict[str, Any]]) -> None:
    last = sig("third.task", task_id="t3")
    lk: Links = {"chain": [last, sig("second.task", task_id="t2")], "root_id": "root"}
    assert links.on_success(app, "req", lk, "out") == []
    [call] = sent
    assert call["name"] == "second.task" and call["task_id"] == "t2" and call["args"] == ("out",)
    assert [dict(s)["task"] for s in call["chain"]] == ["third.task"]
    assert call["parent_id"] == "req" and call["root_id"] == "root"


def test_a_carpool_step_that_refuses_the_result_fails_the_rest_of_the_chain(
    sent: list[dict[str, Any]],
) -> None:
    lk: Links = {"chain": [sig("third.task", task_id="t3"), dict(infer.s().set(task_id="t2"))]}
    failures = links.on_success(app, "req", lk, {"not": "a text"})
    assert sent == []
    assert [(task_id, state) for task_id, state, _ in failures] == [("t3", "FAILURE"), ("t2", "FAILURE")]
    assert all(isinstance(exc, InvalidInput) for _, _, exc in failures)


def test_an_immutable_carpool_step_is_sent_with_its_own_arguments(sent: list[dict[str, Any]]) -> None:
    lk: Links = {"chain": [dict(infer.si("two").set(task_id="t2"))]}
    assert links.on_success(app, "req", lk, [0.1, 0.2]) == []
    [call] = sent
    assert call["name"] == "carpool.infer" and call["args"] == ("two",) and call["task_id"] == "t2"


def test_a_failure_goes_on_to_every_chain_step_with_an_id() -> None:
    error = ModelError("boom")
    lk: Links = {"chain": [sig("c.task", task_id="t3"), sig("b.task"), sig("a.task", task_id="t1")]}
    assert links.chain_failures(lk, error) == [("t3", "FAILURE", error), ("t1", "FAILURE", error)]
    assert links.chain_failures(None, error) == []


def test_old_style_error_callbacks_are_sent_the_failed_requests_id(sent: list[dict[str, Any]]) -> None:
    lk: Links = {"errbacks": [sig("errors.task")], "root_id": "root"}
    links.on_failure(app, "req", "carpool.infer", lk, ModelError("boom"))
    [call] = sent
    assert call["name"] == "errors.task" and call["args"] == ("req",)
    assert call["parent_id"] == "req" and call["root_id"] == "root"


def test_new_style_error_callbacks_run_here_with_a_request_and_the_exception(
    sent: list[dict[str, Any]],
) -> None:
    seen_by_new_style.clear()
    links.on_failure(
        app, "req", "carpool.infer", {"errbacks": [sig("unit.links.on_error")]}, ModelError("boom")
    )
    assert sent == [] and seen_by_new_style == [("req", "boom")]


def test_a_new_style_error_callback_gets_the_stored_traceback_where_the_exception_was_rebuilt(
    sent: list[dict[str, Any]],
) -> None:
    """Found by the review of the links outbox: a coordinator sending a dead worker's error callbacks
    rebuilds the exception from the stored failure, which has no traceback of its own; the
    callback got '' where the worker's gets the real one."""
    seen_tracebacks.clear()
    errbacks: Links = {"errbacks": [sig("unit.links.on_error")]}
    stored = 'Traceback (most recent call last):\n  File "model.py", line 3\nModelError: boom\n'
    links.on_failure(app, "req", "carpool.infer", errbacks, ModelError("boom"), traceback=stored)
    links.on_failure(app, "req", "carpool.infer", errbacks, ModelError("boom"))  # never raised: none
    assert seen_tracebacks == [stored, None]


def test_a_new_style_error_callback_gets_the_failed_requests_args_and_kwargs(
    sent: list[dict[str, Any]],
) -> None:
    # An errback that logs or re-queues request.args[0] got None: only the id and task travelled.
    from carpool.celery_edge.requests import decode
    from tests.unit.messages import message

    raw = message("req", "the text", model="toy", embed={"errbacks": [sig("unit.links.on_error")]})
    incoming = decode(raw)
    assert incoming.links is not None
    seen_requests.clear()
    links.on_failure(app, "req", "carpool.infer", incoming.links, ModelError("boom"), "carpool-gpu-1@host")
    [request] = seen_requests
    assert (request.id, request.task, request.args, request.kwargs, request.hostname) == (
        "req",
        "carpool.infer",
        ["the text"],
        {"model": "toy"},
        "carpool-gpu-1@host",  # the process, as its task events name it
    )
    without = decode(message("plain", "the text", embed={"callbacks": [sig("other.task")]}))
    assert without.links is not None and "args" not in without.links  # carried only for errbacks


def _known_plain(value: Any) -> Any:
    return value


def test_a_step_this_process_does_not_know_goes_to_the_coordinators(sent: list[dict[str, Any]]) -> None:
    # Not a task this process knows, and no queue: the app's default queue is the request queue,
    # whose coordinators batch it (a @batched task of their CARPOOL_IMPORTS) or answer its error.
    lk: Links = {"chain": [dict(app.signature("nobody.knows").set(task_id="t2"))]}
    assert links.on_success(app, "req", lk, "out") == []
    assert (sent[0]["name"], sent[0]["task_id"]) == ("nobody.knows", "t2")
    assert app.amqp.router.route({}, "nobody.knows")["queue"].name == "carpool.requests"
    # A plain task this process knows, with no queue of its own, goes where carpool's workers run
    # it, as Celery's workers would.
    app.task(name="unit.links.known_plain")(_known_plain)
    assert app.amqp.router.route({}, "unit.links.known_plain")["queue"].name == "carpool.batches"
    sent.clear()
    # With a queue of its own it is sent there.
    routed: Links = {"chain": [sig("nobody.knows")]}
    assert links.on_success(app, "req", routed, "out") == []
    assert sent[0]["name"] == "nobody.knows" and sent[0]["queue"] == "plain"


class Clock:
    """A monotonic clock that only ``sleep`` moves: retry windows run without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr("carpool.redis_edge.retry.time.monotonic", fake.monotonic)
    monkeypatch.setattr("carpool.redis_edge.retry.time.sleep", fake.sleep)
    return fake


@pytest.fixture
def outage(sent: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sends fail as kombu fails them while Redis restarts, as many times as the list's one number
    says (then they go through, recorded in ``sent``)."""
    from kombu.exceptions import OperationalError

    recording = app.send_task
    left = [0]

    def send_task(*args: Any, **kwargs: Any) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return recording(*args, **kwargs)

    monkeypatch.setattr(app, "send_task", send_task)
    return left


def test_the_worker_sends_a_requests_links_once_redis_is_back(
    sent: list[dict[str, Any]], outage: list[int], clock: Clock
) -> None:
    """Redis restarting while a worker sends a request's callbacks and chain step: found by the
    chaos review, where the callback never ran and the chain failed for good with the error."""
    from carpool.redis_edge.retry import Retries

    outage[0] = 3
    lk: Links = {"callbacks": [sig("cb.task", task_id="cb")], "chain": [sig("next.task", task_id="t2")]}
    assert links.on_success(app, "req", lk, "out", Retries()) == []  # nothing failed
    assert [(c["name"], c["task_id"], c["args"]) for c in sent] == [
        ("cb.task", "cb", ("out",)),
        ("next.task", "t2", ("out",)),
    ]
    assert clock.slept == [0.1, 0.2, 0.4]
    outage[0] = 2
    links.on_failure(
        app, "req", "carpool.infer", {"errbacks": [sig("errors.task")]}, ModelError("x"), None, Retries()
    )
    assert sent[-1]["name"] == "errors.task" and sent[-1]["args"] == ("req",)


def test_links_redis_never_takes_are_logged_lost_within_one_window_per_batch(
    sent: list[dict[str, Any]], outage: list[int], clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    from carpool.redis_edge.retry import RETRY_WINDOW_S, Retries

    outage[0] = 10**6
    send = Retries()
    lk: Links = {"callbacks": [sig("cb.task", task_id="cb")], "chain": [sig("next.task", task_id="t2")]}
    for request_id in ("req", "req2"):
        # Their failures are for the caller to store, so that whoever waits on them is told, where a
        # server takes them (the results' own, say).
        failed = links.on_success(app, request_id, lk, "out", send)
        assert [(task_id, state) for task_id, state, _ in failed] == [("cb", "FAILURE"), ("t2", "FAILURE")]
        assert all("Connection refused" in str(exc) for _, _, exc in failed)
    assert sent == []
    # The first request's sends used the window; the second's got one try each.
    assert RETRY_WINDOW_S - 5 <= sum(clock.slept) <= RETRY_WINDOW_S
    assert "request req: its callbacks could not be sent, Redis unreachable" in caplog.text
    assert "request req2: the chain's next step could not be sent, Redis unreachable" in caplog.text


def test_a_finish_waits_for_redis_about_25_seconds(clock: Clock) -> None:
    """RELIABILITY.md: a worker keeps handing over computed results for about 25 s (it gave up
    after 11 s before, found by the chaos review)."""
    from redis import ConnectionError as RedisConnectionError

    from carpool.redis_edge.retry import retrying

    calls = []

    def finish() -> None:
        calls.append(clock.now)
        raise RedisConnectionError("Connection refused")

    with pytest.raises(RedisConnectionError):
        retrying(finish)
    assert 20 <= calls[-1] <= 25 and len(calls) >= 9
    assert max(clock.slept) == 5.0


def test_carpool_run_batch_as_a_callback_or_chain_step_is_failed_under_its_id_never_sent(
    sent: list[dict[str, Any]],
) -> None:
    batch = dict(app.signature("carpool.run_batch").set(task_id="forged"))
    callbacks: Links = {"callbacks": [batch, sig("other.task", task_id="ok")]}
    [(task_id, state, exc)] = links.on_success(app, "req", callbacks, "out")
    assert (task_id, state) == ("forged", "FAILURE") and isinstance(exc, InvalidInput)
    assert "only coordinators send" in str(exc)
    assert [call["name"] for call in sent] == ["other.task"], "the other callback is sent"
    sent.clear()
    chain: Links = {"chain": [sig("third.task", task_id="t3"), batch]}
    failures = links.on_success(app, "req", chain, "out")
    assert sent == [] and [(i, s) for i, s, _ in failures] == [("t3", "FAILURE"), ("forged", "FAILURE")]
    # Nested in a plain callback's or chain step's own links, with the batch queue named: the plain
    # task's worker would send it there, past the route to the coordinators.
    named = app.signature("carpool.run_batch", queue="carpool.batches")
    hiding = dict(app.signature("plain.task", queue="plain").set(task_id="hider", link=named))
    [(task_id, _, exc)] = links.on_success(app, "req", {"callbacks": [hiding]}, "out")
    assert task_id == "hider" and "only coordinators send" in str(exc) and sent == []
    failures = links.on_success(app, "req", {"chain": [hiding]}, "out")
    assert [i for i, _, _ in failures] == ["hider"] and sent == []


def test_carpool_run_batch_sent_without_a_queue_goes_to_the_coordinators_with_one_where_named() -> None:
    # Anyone's send (Celery's tracer applying a plain task's link) reaches the coordinators, which
    # refuse it under its id; a coordinator names its batch queue, which the route leaves alone.
    assert app.amqp.router.route({}, "carpool.run_batch")["queue"].name == "carpool.requests"
    assert app.amqp.router.route({"queue": "carpool.batches"}, "carpool.run_batch")["queue"].name == (
        "carpool.batches"
    )
