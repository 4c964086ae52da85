"""A message that decoding, accepting or preparing cannot take fails alone (dead-lettered or refused):
the requests taken with it are admitted, and the coordinator's step goes on."""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from carpool.celery_edge import requests as protocol
from carpool.config import Settings
from carpool.coordinator.intake import take_in
from carpool.errors import InvalidInput
from carpool.models.task import InferSpec
from tests.unit.messages import message
from tests.unit.test_coordinator_loop import Clocks, FakeStore, HeardRevokes, coordinator
from tests.unit.test_intake import NOW, WALL, Words, run, settings

INBOX = {"carpool_inbox": "celery-task-meta-carpool.inbox.poison"}


class Picky(Words):
    """Words, except that its ``encode`` raises for any text holding "poison", as a tokenizer might."""

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if any("poison" in t for t in texts):
            raise ValueError("cannot tokenize that text")
        return super().encode(texts)


def rewritten(raw: bytes, **envelope: Any) -> bytes:
    """``raw`` with top-level envelope fields replaced (``properties``, ``content-encoding``...)."""
    out = json.loads(raw)
    out.update({key.replace("_", "-"): value for key, value in envelope.items()})
    return json.dumps(out).encode()  # Python's json writes float("inf") as Infinity


def with_body(raw: bytes, args: Any, kwargs: Any) -> bytes:
    """``raw`` carrying ``args`` and ``kwargs`` as they are, whatever their type."""
    out = json.loads(raw)
    body = json.loads(base64.b64decode(out["body"]))
    out["body"] = base64.b64encode(json.dumps([args, kwargs, body[2]]).encode()).decode()
    return json.dumps(out).encode()


def admitted_ids(out: Any) -> list[str]:
    return [req.id for _, req in out.admitted]


# --- take_in ---------------------------------------------------------------------------------------
def test_a_text_whose_encode_raises_is_refused_alone_and_the_rest_of_its_group_admitted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    taken = [
        (i, message(i, text)) for i, text in (("a", "one two"), ("bad", "a poison pill"), ("b", "three"))
    ]
    with caplog.at_level(logging.WARNING, logger="carpool.coordinator.intake"):
        out, models = run(taken, models={"toy": Picky()})
    assert admitted_ids(out) == ["a", "b"] and not out.malformed
    [refused] = out.refused
    assert refused.id == "bad" and refused.reason == "invalid"
    assert isinstance(refused.error, InvalidInput)
    assert "ValueError: cannot tokenize that text" in str(refused.error) and "toy" in str(refused.error)
    assert models["toy"].encoded == [["one two"], ["three"]], "after the group failed, one text per call"
    assert any(r.exc_info for r in caplog.records), "the group's failure is logged with its traceback"


def test_a_prepare_that_answers_for_too_few_values_prepares_each_alone() -> None:
    class Short(Words):
        def encode(self, texts: Sequence[str]) -> list[list[int]]:
            return super().encode(texts)[:1]

    out, _ = run([("a", message("a", "one")), ("b", message("b", "two words"))], models={"toy": Short()})
    assert admitted_ids(out) == ["a", "b"] and not out.refused
    assert [req.length for _, req in out.admitted] == [1, 2]


@pytest.mark.parametrize("priority", [float("inf"), float("-inf")])
def test_an_infinite_priority_counts_as_none_given(priority: float) -> None:
    raw = message("a", "hi")
    inf = rewritten(raw, properties={**json.loads(raw)["properties"], "priority": priority})
    out, _ = run([("a", inf), ("b", message("b", "hi"))])
    assert admitted_ids(out) == ["a", "b"]
    assert out.admitted[0][1].priority == out.admitted[1][1].priority


def compressed(raw: bytes) -> bytes:
    """``raw`` as Celery sends it with ``task_compression="zlib"``."""
    import zlib

    out = json.loads(raw)
    out["headers"]["compression"] = "application/x-gzip"
    out["body"] = base64.b64encode(zlib.compress(base64.b64decode(out["body"]))).decode()
    return json.dumps(out).encode()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (rewritten(message("a", "hi"), properties=[1]), "its properties are not an object"),
        (compressed(message("a", "hi")), r"compressed \(application/x-gzip\).*task_compression"),
        (
            rewritten(message("a", "hi"), content_type="application/x-python-serialize"),
            r"content type 'application/x-python-serialize' refused.*task_serializer='json'",
        ),
        (rewritten(message("a", "hi"), body="!!"), "message body does not decode"),
        # Past orjson's depth Python's decoder raises RecursionError, which dead-lettered it unanswered.
        (
            rewritten(
                message("a", "hi"),
                body=base64.b64encode(b"[[" + b"[" * 2000 + b"]" * 2000 + b"], {}, {}]").decode(),
            ),
            r"message body does not decode: nested too deep \(carpool reads up to 254 levels\)",
        ),
    ],
)
def test_a_message_naming_its_id_whose_body_cannot_be_read_is_answered_under_that_id(
    raw: bytes, why: str
) -> None:
    # Dead-lettered, its caller would wait for ever: the id says where the answer goes.
    out, _ = run([("a", raw), ("b", message("b", "hi"))])
    [refused] = out.refused
    assert refused.id == "a" and refused.reason == "invalid" and out.malformed == []
    assert isinstance(refused.error, InvalidInput) and re.search(why, str(refused.error))
    assert admitted_ids(out) == ["b"]


