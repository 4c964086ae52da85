"""carpool.codec: orjson where it means the same as the standard library, the standard path elsewhere."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.codec import dumps_lenient, dumps_plain, flat_plain, kombu_tags, loads, loads_tagged, long_int_in

plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=20,
)


@given(plain)
def test_plain_values_encode_to_what_json_decodes_back(value: Any) -> None:
    encoded = dumps_plain(value)
    assert encoded is not None
    assert json.loads(encoded) == value
    assert loads(encoded) == value


def test_loads_falls_back_to_json_for_what_orjson_refuses() -> None:
    lone = '["\\ud800"]'  # a lone surrogate escape: json accepts it, orjson does not
    assert loads(lone) == json.loads(lone) == ["\ud800"]
    assert loads("[NaN]")[0] != loads("[NaN]")[0]  # NaN, as json.loads reads it
    assert loads(str(2**70)) == 2**70
    with pytest.raises(ValueError):
        loads(b"{not json")


@given(plain | st.lists(st.datetimes() | st.binary(max_size=5) | st.uuids() | plain, max_size=4))
def test_loads_tagged_decodes_as_kombu_does(value: Any) -> None:
    from kombu.utils.json import dumps as kombu_dumps
    from kombu.utils.json import loads as kombu_loads

    text = kombu_dumps(value)  # type: ignore[no-untyped-call]
    assert loads_tagged(text) == kombu_loads(text) == value  # type: ignore[no-untyped-call]  # tags too
    assert loads_tagged(text.encode()) == value


def test_loads_tagged_leaves_to_kombu_what_orjson_refuses() -> None:
    assert loads_tagged('["\\ud800", 1e400]') == ["\ud800", float("inf")]
    assert loads_tagged(memoryview(b'{"a": 1}')) == {"a": 1}
    with pytest.raises(ValueError):
        loads_tagged(b"{not json")


class Colour(StrEnum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int


@pytest.mark.parametrize(
    "value",
    [
        datetime(2026, 1, 1, tzinfo=UTC),
        Point(1),
        {1: "int key"},
        {"nested": [datetime(2026, 1, 1)]},
        object(),
    ],
)
def test_dumps_plain_refuses_what_kombu_would_tag_or_json_would_write_otherwise(value: Any) -> None:
    assert dumps_plain(value) is None


def test_non_finite_floats_become_null_as_documented() -> None:
    assert dumps_plain([float("nan"), float("inf")]) == b"[null,null]"


def test_flat_plain_accepts_scalar_arguments_only() -> None:
    assert flat_plain(("a text",), {"model": "toy", "n": 1, "x": 0.5, "flag": True, "none": None})
    assert not flat_plain((uuid.uuid4(),), {})  # orjson would write a UUID kombu tags
    assert not flat_plain(("a",), {"when": datetime.now(UTC)})
    assert not flat_plain((["a", "list"],), {})
    assert not flat_plain((Colour.RED,), {})


def test_dumps_lenient_writes_the_unencodable_as_text() -> None:
    when = datetime(2026, 1, 1, tzinfo=UTC)
    assert json.loads(dumps_lenient({"at": when, 3: object.__name__})) == {
        "at": when.isoformat(),
        "3": "object",
    }


def test_result_backend_keys_and_decoding_match_celery() -> None:
    """The backend's direct key and orjson decoding give what Celery's own code gives."""
    from celery.backends.redis import RedisBackend

    from carpool.celery_edge.app import app, create_app
    from carpool.config import Settings

    backend = app.backend
    for task_id in (str(uuid.uuid4()), "plain-id", "Ünïcödé"):
        assert backend.get_key_for_task(task_id) == RedisBackend.get_key_for_task(backend, task_id)
    assert backend.get_key_for_task("x", "suffix") == RedisBackend.get_key_for_task(backend, "x", "suffix")
    with pytest.raises(ValueError):
        backend.get_key_for_task("")
    meta = backend.meta_for("t1", "SUCCESS", [0.5, -1.25, 3], datetime.now(UTC).isoformat())
    assert backend.decode(meta) == RedisBackend.decode(backend, meta)  # msgpack, the default
    backend = create_app(Settings(result_serializer="json")).backend
    meta = backend.meta_for("t1", "SUCCESS", [0.5, -1.25, 3], datetime.now(UTC).isoformat())
    assert backend.decode(meta) == RedisBackend.decode(backend, meta)
    tagged = backend.encode(
        {"status": "SUCCESS", "result": datetime(2026, 1, 1, tzinfo=UTC), "task_id": "t2"}
    )
    tagged = tagged if isinstance(tagged, bytes) else tagged.encode()
    assert b"__type__" in tagged  # kombu tags datetimes; the fast path must not decode those
    assert backend.decode(tagged)["result"] == datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("number", [2**64, 123456789012345678901234567890, -(2**63) - 1, -(10**30)])
def test_loads_reads_an_integer_past_64_bits_as_that_integer(number: int) -> None:
    """orjson reads such an integer as a float (no error): the decoding falls back to json, so that
    validation sees the integer sent and refuses it, and a link gets it unchanged."""
    text = json.dumps({"item": [1, number], "f": 0.0012345678901234567})
    for data in (text, text.encode()):
        got = loads(data)
        assert got == json.loads(text) and type(got["item"][1]) is int
    # The worker's decoder scans only a batch message naming links: its items were checked at intake.
    linked = json.dumps({"links": {"callbacks": [{"args": [1, number]}]}, "f": 0.0012345678901234567})
    for data in (linked, linked.encode()):
        assert type(loads_tagged(data)["links"]["callbacks"][0]["args"][1]) is int
    assert loads(b"[18446744073709551615, -9223372036854775808]") == [2**64 - 1, -(2**63)]  # orjson's own


def test_long_int_in_tells_an_integers_digits_from_a_fractions() -> None:
    assert long_int_in(b"[1, 12345678901234567890123]") and long_int_in("12345678901234567890123")
    assert not long_int_in(b"[0.0012345678901234567, 1.5e300, 123456789012345678]")
    assert long_int_in(b'["12345678901234567890123"]')  # a string: decoded by json, the same values


def test_kombu_tags_lists_what_kombus_json_decoding_makes_of_each_tag_shaped_dict() -> None:
    from decimal import Decimal

    inner = {"__type__": "decimal", "__value__": "1.5"}
    value: list[Any] = [
        {"__type__": "bytes", "__value__": "hi"},
        {"a": (inner,)},
        {"__type__": "datetime", "__value__": "not a date"},
        {"__type__": "no such type", "__value__": 1},
        {"__type__": "bytes", "__value__": "hi", "third": 1},  # not a tag: kombu leaves it a dict
        {"type": "bytes", "value": "hi"},
    ]
    found = kombu_tags(value)
    assert [tag for tag, _ in found] == [value[0], inner, value[2], value[3]]
    assert [decoded for _, decoded in found[:2]] == [b"hi", Decimal("1.5")]
    assert isinstance(found[2][1], ValueError) and "not a date" in str(found[2][1])
    assert isinstance(found[3][1], ValueError) and "Unsupported type" in str(found[3][1])
    assert kombu_tags({"nested": [{"k": "__type__"}]}) == []
