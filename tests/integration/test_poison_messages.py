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
    # It names its id: answered under it, not dead-lettered.
    with pytest.raises(InvalidInput, match="its properties are not an object"):
        infer.AsyncResult("list-properties").get(timeout=30)
    assert client.llen(Keys("carpool.requests").dead_letter) == 0


def test_a_request_sent_with_celerys_protocol_1_is_answered_under_its_id_through_a_real_take(
    processes: Processes,
) -> None:
    """A protocol-1 envelope has no id header: the take named it garbage and intake dead-lettered
    it, its caller waiting for ever (found by the review of the fix that answered it in a unit
    test that skipped the take). Real messages from an app with task_protocol=1, one with a priority."""
    from celery import Celery

    from carpool.errors import InvalidInput
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy")
    url = processes.broker_url
    old = Celery("protocol-1", broker=url, backend=processes.result_backend, set_as_current=False)
    old.conf.task_protocol = 1
    sent = [
        old.send_task("carpool.infer", args=("hello there",), queue="carpool.requests"),
        old.send_task("carpool.infer", args=("hello there",), queue="carpool.requests", priority=9),
    ]
    good = infer.delay("hello there")
    for request in sent:
        with pytest.raises(InvalidInput, match=r"protocol 1 \(task_protocol=1\).*task_protocol=2"):
            infer.AsyncResult(request.id).get(timeout=30)
    assert len(good.get(timeout=30)) == 32
    client = redis.Redis(port=server_of(processes).port)
    assert client.llen(Keys("carpool.requests").dead_letter) == 0
    old.close()


_PLAIN_CHORD = """
import sys
from celery import Celery, chord

plain = Celery("plain", broker=sys.argv[1], backend=sys.argv[2])
plain.conf.update(
    task_default_queue="carpool.requests", result_serializer="msgpack", result_accept_content=["msgpack"]
)
header = [plain.signature("carpool.infer", args=(f"text {i}",)) for i in range(3)]
result = chord(header)(plain.signature("plain.summarise", queue="nobody.listens"))
for waited in (result, *result.parent.results):
    try:
        print("got", waited.get(timeout=30))
    except Exception as exc:
        print(type(exc).__name__, exc)
"""


