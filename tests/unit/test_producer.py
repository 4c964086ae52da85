"""The producer side: light import, validation at .delay() with messages that say what to change."""

from __future__ import annotations

import pytest

from carpool.config import Settings
from carpool.errors import InputTooLong, InvalidInput, UnknownModel
from carpool.tasks import batched
from carpool.validation import bind_infer_args, validate_infer

SETTINGS = Settings(model="toy", models=("toy", "minilm"), max_input_bytes=100)


def test_valid_request() -> None:
    payload = validate_infer("hello", None, SETTINGS)
    assert payload.text == "hello" and payload.model == "toy"
    assert validate_infer("hi", "minilm", SETTINGS).model == "minilm"


@pytest.mark.parametrize(
    ("text", "model", "error", "needles"),
    [
        (42, None, InvalidInput, ["text must be a str", "int", "str(value)"]),
        (b"bytes", None, InvalidInput, ["text must be a str", "bytes"]),
        ("bad \ud800 surrogate", None, InvalidInput, ["not valid Unicode", "position 4", "surrogate"]),
        ("x" * 101, None, InputTooLong, ["101 bytes", "CARPOOL_MAX_INPUT_BYTES=100"]),
        ("é" * 51, None, InputTooLong, ["102 bytes"]),
        ("ok", "gpt-9", UnknownModel, ["unknown model 'gpt-9'", "toy, minilm", "CARPOOL_MODELS"]),
        ("ok", 3, InvalidInput, ["model must be a str"]),
    ],
)
def test_bad_input_is_named(text: object, model: object, error: type[Exception], needles: list[str]) -> None:
    with pytest.raises(error) as err:
        validate_infer(text, model, SETTINGS)
    for needle in needles:
        assert needle in str(err.value)


def test_argument_binding() -> None:
    assert bind_infer_args(["t"], {}) == ("t", None)
    assert bind_infer_args([], {"text": "t", "model": "m"}) == ("t", "m")
    assert bind_infer_args(["t", "m"], None) == ("t", "m")
    with pytest.raises(InvalidInput, match="needs a text"):
        bind_infer_args([], {})
    with pytest.raises(InvalidInput, match=r"takes \(text, model=None\)"):
        bind_infer_args(["a", "b", "c"], {})
    with pytest.raises(InvalidInput, match=r"takes \(text, model=None\)"):
        bind_infer_args([], {"txt": "a"})


def test_delay_rejects_bad_input_before_anything_is_sent() -> None:
    # No broker runs for unit tests: reaching the broker would raise a connection error instead.
    from carpool.tasks import infer

    with pytest.raises(InvalidInput, match="text must be a str"):
        infer.delay(["not", "a", "string"])
    with pytest.raises(UnknownModel):
        infer.delay("fine text", model="nope")


@batched(length=len, name="unit.producer.echo")
def echo(items: list[str]) -> list[str]:
    if "boom" in items:
        raise ValueError("boom is not a word I take")
    return [item.upper() for item in items]


def test_submit_many_in_eager_mode_runs_each_request_as_delay_would() -> None:
    """task_always_eager: nothing is sent (no broker runs for unit tests); every payload is checked
    first, then each runs here as its .delay() runs, an EagerResult each, in order."""
    from celery.result import EagerResult

    from carpool.celery_edge.app import app
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from carpool.tasks import infer

    app.conf.task_always_eager = True
    try:
        vectors = submit_many(["one", {"text": "two"}], model="toy", priority=3, expires=60)
        assert all(isinstance(r, EagerResult) for r in vectors)
        assert gather(vectors) == [infer.delay("one", model="toy").get(), infer.delay("two", "toy").get()]
        items = submit_many(["a", "b", "boom"], task=echo)
        assert [r.state for r in items] == ["SUCCESS", "SUCCESS", "FAILURE"]
        assert gather(items, return_exceptions=True)[:2] == [echo.delay("a").get(), "B"]
        with pytest.raises(InvalidInput, match=r"payloads\[1\]; nothing was sent"):
            submit_many(["fine", 42], model="toy")  # checked before any runs, as when sent
        app.conf.task_eager_propagates = True  # a failure raises from the call, as from .delay()
        with pytest.raises(ValueError, match="boom") as raised:
            submit_many(["a", "boom", "c"], task=echo)
        assert r"payloads[1]; payloads[:1] ran" in "".join(raised.value.__notes__)
    finally:
        app.conf.task_always_eager = False
        app.conf.task_eager_propagates = False


_CURRENT_APP_PROBE = """
import celery
from celery.result import AsyncResult
{user}
import carpool.tasks
from carpool.celery_edge.app import app as carpool_app
print(celery.current_app.main, AsyncResult("x").app.main, carpool.tasks.infer.app is carpool_app)
"""


@pytest.mark.parametrize(
    ("user", "current"),
    [
        ("user = celery.Celery('userapp')", "userapp"),  # the application's own app stays current
        ("", "carpool"),  # a process with no app of its own gets carpool's, as Celery's first app
    ],
)
def test_importing_carpool_leaves_an_applications_own_celery_app_current(user: str, current: str) -> None:
    """Found by the producer review: importing carpool made its app Celery's current one, so an
    application's @shared_task .delay() went to carpool's broker and failed NotRegistered there."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _CURRENT_APP_PROBE.format(user=user)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [current, current, "True"]


def test_a_route_the_application_puts_ahead_of_carpools_sends_a_carpool_task_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the producer review: .delay() and submit_many sent to the request queue whatever
    the app's task_routes said, so a second pool of coordinators never got its requests."""
    from carpool.celery_app import app
    from carpool.celery_edge.app import state_of

    state = state_of(app)
    assert state.request_queue("carpool.infer", ("hi",), {}) == "carpool.requests"
    routes = ({"carpool.infer": {"queue": "pool-b.requests"}}, *app.conf.task_routes)
    monkeypatch.setitem(app.conf, "task_routes", routes)
    monkeypatch.setattr(app.amqp, "_rtable", None, raising=False)
    monkeypatch.setattr(app.amqp, "router", app.amqp.Router(), raising=False)
    assert state.request_queue("carpool.infer", ("hi",), {}) == "pool-b.requests"
    assert state.request_queue("unit.other", ("hi",), {}) == "carpool.requests"  # carpool's router: no match
