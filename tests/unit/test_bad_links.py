"""A request's callback or error callback that Celery cannot read as a signature fails alone: the
other links of that request, and every other request's links, are still applied, by the worker
(:func:`carpool.gpu_worker.finish.apply_links`) and by the coordinator (its refusals,
:func:`carpool.coordinator.answers.fail`)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from carpool.celery_edge import links
from carpool.celery_edge.app import app
from carpool.celery_edge.results import FAILURE, SUCCESS
from carpool.errors import InvalidInput, ModelError
from carpool.gpu_worker.finish import apply_links
from carpool.wire import Links
from tests.unit import test_links
from tests.unit.messages import message
from tests.unit.test_coordinator_loop import Clocks, coordinator

HANG_S = 10.0  # a bound that only a hang reaches

sent = test_links.sent  # the fixture: every task message the app would send, none reaching a broker

# A signature dict Celery cannot rebuild: maybe_signature raises KeyError('bogus').
BOGUS = {
    "task": "other.task",
    "subtask_type": "bogus",
    "args": [],
    "kwargs": {},
    "options": {"task_id": "bad"},
}


@pytest.fixture
def stored(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """What the links store through the app's backend (failures of links not sent)."""
    out: list[tuple[str, str, Any]] = []

    def store_many(_backend: Any, entries: list[tuple[str, str, Any]], **_: Any) -> list[str]:
        out.extend(entries)
        return [task_id for task_id, _, _ in entries]

    # On the backend's class: each thread has a backend of its own (a coordinator's link thread).
    monkeypatch.setattr(type(app.backend), "store_many", store_many)
    return out


def sig(name: str, task_id: str) -> dict[str, Any]:
    return dict(app.signature(name, options={"queue": "plain"}).set(task_id=task_id))


def test_an_unreadable_callback_fails_alone_and_the_others_are_sent(sent: list[dict[str, Any]]) -> None:
    lk: Links = {"callbacks": [BOGUS, sig("good.task", "cb-1")]}
    [(task_id, state, exc)] = links.on_success(app, "req", lk, 7)
    assert (task_id, state) == ("bad", FAILURE)
    assert isinstance(exc, InvalidInput) and "could not be read as a signature: KeyError: 'bogus'" in str(exc)
    assert [(c["name"], c["task_id"], c["args"]) for c in sent] == [("good.task", "cb-1", (7,))]


def test_an_unreadable_error_callback_fails_alone_and_the_others_are_called(
    sent: list[dict[str, Any]], stored: list[tuple[str, str, Any]]
) -> None:
    lk: Links = {"errbacks": [BOGUS, sig("errors.task", "eb-1")]}
    links.on_failure(app, "req", "carpool.infer", lk, ModelError("boom"))
    assert [(c["name"], c["args"]) for c in sent] == [("errors.task", ("req",))]
    [(task_id, state, exc)] = stored
    assert (task_id, state) == ("bad", FAILURE) and "KeyError: 'bogus'" in str(exc)


def test_a_member_of_a_group_callback_that_cannot_be_read_fails_the_group_alone(
    sent: list[dict[str, Any]],
) -> None:
    grouped = dict(app.signature("celery.group", kwargs={"tasks": [BOGUS]}, subtask_type="group"))
    lk: Links = {"callbacks": [grouped, sig("good.task", "cb-1")]}
    failed = links.on_success(app, "req", lk, 7)
    assert [(task_id, state) for task_id, state, _ in failed] == [("bad", FAILURE)]
    assert [c["name"] for c in sent] == ["good.task"]


def test_the_worker_applies_every_requests_links_whatever_one_requests_raise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    applied: list[str] = []

    def on_success(app_: Any, request_id: str, lk: Links, result: Any, send: Any = None) -> list[Any]:
        if request_id == "r1":
            raise KeyError("a defect in one request's links")
        applied.append(request_id)
        return []

    monkeypatch.setattr(links, "on_success", on_success)
    monkeypatch.setattr(links, "on_failure", lambda app_, rid, *_: applied.append(rid))
    entries = [("r1", SUCCESS, 1), ("r2", SUCCESS, 2), ("r3", FAILURE, ModelError("boom"))]
    linked: dict[str, Links] = {rid: {"callbacks": [sig("t", "c")]} for rid in ("r1", "r2", "r3")}
    apply_links(app, app.backend, "carpool.infer", entries, [1, 2, 3], linked)  # does not raise
    assert applied == ["r2", "r3"]
    assert "request r1: applying its callbacks or error callbacks failed" in caplog.text