def test_a_chord_a_plain_celery_app_sends_with_carpool_tasks_in_its_header_answers_its_caller(
    processes: Processes,
) -> None:
    """Another app's chord skips carpool's refusal at the call: its body waited for ever on a counter
    no batch worker advances, and nothing was logged (found by the review of foreign messages).
    The other app runs in a process of its own, as another application's would."""
    import subprocess
    import sys

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy")
    done = subprocess.run(
        [sys.executable, "-c", _PLAIN_CHORD, processes.broker_url, processes.result_backend],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 4, (done.stdout, done.stderr)
    # The chord's body, then each header request: answered with the refusal, none left waiting.
    refusal = "chord= is not supported by carpool tasks"
    assert all(line.startswith("InvalidInput") and refusal in line for line in lines), lines


def test_a_task_id_that_is_not_utf8_is_dead_lettered_alone_and_the_requests_taken_with_it_answered(
    processes: Processes,
) -> None:
    """Its id read as it is would fail every process that decodes it, the take's reply first: the
    take names it as garbage, and intake dead-letters it (its id no longer its message's)."""
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy")
    client = redis.Redis(port=server_of(processes).port)
    poison = message("POISONID", "hello there").replace(b"POISONID", b"bad\xff\xfeid")
    goods = [f"good-{i}" for i in range(4)]
    raws = [message(i, "hello there") for i in goods]
    # One push, the poison in the middle: the coordinator takes them all in one take.
    client.lpush("carpool.requests", *reversed([*raws[:2], poison, *raws[2:]]))

    want = infer.delay("hello there").get(timeout=30)
    for request_id in goods:
        assert_same_vectors(infer.AsyncResult(request_id).get(timeout=30), want)
    keys = Keys("carpool.requests")
    [dead] = wait_for("a dead letter", lambda: client.lrange(keys.dead_letter, 0, -1))
    entry = json.loads(dead)
    assert entry["id"].startswith("carpool-garbage-")
    assert "its task id b'bad\\xff\\xfeid' is not UTF-8" in entry["reason"]
    # the poison too left every in-flight key (acked as it was dead-lettered, never recovered)
    wait_for(
        "nothing in flight", lambda: client.zcard(keys.inflight_lease) == client.hlen(keys.inflight_raw) == 0
    )
    assert client.llen("carpool.requests") == 0
    assert "step failed" not in processes.log("coordinator")


def test_an_element_of_the_batch_queue_that_is_no_message_is_dropped_and_the_worker_serves_on(
    processes: Processes,
) -> None:
    """Anyone may push anything onto the batch queue's list; kombu's consumer would stop the worker
    on what it cannot decode ("Unrecoverable error"). Pushed before the requests, and with them."""
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy")
    client = redis.Redis(port=server_of(processes).port)
    garbage = [b"not json at all", b"[]", b"\xff garbage", b'{"headers": {}}']
    client.lpush("carpool.batches", *garbage)
    wait_for("the garbage read", lambda: client.llen("carpool.batches") == 0, 10)
    results = [infer.delay(f"text {i}") for i in range(5)]
    client.lpush("carpool.batches", b"not json either")
    results += [infer.delay(f"more text {i}") for i in range(5)]
    for result in results:
        assert len(result.get(timeout=30)) == 32
    assert processes.procs["worker0"].poll() is None, "the worker is still up"
    log = processes.log("worker0")
    assert "Unrecoverable error" not in log
    assert log.count("that is not a kombu message") == len(garbage) + 1


def test_a_poisoned_request_fails_alone_and_the_requests_batched_with_it_are_answered(
    processes: Processes,
) -> None:
    """One take holds good requests and, among them, requests the worker's Celery JSON would misread:
    a @batched item shaped like a kombu type tag (one that does not decode failed the whole batch
    message, every request in it recovered and batched with the poison again until its deadline;
    a bytes tag reached the function as bytes), a link holding such a tag, an integer past 64 bits
    (read as a float), an eta that is no time (dropped: the request ran at once). Each is answered
    InvalidInput at once, saying what to change; every good request gets its correct answer."""
    from celery import signature

    from carpool.errors import InvalidInput
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    start_stack(
        processes,
        CARPOOL_IMPORTS="tests.integration.batched_tasks",
        CARPOOL_MODEL="toy",
        CARPOOL_DEFAULT_DEADLINE_S="20",
        CARPOOL_MAX_WAIT_S="0.3",
    )
    client = redis.Redis(port=server_of(processes).port)
    bad_link = signature(
        "tests.plain.describe", args=({"__type__": "uuid", "__value__": "zz"},), queue="tests.plain"
    )
    embed = {"callbacks": [dict(bad_link)], "errbacks": None, "chain": None, "chord": None}
    poison = {
        "date-tag": message(
            "date-tag", {"__type__": "datetime", "__value__": "not a date"}, task=t.count.name
        ),
        "bytes-tag": message("bytes-tag", {"__type__": "bytes", "__value__": "hi"}, task=t.count.name),
        "big-int": message("big-int", {"n": 2, "x": 10**30}, task=t.by_declared_length.name),
        "link-tag": message("link-tag", "hello there", embed=embed),
        "eta-words": message("eta-words", "hello there", extra_headers={"eta": "tomorrow 9am"}),
    }
    counts = {f"count-{i}": ["a", "b"][: 1 + i % 2] for i in range(8)}  # lengths 1 and 2, as the tags'
    texts = [f"text-{i}" for i in range(8)]
    raws = [message(i, item, task=t.count.name) for i, item in counts.items()]
    raws += [message(i, "hello there") for i in texts]
    raws.insert(4, poison["date-tag"])
    raws.insert(8, poison["link-tag"])
    raws += [poison["bytes-tag"], poison["big-int"], poison["eta-words"]]
    raws.append(message("declared", {"n": 2, "x": 21}, task=t.by_declared_length.name))
    client.lpush("carpool.requests", *reversed(raws))  # one push: taken together, in this order

    # Answered well before CARPOOL_DEFAULT_DEADLINE_S: no batch went round and round.
    for request_id, item in counts.items():
        assert t.count.AsyncResult(request_id).get(timeout=15) == len(item)
    want = infer.delay("hello there").get(timeout=15)
    for request_id in texts:
        assert_same_vectors(infer.AsyncResult(request_id).get(timeout=15), want)
    assert t.by_declared_length.AsyncResult("declared").get(timeout=15) == 42
    expected = {
        "date-tag": "shaped like one of kombu's type tags .* fails on it .ValueError: Invalid isoformat",
        "bytes-tag": r"would hand your function b'hi' \(bytes\), not the dict sent; .* rename the dict's",
        "big-int": r"cannot travel as JSON unchanged \(Integer exceeds 64-bit range\)",
        "link-tag": "the message's callbacks hold .* a Celery worker could not decode this message either",
        "eta-words": "eta 'tomorrow 9am' is not a time: send an ISO 8601 datetime",
    }
    for request_id, match in expected.items():
        with pytest.raises(InvalidInput, match=match):
            infer.AsyncResult(request_id).get(timeout=15)
    assert client.llen(Keys("carpool.requests").dead_letter) == 0