def _protocol_1(task_id: str, text: str) -> bytes:
    """A request as a Celery app with ``task_protocol=1`` sends it (Celery's own v1 renderer)."""
    import base64
    import json

    from celery import Celery

    v1 = Celery("protocol-1", set_as_current=False).amqp.as_task_v1(task_id, "carpool.infer", (text,), {})
    envelope = {
        "body": base64.b64encode(json.dumps(v1.body).encode()).decode(),
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": v1.headers,
        "properties": {**v1.properties, "body_encoding": "base64"},
    }
    return json.dumps(envelope).encode()


def test_a_message_without_an_id_header_is_answered_under_its_correlation_id() -> None:
    """The take finds such a request under its correlation id (its caller's): it was dead-lettered
    there, its caller waiting for ever (found by a review of the take's protocol-1 fallback)."""
    import json

    envelope = json.loads(message("a", "hi"))
    del envelope["headers"]["id"]
    envelope["properties"]["correlation_id"] = "a"
    out, _ = run([("a", json.dumps(envelope).encode()), ("b", message("b", "hi"))])
    [refused] = out.refused
    assert refused.id == "a" and out.malformed == [] and "no task id header" in str(refused.error)
    assert admitted_ids(out) == ["b"]


def test_a_protocol_1_message_is_answered_under_its_id_saying_to_send_protocol_2() -> None:
    """Found by the docs review: dead-lettered as "not a Celery task message", its caller waited for ever."""
    out, _ = run([("a", _protocol_1("a", "hi")), ("b", message("b", "hi"))])
    [refused] = out.refused
    assert refused.id == "a" and refused.reason == "invalid" and out.malformed == []
    assert "task_protocol=2" in str(refused.error) and "protocol 1" in str(refused.error)
    assert admitted_ids(out) == ["b"]


_CHORD_BODY: dict[str, Any] = {
    "task": "plain.tsum",
    "args": [],
    "kwargs": {},
    "options": {"task_id": "chord-body"},
    "subtask_type": None,
    "immutable": False,
}


@pytest.mark.parametrize(
    ("headers", "embed", "option"),
    [
        ({"timelimit": [2, None]}, None, "time_limit="),
        ({"timelimit": [None, 1]}, None, "soft_time_limit="),
        ({"ignore_result": True}, None, "ignore_result="),
        ({}, {"callbacks": None, "errbacks": None, "chain": None, "chord": _CHORD_BODY}, "chord="),
    ],
)
def test_an_option_another_app_sent_unchecked_is_refused_as_carpools_own_call_refuses_it(
    headers: dict[str, Any], embed: dict[str, Any] | None, option: str
) -> None:
    """A plain Celery client's send_task skips carpool's check at the call: a time limit ran past
    unenforced, an ignored result was stored, and a chord with a carpool task in its header never
    ran its body, its caller waiting for ever (found by the review of foreign messages)."""
    raw = message("a", "hi", extra_headers=headers, embed=embed)
    # None or 0 is no limit (0 too, to Celery's worker): the call accepts time_limit=0, and so does intake.
    out, _ = run([("a", raw), ("b", message("b", "hi", extra_headers={"timelimit": [0, None]}))])
    [refused] = out.refused
    assert refused.id == "a" and out.malformed == [] and admitted_ids(out) == ["b"]
    assert f"{option} is not supported by carpool tasks" in str(refused.error)
    if option == "chord=":  # the body's caller is answered with the refusal, as a failed chain step's
        assert refused.links is not None and refused.links["chain"] == [_CHORD_BODY]


