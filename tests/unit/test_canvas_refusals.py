"""What ``.delay()`` / ``.apply_async()`` refuses in a carpool call's canvas (chords in a chain, link
and chain steps carrying options carpool cannot honour or bound for the batch queue, arguments that
are not a tuple), and how a link that cannot be sent at the worker fails where its caller waits.
No broker: sends are recorded instead of published."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Task, chain, chord, group

from carpool.celery_edge import links
from carpool.celery_edge.app import app
from carpool.errors import InvalidInput, ModelError, UnsupportedOption
from carpool.tasks import batched, infer
from carpool.wire import Links


@batched(length=len, name="unit.canvas.shout")
def shout(texts: list[str]) -> list[dict[str, str]]:
    return [{"out": t.upper()} for t in texts]


@batched(length=len, name="unit.canvas.count")
def count(items: list[Any]) -> list[int]:
    return [len(item) for item in items]


@app.task(name="unit.canvas.plain", queue="unit.plain")  # type: ignore[untyped-decorator, unused-ignore]
def plain(value: Any) -> str:
    """A plain Celery task with a queue of its own, run by a plain Celery worker."""
    return repr(value)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every message a carpool call would publish (task name, args, options), recorded instead."""
    out: list[dict[str, Any]] = []

    def celery_apply_async(self: Task, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        out.append({"name": self.name, "args": args, "kwargs": kwargs, **options})
        return app.AsyncResult(options.get("task_id") or "sent")

    def publish_tasks(name: str, calls: list[tuple[Any, Any]], **options: Any) -> list[Any]:
        out.extend({"name": name, "args": args, "kwargs": kwargs, **options} for args, kwargs in calls)
        return [app.AsyncResult("sent") for _ in calls]

    monkeypatch.setattr(Task, "apply_async", celery_apply_async)
    monkeypatch.setattr("carpool.tasks.publish_tasks", publish_tasks)
    return out


# --- chords in a chain ---------------------------------------------------------------------------


def test_a_chord_of_carpool_tasks_inside_a_chain_is_refused_at_the_call(sent: list[dict[str, Any]]) -> None:
    # Celery's canvas turns `group | task` into a chord, carried in the first step's chain= option.
    canvas = chain(shout.s("a"), group(count.s(), count.s()), count.s())
    with pytest.raises(UnsupportedOption, match=r"chord.*unit\.canvas\.count.*gather\(\)"):
        canvas.apply_async()
    assert sent == []


def test_a_chord_nested_in_a_link_is_refused_at_the_call(sent: list[dict[str, Any]]) -> None:
    callback = chord([count.s(), count.s()], count.s())
    with pytest.raises(UnsupportedOption, match="chord"):
        shout.apply_async(("a",), link=callback)
    with pytest.raises(UnsupportedOption, match="chord"):
        shout.apply_async(("a",), link=count.s().set(link_error=count.s().set(chord=count.s())))
    assert sent == []


def test_a_chain_ending_in_a_group_or_holding_a_chord_of_plain_tasks_is_sent(
    sent: list[dict[str, Any]],
) -> None:
    chain(shout.s("a"), group(count.s(), count.s())).apply_async()
    # A chord whose header holds plain Celery tasks only is run by the plain workers' tracers, as in Celery.
    chain(shout.s("b"), group(plain.s(), plain.s()), count.s()).apply_async()
    assert [message["args"] for message in sent] == [("a",), ("b",)]


def test_a_chord_steps_failure_is_stored_under_the_ids_the_chains_result_waits_on() -> None:
    body = count.s()
    body.freeze()  # the chain's result is its last task's: here the chord's body
    captured: list[dict[str, Any]] = []

    def capture(self: Task, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        captured.extend(options["chain"])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("carpool.tasks.BatchedTask.apply_async", capture)
        chain(shout.s("a"), group(count.s(), count.s()), body).apply_async()
    [step] = captured
    assert step["task"] == "celery.chord"
    refusal = UnsupportedOption("chord")
    failed = {task_id for task_id, _, _ in links.chain_failures({"chain": [step]}, refusal)}
    assert body.id in failed
    header = {member["options"]["task_id"] for member in step["kwargs"]["header"]["kwargs"]["tasks"]}
    assert header <= failed


def test_a_group_steps_failure_is_stored_under_each_members_id() -> None:
    members = group(count.s(), count.s())
    members.freeze()
    ids = {dict(member)["options"]["task_id"] for member in members.tasks}
    step = dict(members)
    failed = {task_id for task_id, _, _ in links.chain_failures({"chain": [step]}, ModelError("boom"))}
    assert len(ids) == 2 and ids <= failed


# --- options of link, link_error and chain steps ----------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"link": count.s().set(time_limit=5)}, "unit.canvas.count: time_limit="),
        ({"link": [plain.s(), count.s().set(ignore_result=True)]}, "ignore_result="),
        ({"link_error": count.s().set(soft_time_limit=5)}, "soft_time_limit="),
        ({"link": count.s().set(link=count.s().set(serializer="pickle"))}, "plain JSON"),
    ],
)
def test_a_carpool_callback_with_an_option_carpool_refuses_is_refused_at_the_call(
    sent: list[dict[str, Any]], options: dict[str, Any], match: str
) -> None:
    with pytest.raises(UnsupportedOption, match=match):
        shout.apply_async(("a",), **options)
    with pytest.raises(UnsupportedOption, match=match):
        infer.apply_async(("a",), **options)
    assert sent == []


