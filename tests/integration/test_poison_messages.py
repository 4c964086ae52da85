"""Messages the coordinator's intake cannot take, in one take with good requests, on real processes:
each is refused or dead-lettered alone, and the requests taken with them are answered."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import redis

from carpool.models.toy import ToyModel
from carpool.redis_edge.keys import Keys
from tests.integration.conftest import Processes, assert_same_vectors, server_of, start_stack, wait_for
from tests.unit.messages import message

pytestmark = pytest.mark.integration

PICKY = f"{__name__}:Picky"


class Picky(ToyModel):
    """The toy model, except that its ``encode`` raises for any text holding "poison", as a
    pure-Python tokenizer might (loaded by the coordinator and the worker through CARPOOL_MODEL)."""

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if any("poison" in t for t in texts):
            raise ValueError("cannot tokenize that text")
        return super().encode(texts)


def envelope_with(raw: bytes, **fields: object) -> bytes:
    """``raw`` with top-level envelope fields replaced, written as Python's json writes them
    (``float("inf")`` as ``Infinity``)."""
    out = json.loads(raw)
    out.update(fields)
    return json.dumps(out).encode()


def test_poison_messages_fail_alone_and_the_requests_taken_with_them_are_answered(
    processes: Processes,
) -> None:
    from carpool.errors import InvalidInput
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL=PICKY, CARPOOL_MODELS=PICKY)
    client = redis.Redis(port=server_of(processes).port)
    plain = message("inf-priority", "hello there")
    poison = [
        ("encode-raises", message("encode-raises", "a poison pill")),
        (
            "inf-priority",
            envelope_with(plain, properties={**json.loads(plain)["properties"], "priority": 1e999}),
        ),
        ("far-eta", message("far-eta", "hello there", extra_headers={"eta": 1e15})),
        ("list-properties", envelope_with(message("list-properties", "hello there"), properties=[1])),
    ]
    goods = [f"good-{i}" for i in range(3)]
    # One push, the poison first: the coordinator takes them all in one take, in this order.
    client.lpush("carpool.requests", *[raw for _, raw in poison], *[message(i, "hello there") for i in goods])

    answers = [infer.AsyncResult(request_id).get(timeout=30) for request_id in [*goods, "inf-priority"]]
    want = infer.delay("hello there").get(timeout=30)  # the same text, sent alone afterwards
    for got in answers:
        assert_same_vectors(got, want)
    with pytest.raises(InvalidInput, match="ValueError: cannot tokenize that text"):
        infer.AsyncResult("encode-raises").get(timeout=30)
    with pytest.raises(InvalidInput, match="outside the years 1 to 9999"):
        infer.AsyncResult("far-eta").get(timeout=30)
    dead = wait_for(
        "a dead letter",
        lambda: (d := client.lrange(Keys("carpool.requests").dead_letter, 0, -1)) and len(d) == 1 and d,
    )
    reasons = {entry["id"]: entry["reason"] for entry in map(json.loads, dead)}
    assert reasons.keys() == {"list-properties"}
    assert "properties are not an object" in reasons["list-properties"]