def test_a_base64_body_in_wrapped_lines_is_read_as_kombu_reads_it() -> None:
    """Ruby's Base64.encode64 or Perl's MIME::Base64 wrap their lines; kombu and Celery read them."""
    envelope = json.loads(message("a", "hi there"))
    body = envelope["body"]
    envelope["body"] = "\n".join(body[i : i + 8] for i in range(0, len(body), 8)) + "\n"
    out, _ = run([("a", json.dumps(envelope).encode())])
    assert admitted_ids(out) == ["a"] and out.refused == [] and out.malformed == []


@pytest.mark.parametrize(
    ("args", "kwargs", "named"), [(["hi"], [1], "kwargs"), (["hi"], "model", "kwargs"), (5, {}, "args")]
)
def test_args_or_kwargs_celery_could_not_call_with_are_refused_naming_the_protocol(
    args: Any, kwargs: Any, named: str
) -> None:
    out, _ = run([("a", with_body(message("a", "hi"), args, kwargs)), ("b", message("b", "hi"))])
    [refused] = out.refused
    assert refused.id == "a" and refused.reason == "invalid"
    assert isinstance(refused.error, InvalidInput)
    assert f"{named} " in str(refused.error), "names what is wrong"
    assert admitted_ids(out) == ["b"]


@pytest.mark.parametrize("header", ["eta", "expires"])
@pytest.mark.parametrize("when", [1e15, -1e15, "9999-12-31T23:00:00-05:00", "0001-01-01T00:30:00+01:00"])
def test_an_eta_or_expires_no_datetime_holds_is_refused_saying_so(header: str, when: Any) -> None:
    """Its id and task are readable: its caller is answered, not left waiting on a dead letter."""
    raw = message("far", "hi", extra_headers={header: when, "carpool_inbox": "box:1"})
    out, _ = run([("far", raw), ("b", message("b", "hi"))])
    assert out.malformed == []
    [bad] = out.refused
    assert bad.id == "far" and bad.reason == "invalid" and isinstance(bad.error, InvalidInput)
    assert str(bad.error).startswith(f"{header} {when!r} lies outside the years 1 to 9999")
    assert bad.task_and_links() == ("carpool.infer", None) and bad.inbox_of() == "box:1"
    assert admitted_ids(out) == ["b"]


def test_an_eta_on_the_last_day_a_datetime_holds_is_kept() -> None:
    out, _ = run([("a", message("a", "hi", eta="9999-12-31T23:59:59+00:00"))])
    [(msg, _)] = out.admitted
    assert msg.eta_at is not None and msg.eta_at > WALL


def test_a_sent_at_integer_too_large_for_a_float_counts_as_absent() -> None:
    raw = message("a", "hi", extra_headers={"carpool_sent_at": 10**400})
    out, _ = run([("a", raw)])
    [(_, req)] = out.admitted
    assert req.arrival_s == NOW and req.payload["sent_at"] == WALL


def test_a_message_whose_decoding_raises_unexpectedly_is_dead_lettered_with_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    decode = protocol.decode

    def flawed(raw: bytes, tasks: Any) -> protocol.Incoming:
        if b'"poison"' in raw:  # its task id: the body is base64
            raise RuntimeError("a defect in decoding")
        return decode(raw, tasks)

    monkeypatch.setattr(protocol, "decode", flawed)
    with caplog.at_level(logging.ERROR, logger="carpool.coordinator.intake"):
        out, _ = run([("poison", message("poison", "hi")), ("b", message("b", "hi"))])
    [bad] = out.malformed
    assert bad.id == "poison" and bad.reason == "decoding raised RuntimeError: a defect in decoding"
    assert admitted_ids(out) == ["b"]
    assert [r.exc_info is not None for r in caplog.records] == [True]


def test_an_accept_raising_something_else_than_invalid_input_refuses_that_request_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    @dataclass(frozen=True, slots=True)
    class Touchy(InferSpec):
        def accept(self, args: Any, kwargs: Any, settings: Settings) -> tuple[str, Any]:
            if args == ["poison"]:
                raise KeyError("a defect in accepting")
            return InferSpec.accept(self, args, kwargs, settings)

    models = {"toy": Words()}
    specs = {"carpool.infer": Touchy("carpool.infer", model_of=models.__getitem__)}
    taken = [("bad", message("bad", "poison")), ("b", message("b", "hi"))]
    with caplog.at_level(logging.ERROR, logger="carpool.coordinator.intake"):
        out = take_in(taken, settings=settings(), specs=specs, room=10, now=NOW, wall_now=WALL)
    [refused] = out.refused
    assert refused.id == "bad" and "KeyError: 'a defect in accepting'" in str(refused.error)
    assert admitted_ids(out) == ["b"]
    assert [r.exc_info is not None for r in caplog.records] == [True]