def test_the_coordinators_refusals_call_every_requests_error_callbacks(
    sent: list[dict[str, Any]], stored: list[tuple[str, str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests refused at intake (a text that is not a str), each with error callbacks: one of them
    unreadable, and one request whose links raise (a defect): the others' are still called."""
    clocks = Clocks()
    c = coordinator(clocks, workers=1)
    real_on_failure = links.on_failure

    def on_failure(app_: Any, request_id: str, *args: Any, **kwargs: Any) -> None:
        if request_id == "defect":
            raise RuntimeError("a defect in one request's links")
        real_on_failure(app_, request_id, *args, **kwargs)

    monkeypatch.setattr(links, "on_failure", on_failure)
    embeds = {
        "defect": [sig("errors.task", "eb-0")],
        "bogus": [BOGUS],
        "fine": [sig("errors.task", "eb-2")],
    }
    for request_id, errbacks in embeds.items():
        embed = {"callbacks": None, "errbacks": errbacks, "chain": None, "chord": None}
        c.store.queue.append((request_id, message(request_id, None, embed=embed)))
    c.step()  # does not raise
    assert c.link_sender.flush(HANG_S), "the error callbacks are called on the coordinator's link thread"
    assert {task_id for task_id, _, _ in c.backend.stored} == {"defect", "bogus", "fine"}
    assert [(s["name"], s["args"]) for s in sent] == [("errors.task", ("fine",))]
    # Filed in the links outbox with the refusals (a coordinator dying before it calls them leaves
    # them to another), and emptied once they were called.
    assert sorted(request_id for request_id, _ in c.store.filed) == ["bogus", "defect", "fine"]
    assert sorted(c.store.emptied) == ["bogus", "defect", "fine"]
    assert [(task_id, state) for task_id, state, _ in stored] == [("bad", FAILURE)]


def test_a_refusals_error_callbacks_kept_from_redis_stay_in_the_outbox_and_held_ones_are_renewed(
    sent: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error callback that Redis, unreachable, keeps from being sent stays in the links outbox
    (sent again a lease later, not emptied as sent); while one is queued or being sent on the link
    thread, each renewal of held leases renews its outbox entry too, so no other coordinator takes it."""
    import redis

    from carpool.celery_edge import compat

    clocks = Clocks()
    c = coordinator(clocks, workers=1)
    release = threading.Event()
    real_call = compat.call_errbacks

    def call_errbacks(backend: Any, request: Any, *args: Any) -> None:
        if request.id == "away":
            raise redis.ConnectionError("Connection refused")
        if request.id == "slow":
            assert release.wait(HANG_S)
        real_call(backend, request, *args)

    monkeypatch.setattr(compat, "call_errbacks", call_errbacks)
    for request_id in ("away", "slow"):
        embed = {
            "callbacks": None,
            "errbacks": [sig("errors.task", f"eb-{request_id}")],
            "chain": None,
            "chord": None,
        }
        c.store.queue.append((request_id, message(request_id, None, embed=embed)))
    c.step()
    assert sorted(request_id for request_id, _ in c.store.filed) == ["away", "slow"]
    c._next_renewal = 0.0
    c.housekeeping(clocks.mono())  # "slow" is being sent: its entry is renewed with the leases
    assert "slow" in c.store.links_renewed[-1]
    release.set()
    assert c.link_sender.flush(HANG_S)
    assert c.store.emptied == ["slow"], "the one Redis kept from being sent stays in the outbox"
    assert [(s["name"], s["args"]) for s in sent] == [("errors.task", ("slow",))]
    assert c.link_sender.held() == []


def test_a_chain_step_whose_members_are_not_a_list_fails_with_the_ids_it_holds() -> None:
    """Storing a failed request's failure under its chain's steps reads every step's ids: a group
    whose ``tasks`` is no list holds none besides its own (it raised, failing the whole answer)."""
    odd = {"task": "celery.group", "kwargs": {"tasks": 5}, "options": {"task_id": "g"}}
    steps = {"task": "celery.chain", "kwargs": {"tasks": [sig("a.task", "a")]}, "options": {}}
    error = ModelError("boom")
    assert links.chain_failures({"chain": [odd, steps]}, error) == [
        ("g", FAILURE, error),
        ("a", FAILURE, error),
    ]