def test_a_carpool_chain_step_with_an_option_carpool_refuses_is_refused_at_the_call(
    sent: list[dict[str, Any]],
) -> None:
    with pytest.raises(UnsupportedOption, match="time_limit="):
        chain(shout.s("a"), count.s(), count.s().set(time_limit=3)).apply_async()
    assert sent == []


def test_a_plain_celery_callback_keeps_the_options_its_worker_honours(sent: list[dict[str, Any]]) -> None:
    shout.apply_async(("a",), link=plain.s().set(time_limit=5), link_error=plain.s().set(soft_time_limit=5))
    [message] = sent
    assert message["link"]["options"]["time_limit"] == 5


def test_a_link_to_a_task_this_process_does_not_import_is_sent_for_the_applying_process_to_route(
    sent: list[dict[str, Any]],
) -> None:
    """A producer imports no task modules (CARPOOL_IMPORTS): the worker or coordinator applying the
    link may know the task; one that cannot route it stores its failure under the link's id."""
    shout.apply_async(("a",), link=app.signature("myapp.notify"))
    infer.apply_async(("a",), link_error=[app.signature("myapp.notify")])
    shout.apply_async(("a",), link=app.signature("myapp.notify", queue="myapp"))
    assert len(sent) == 3


# --- args and kwargs of the wrong type ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: infer.apply_async("hi"), r"args must be a list or tuple.*infer\.apply_async\(\('hi',\)\)"),
        (lambda: infer.apply_async("h"), r"args must be a list or tuple.*infer\.apply_async\(\('h',\)\)"),
        (lambda: infer.apply_async(kwargs="xy"), "kwargs must be a dict"),
        (lambda: infer.apply_async(("hi",), ["model"]), "kwargs must be a dict"),
        (lambda: shout.apply_async("hi"), r"args must be a list or tuple.*shout\.apply_async\(\('hi',\)\)"),
        (lambda: shout.apply_async(None, "xy"), "kwargs must be a dict"),
    ],
)
def test_args_that_are_not_a_tuple_and_kwargs_that_are_not_a_dict_are_refused(
    sent: list[dict[str, Any]], call: Callable[[], object], match: str
) -> None:
    with pytest.raises(InvalidInput, match=match):
        call()
    assert sent == []


# --- a link that cannot be sent at the worker fails where its caller waits ---------------------------


@pytest.fixture
def stored(monkeypatch: pytest.MonkeyPatch, sent: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    """What the process applying links stores itself (error callbacks' failures)."""
    out: list[tuple[str, str, Any]] = []
    monkeypatch.setattr(app, "send_task", lambda name, *a, **kw: sent.append({"name": name, **kw}))
    monkeypatch.setattr(app.backend, "add_pending_result", lambda *args, **kwargs: None)
    monkeypatch.setattr(app.backend, "store_many", lambda entries, **kw: out.extend(entries))
    return out


def test_a_callback_refusing_the_result_fails_under_its_own_id_and_the_others_are_sent(
    sent: list[dict[str, Any]],
) -> None:
    refusing = dict(infer.s().set(task_id="cb-infer"))
    fine = dict(count.s().set(task_id="cb-count"))
    lk: Links = {"callbacks": [refusing, fine]}
    failures = links.on_success(app, "req", lk, {"not": "a text"})
    assert [(task_id, state, type(exc)) for task_id, state, exc in failures] == [
        ("cb-infer", "FAILURE", InvalidInput)
    ]
    assert [(m["name"], m["task_id"]) for m in sent] == [(count.name, "cb-count")]


def test_an_error_callback_that_cannot_be_sent_has_its_failure_stored(
    sent: list[dict[str, Any]], stored: list[tuple[str, str, Any]]
) -> None:
    # An old-style error callback is sent the failed request's id: a second argument is one too many.
    two_items = dict(shout.s("extra").set(task_id="eb-shout"))
    fine = dict(plain.s().set(task_id="eb-plain"))
    links.on_failure(app, "req", count.name, {"errbacks": [two_items, fine]}, ModelError("boom"))
    assert [(task_id, state, type(exc)) for task_id, state, exc in stored] == [
        ("eb-shout", "FAILURE", InvalidInput)
    ]
    assert [m["name"] for m in sent] == [plain.name]


@pytest.mark.parametrize("option", ["link", "link_error"])
def test_carpool_run_batch_as_a_link_or_chain_step_is_refused_at_the_call(
    sent: list[dict[str, Any]], option: str
) -> None:
    batch = app.signature("carpool.run_batch")
    with pytest.raises(UnsupportedOption, match=r"carpool\.run_batch is carpool's own batch task"):
        infer.apply_async(("a",), **{option: batch})
    with pytest.raises(UnsupportedOption, match="only coordinators send"):
        (infer.s("a") | batch).apply_async()
    # Also as a plain callback's own link, with the batch queue named (which the route would obey).
    named = app.signature("carpool.run_batch", queue="carpool.batches")
    plain = app.signature("unit.plain.task").set(**{option: named})
    with pytest.raises(UnsupportedOption, match="only coordinators send"):
        infer.apply_async(("a",), link=plain)
    assert sent == []