# --- the coordinator's step ------------------------------------------------------------------------
class DeadLetters(FakeStore):
    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.dead: list[tuple[str, str]] = []

    def dead_letter(self, request_id: str, raw: bytes, reason: str) -> None:
        self.dead.append((request_id, reason))


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


def test_an_eta_no_datetime_holds_stops_neither_the_step_nor_the_requests_taken_after_it(
    clocks: Clocks,
) -> None:
    c = coordinator(clocks, workers=0)
    c.store = DeadLetters(0)
    c.store.queue += [("far", message("far", "hi", extra_headers={"eta": 1e15})), ("b", message("b", "hi"))]
    c.step()
    assert c.store.dead == [], "answered, not dead-lettered"
    [(request_id, state, error)] = c.backend.stored
    assert (request_id, state) == ("far", "FAILURE") and "outside the years 1 to 9999" in str(error)
    assert len(c.policy) == 1 and c.held == {"b"}


def test_a_request_revoked_before_admission_is_answered_through_its_result_inbox(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=0)
    c.revokes = HeardRevokes()
    c.revokes.heard.append("gone")
    c.store.queue += [
        ("gone", message("gone", "hi", extra_headers=INBOX)),
        ("kept", message("kept", "hi", extra_headers=INBOX)),
    ]
    c.step()
    assert [(i, state) for i, state, _ in c.backend.stored] == [("gone", "REVOKED")]
    assert c.backend.inboxes == {"gone": INBOX["carpool_inbox"]}
    assert len(c.policy) == 1


def test_a_revoked_message_naming_no_inbox_or_none_decodable_is_answered_without_one(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=0)
    c.revokes = HeardRevokes()
    c.revokes.heard += ["plain", "garbage"]
    c.store.queue += [("plain", message("plain", "hi")), ("garbage", b"not even a message")]
    c.step()
    assert sorted(i for i, _, _ in c.backend.stored) == ["garbage", "plain"]
    assert c.backend.inboxes == {}


def _linked(request_id: str, arg: Any, key: str = "callbacks") -> bytes:
    signature: dict[str, Any] = {
        "task": "tests.plain.describe",
        "args": [arg],
        "kwargs": {},
        "options": {},
        "subtask_type": None,
    }
    embed: dict[str, Any] = {
        "callbacks": None,
        "errbacks": None,
        "chain": None,
        "chord": None,
        key: [signature],
    }
    return message(request_id, "hello", embed=embed)


def _body_rewritten(raw: bytes, old: bytes, new: bytes) -> bytes:
    """``raw`` with ``old`` replaced by ``new`` in the text of its body."""
    out = json.loads(raw)
    body = base64.b64decode(out["body"])
    assert old in body
    out["body"] = base64.b64encode(body.replace(old, new)).decode()
    return json.dumps(out).encode()


def test_a_link_holding_a_type_tag_that_does_not_decode_is_refused_alone() -> None:
    """The worker decodes a batch with Celery's JSON (kombu's type tags): a tag that does not decode in
    one request's link would fail the whole batch, every request in it recovered and batched with the
    poison again until its deadline. It is refused at intake instead, naming the tag, and the
    requests taken with it are admitted; a tag that decodes rides on, as a Celery worker takes it."""
    uuid_tag = {"__type__": "uuid", "__value__": {"hex": "12345678123456781234567812345678"}}
    # The same key written with an escape, as JSON allows: "__type__" once decoded.
    escaped = _body_rewritten(
        _linked("escaped", {"__type__": "datetime", "__value__": "soon"}, key="errbacks"),
        b'"__type__"',
        b'"__typ\\u0065__"',
    )
    taken = [
        ("a", message("a", "hello")),
        ("bad-date", _linked("bad-date", {"__type__": "datetime", "__value__": "not a date"})),
        ("bad-type", _linked("bad-type", [{"__type__": "nope", "__value__": 1}], key="chain")),
        ("escaped", escaped),
        ("good-tag", _linked("good-tag", uuid_tag)),
        ("b", message("b", "hello")),
    ]
    out, _ = run(taken)
    assert admitted_ids(out) == ["a", "good-tag", "b"] and not out.malformed
    [(_, good)] = [(m, r) for m, r in out.admitted if r.id == "good-tag"]
    assert good.payload["links"]["callbacks"][0]["args"] == [uuid_tag]  # the worker decodes it to a UUID
    errors = {r.id: r for r in out.refused}
    assert errors.keys() == {"bad-date", "bad-type", "escaped"}
    assert all(isinstance(r.error, InvalidInput) for r in errors.values())
    assert "the message's callbacks hold {'__type__': 'datetime', '__value__': 'not a date'}" in str(
        errors["bad-date"].error
    )
    assert "Invalid isoformat string" in str(errors["bad-date"].error)
    assert "a Celery worker could not decode this message either" in str(errors["bad-date"].error)
    assert "the message's chain hold" in str(errors["bad-type"].error)
    assert "it knows no type 'nope'" in str(errors["bad-type"].error)
    assert "the message's errbacks hold" in str(errors["escaped"].error)
    # Refused with its links: its error callbacks hear of it, as for any refused request.
    assert errors["bad-date"].task_and_links()[1] is not None


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("eta", "tomorrow 9am"),
        ("eta", {"in": 3600}),
        ("expires", "in five seconds"),
        ("expires", [2026, 5, 1]),
    ],
)
def test_an_eta_or_expires_that_is_no_time_is_refused_naming_the_format_expected(
    header: str, value: Any
) -> None:
    """Dropping it ran the request at once (an eta) or never let it expire; a Celery worker rejects
    such a message too (InvalidTaskError), but unanswered: here its caller learns why."""
    out, _ = run([("bad", message("bad", "hi", extra_headers={header: value})), ("ok", message("ok", "hi"))])
    assert admitted_ids(out) == ["ok"]
    [refused] = out.refused
    assert refused.id == "bad" and isinstance(refused.error, InvalidInput)
    text = str(refused.error)
    assert text.startswith(f"{header} {value!r} is not a time: send an ISO 8601 datetime such as")
    assert "Celery 5.6 worker rejects such a message too (InvalidTaskError" in text
    assert text.endswith("; nothing was run")


@pytest.mark.parametrize("value", ["", {}, "2026-05-01", "2026-05", "20260501T0900Z"])
def test_what_celery_reads_as_no_time_or_as_iso_8601_is_taken(value: Any) -> None:
    """Celery 5.6 reads ``""`` and ``{}`` as no eta, and ISO 8601 as dateutil's isoparse does (which
    takes ``"2026-05"``, as Python's fromisoformat does not)."""
    out, _ = run([("a", message("a", "hi", extra_headers={"eta": value, "expires": value}))])
    [(msg, _)] = out.admitted
    assert (msg.eta_at is None) == (not value)


def test_an_integer_past_64_bits_in_a_link_reaches_the_slot_as_that_integer() -> None:
    """orjson would read it as a float: the callback would get 1.2345678901234568e+29."""
    big = 123456789012345678901234567890
    out, _ = run([("a", _linked("a", big))])
    [(_, req)] = out.admitted
    [arg] = req.payload["links"]["callbacks"][0]["args"]
    assert arg == big and type(arg) is int


def with_embed(raw: bytes, **embed: Any) -> bytes:
    """``raw`` with its body's embed (callbacks, errbacks, chain) given these values as they are."""
    out = json.loads(raw)
    args, kwargs, was = json.loads(base64.b64decode(out["body"]))
    out["body"] = base64.b64encode(json.dumps([args, kwargs, {**was, **embed}]).encode()).decode()
    return json.dumps(out).encode()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("callbacks", "carpool.infer"),
        ("errbacks", [1, 2]),
        ("chain", {"task": "x"}),
        ("callbacks", [{}, "y"]),
    ],
)
def test_links_that_are_no_list_of_signatures_are_refused_under_the_requests_id(key: str, value: Any) -> None:
    out, _ = run([("a", with_embed(message("a", "hi"), **{key: value})), ("b", message("b", "hi"))])
    [refused] = out.refused
    assert refused.id == "a" and refused.reason == "invalid" and isinstance(refused.error, InvalidInput)
    said = str(refused.error)
    assert f"the message's {key} is " in said and "not a list of signatures" in said
    assert admitted_ids(out) == ["b"] and not out.malformed


def test_carpool_run_batch_sent_to_the_request_queue_is_refused_under_its_id_saying_why() -> None:
    forged = rewritten(message("a", "hi"))
    out_json = json.loads(forged)
    out_json["headers"]["task"] = "carpool.run_batch"
    out, _ = run([("a", json.dumps(out_json).encode()), ("b", message("b", "hi"))])
    [refused] = out.refused
    assert refused.id == "a" and isinstance(refused.error, InvalidInput)
    assert "carpool.run_batch is carpool's own batch task, which only coordinators send" in str(refused.error)
    assert admitted_ids(out) == ["b"]
