"""The bulk client: submit_many / gather / gather_async against a real redis-server and real processes."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from carpool.celery_edge.events import PROBE_INTERVAL_S
from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.workload import mixed_texts
from tests.integration.conftest import (
    Processes,
    as_bytes,
    assert_same_vectors,
    server_of,
    start_stack,
    store_later,
    wait_for,
)

pytestmark = pytest.mark.integration

TOY = {"CARPOOL_MODEL": "toy", "CARPOOL_MODELS": "toy"}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _with_body(raw: str) -> dict[str, Any]:
    """A Redis-transport envelope with its base64 body decoded (bodies are compared as JSON values:
    rendered ones are compact, Celery's have spaces)."""
    message: dict[str, Any] = json.loads(raw)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return message


def _build(name: str, calls: Any, task_ids: Any = None, argsreprs: Any = None, **options: Any) -> Any:
    """A one-off TaskMessageBuilder's messages for ``calls``."""
    from carpool.celery_edge.task_messages import TaskMessageBuilder

    return TaskMessageBuilder(name, **options).build(calls, task_ids=task_ids, argsreprs=argsreprs)


def _count_celery_builds(app: Any, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The task ids Celery's own ``create_task_message`` builds from now on, in order."""
    built: list[object] = []
    real = app.amqp.create_task_message

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(app.amqp, "create_task_message", counting)
    return built


def _commandstats(client: Any) -> dict[str, int]:
    return {k: int(v["calls"]) for k, v in client.info("commandstats").items()}


@contextmanager
def _count_sends(db: int) -> Iterator[list[int]]:
    """Count client-side writes to Redis connections on ``db`` (each write is one round trip at most)."""
    import redis.connection

    cls = redis.connection.AbstractConnection
    original = cls.send_packed_command
    sends: list[int] = []

    def counting(self: Any, command: Any, check_health: bool = True) -> Any:
        if getattr(self, "db", None) == db:
            sends.append(1)
        return original(self, command, check_health)  # type: ignore[no-untyped-call]

    cls.send_packed_command = counting  # type: ignore[method-assign]
    try:
        yield sends
    finally:
        cls.send_packed_command = original  # type: ignore[method-assign]


def test_importing_the_client_does_not_import_torch() -> None:
    code = (
        "import sys, carpool.producer.submit, carpool.producer.gather; "
        "heavy = [m for m in ('torch', 'numpy', 'transformers', 'tokenizers') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fast_argsrepr_agrees_with_celery_saferepr() -> None:
    from celery.utils.saferepr import saferepr

    from carpool.celery_edge.task_messages import _fast_repr

    samples: list[tuple[str, ...]] = [(t,) for t in mixed_texts(300, seed=5)]
    samples += [
        ("it's",),
        ('say "hi"',),
        ("back\\slash",),
        ("x" * 5000,),
        ("Ünïcödé 東京 🚀", "toy"),
        ("\u2028",),
    ]
    for args in samples:
        fast = _fast_repr(args, 1024)
        assert fast is None or fast == saferepr(args, 1024), args


def test_messages_are_the_ones_delay_sends(clean_redis: EmbeddedRedis) -> None:
    """No coordinator: read the raw messages back and compare them with infer.delay()'s, field by field."""
    import redis

    from carpool.producer.submit import submit_many
    from carpool.tasks import infer

    client = redis.Redis(port=clean_redis.port)
    infer.delay("hello world", "toy")
    by_delay = json.loads(as_bytes(client.rpop("carpool.requests")))
    (result,) = submit_many(["hello world"], model="toy")
    by_bulk = json.loads(as_bytes(client.rpop("carpool.requests")))
    # Bodies as JSON values: whether each was rendered from a kept template (compact) or built by
    # Celery (with spaces) depends on what this process sent before.
    a = _flat(_with_body(json.dumps(by_delay)))
    b = _flat(_with_body(json.dumps(by_bulk)))
    # One header more: the result inbox of this process, where its results come back.
    from carpool.celery_edge.app import app
    from carpool.celery_edge.inbox import inbox_channel, inbox_of

    inbox = b.pop("headers.carpool_inbox")
    assert inbox == inbox_channel(app) == inbox_of(result)
    assert inbox.startswith("celery-task-meta-carpool.inbox.")
    assert set(a) == set(b)
    per_message = {
        "headers.id",
        "headers.root_id",
        "properties.correlation_id",
        "properties.delivery_tag",
        "headers.carpool_sent_at",
    }
    assert {k for k in a if a[k] != b[k]} <= per_message
    assert b["headers.id"] == result.id
    assert abs(b["headers.carpool_sent_at"] - time.time()) < 60

    # The coordinator's decoder reads it like any other request.
    from carpool.celery_edge import requests as protocol

    raw = json.dumps(by_bulk).encode()
    msg = protocol.decode(raw)
    assert (msg.id, msg.args, msg.kwargs, msg.inbox) == (result.id, ["hello world", "toy"], {}, inbox)

    # Priorities land on kombu's priority lists, as with apply_async(priority=...).
    submit_many(["urgent"], model="toy", priority=5)
    assert client.llen("carpool.requests\x06\x163") == 1
    # Keyword payloads and expires, as infer.apply_async(kwargs=..., expires=...).
    submit_many([{"text": "kw", "model": "toy"}], expires=30)
    raw_kw = json.loads(as_bytes(client.rpop("carpool.requests")))
    decoded = protocol.decode(json.dumps(raw_kw).encode())
    assert decoded.kwargs == {"text": "kw", "model": "toy"} and decoded.args == []
    assert decoded.expires_at is not None and 20 < decoded.expires_at - time.time() <= 31


def test_a_forked_child_sends_messages_naming_its_own_process(clean_redis: EmbeddedRedis) -> None:
    """Celery writes the sending process into each message's ``origin`` (gen<pid>@host): a child
    forked after its parent's kept builder learned its template must not send the parent's."""
    import os

    import redis

    from carpool.tasks import infer

    client = redis.Redis(port=clean_redis.port)

    def origin_of_last() -> str:
        origin: str = json.loads(as_bytes(client.rpop("carpool.requests")))["headers"]["origin"]
        return origin

    for _ in range(3):  # past the first two builds: the kept builder renders from its template
        infer.delay("warm", "toy")
        assert origin_of_last().startswith(f"gen{os.getpid()}@")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports what it sent, then leaves without running pytest's teardown
        try:
            infer.delay("from the child", "toy")
            os.write(write, origin_of_last().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child_origin = pipe.read()
    os.waitpid(pid, 0)
    assert child_origin.startswith(f"gen{pid}@"), child_origin
    client.close()


_PREFORK_SERVER = """
import multiprocessing

import carpool
from carpool.celery_edge.app import app
from carpool.celery_edge.compat import result_pubsub
from carpool.tasks import infer

PARENTS = []  # the parent's result pub/sub, as the children inherit it


def forked_round(n):
    # In a forked child: what its own .delay().get(), submit_many + gather came back as.
    try:
        got = [len(infer.delay(f"child {n} get {i}", "toy").get(timeout=20)) for i in range(3)]
        got += [len(v) for v in carpool.gather(carpool.submit_many([f"child {n}"] * 4, model="toy"), 20)]
        if result_pubsub(app.backend.result_consumer) is PARENTS[0]:
            return "read on the parent's connection"
        return "ok" if got == [32] * 7 else f"wrong {got}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    assert len(infer.delay("the parent, before", "toy").get(timeout=30)) == 32
    assert len(carpool.gather(carpool.submit_many(["before"] * 3, model="toy"), 30)) == 3
    PARENTS.append(result_pubsub(app.backend.result_consumer))
    assert PARENTS[0] is not None
    with multiprocessing.get_context("fork").Pool(3) as pool:
        children = pool.map_async(forked_round, range(6))
        parent = [len(infer.delay(f"the parent, meanwhile {i}", "toy").get(timeout=20)) for i in range(5)]
        print("children", children.get(timeout=120))
    print("parent", parent)
"""


def test_children_forked_after_their_parent_waited_on_results_wait_on_their_own(
    processes: Processes, tmp_path: Any
) -> None:
    """A prefork server that warms up before forking: each child inherits its parent's result
    pub/sub socket, which must stay the parent's; the child subscribes on a connection of its own.
    The server is a process of its own, as an app server's is: forked from the test's, whose
    threads (in-process workers, torch's) may hold a lock at the fork, a child could hang."""
    start_stack(processes, **TOY)
    server = tmp_path / "prefork_server.py"
    server.write_text(_PREFORK_SERVER)
    proc = subprocess.run(
        [sys.executable, str(server)], env=processes.env(**TOY), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "children ['ok', 'ok', 'ok', 'ok', 'ok', 'ok']" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "parent [32, 32, 32, 32, 32]" in proc.stdout, proc.stdout


def test_delay_publishes_directly_unless_an_option_needs_celerys_send(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task's own options, merged as Celery merges them, once included the serializer Celery
    sets on every task: every .delay() then went through Celery's send, two to three times the CPU
    (found by the review of the bench, which sends with submit_many and never saw it)."""
    import redis

    from carpool.celery_edge.app import app
    from carpool.tasks import infer
    from tests.integration import batched_tasks as t

    client = redis.Redis(port=clean_redis.port)
    through_celery: list[str] = []
    send_task = app.send_task

    def recorded(name: str, *args: Any, **kwargs: Any) -> Any:
        through_celery.append(name)
        return send_task(name, *args, **kwargs)

    monkeypatch.setattr(app, "send_task", recorded)
    t.shout.delay("a")
    infer.delay("b", "toy")
    t.shout.apply_async(("c",), priority=3, expires=60)
    assert through_celery == [] and client.llen("carpool.requests") == 2
    t.shout.apply_async(("d",), countdown=1)  # Celery's own path, for what only it does
    assert through_celery == [t.shout.name]
    client.close()


def test_a_tasks_own_queue_and_expires_go_with_every_send_as_celery_merges_them(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the producer review: a task's own expires and queue (its class, task_annotations)
    were dropped by .delay() and submit_many; Celery's apply_async merges them into every call."""
    import redis

    from carpool.errors import UnsupportedOption
    from carpool.producer.submit import submit_many
    from tests.integration import batched_tasks as t

    client = redis.Redis(port=clean_redis.port)
    monkeypatch.setattr(t.shout, "expires", 30)
    monkeypatch.setattr(t.shout, "queue", "pool-b.requests", raising=False)  # task_annotations set it so
    monkeypatch.setattr(t.shout, "_exec_options", None)  # Celery keeps them once read

    def sent(queue: str) -> dict[str, float]:
        """Each message's argument -> seconds until its expires header."""
        out = {}
        for raw in client.lrange(queue, 0, -1):
            message = _with_body(as_bytes(raw).decode())
            expires = datetime.fromisoformat(message["headers"]["expires"])
            out[message["body"][0][0]] = expires.timestamp() - time.time()
        client.delete(queue)
        return out

    t.shout.delay("a")
    submit_many(["b"], task=t.shout, subscribe=False)
    t.shout.apply_async(("c",), countdown=1)  # Celery's own send path
    expiring = sent("pool-b.requests")
    assert sorted(expiring) == ["a", "b", "c"] and client.llen("carpool.requests") == 0
    assert all(20 < left <= 31 for left in expiring.values()), expiring
    # A call's own options win over the task's, as in Celery.
    t.shout.apply_async(("d",), expires=300, queue="carpool.requests")
    assert 290 < sent("carpool.requests")["d"] <= 301
    # What only Celery's send carries out is refused by submit_many, saying where it comes from.
    monkeypatch.setattr(t.shout, "routing_key", "rk", raising=False)
    monkeypatch.setattr(t.shout, "_exec_options", None)
    with pytest.raises(
        UnsupportedOption, match=r"submit_many\(\): .*shout's own routing_key='rk' \(its class"
    ):
        submit_many(["e"], task=t.shout, subscribe=False)
    client.close()


def test_submit_many_takes_a_batched_task_by_name_and_refuses_other_names_saying_so(
    clean_redis: EmbeddedRedis,
) -> None:
    import redis

    from carpool.producer.submit import submit_many
    from tests.integration import batched_tasks as t

    client = redis.Redis(port=clean_redis.port)
    (by_name,) = submit_many(["hey"], task=t.shout.name, subscribe=False)
    message = json.loads(as_bytes(client.rpop("carpool.requests")))
    assert message["headers"]["task"] == t.shout.name and message["headers"]["id"] == by_name.id
    submit_many(["text"], task="carpool.infer", subscribe=False)
    assert json.loads(as_bytes(client.rpop("carpool.requests")))["headers"]["task"] == "carpool.infer"
    with pytest.raises(TypeError, match=r"takes a @batched task, not 'no\.such\.task'"):
        submit_many(["x"], task="no.such.task", subscribe=False)
    assert client.llen("carpool.requests") == 0
    client.close()


def test_templated_messages_equal_celery_built_ones(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the first two, bulk messages are rendered from a template; each must equal the message
    Celery itself builds for the same call (same id), field by field, task-sent event included."""
    from carpool.celery_edge import task_messages as bulk
    from carpool.celery_edge.app import app

    texts = [*mixed_texts(60, seed=3), 'quote " and \\ backslash', "Ünïcödé 東京 🚀", "x" * 3000]
    calls: list[tuple[list[str], dict[str, str]]] = [([t], {}) for t in texts] + [
        ([], {"text": "kw", "model": "toy"}),
        (["two", "toy"], {}),
    ]
    ids = [f"00000000-0000-4000-8000-{i:012d}" for i in range(len(calls))]
    # expires as a datetime: seconds would be "from now", a different instant in each build below
    expires = datetime.now(UTC) + timedelta(seconds=30)
    options = {
        "app": app,
        "task_ids": ids,
        "expires": expires,
        "priority": 3,
        "headers": {"carpool_sent_at": 1.0},
    }
    rendered: list[object] = []
    real = bulk._MessageTemplate.render

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        rendered.append(args[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(bulk._MessageTemplate, "render", spy)
    fast = _build("carpool.infer", calls, **options)
    assert len(rendered) == len(calls) - 1, "the template renders every message after the first"
    monkeypatch.setattr(bulk._MessageTemplate, "maybe", classmethod(lambda cls, *a: None))
    slow = _build("carpool.infer", calls, **options)
    assert fast.ids == slow.ids == ids and list(fast.pushes) == list(slow.pushes)
    (fast_raws,), (slow_raws,) = fast.pushes.values(), slow.pushes.values()
    for task_id, f, s in zip(ids, fast_raws, slow_raws, strict=True):
        a, b = _flat(_with_body(f)), _flat(_with_body(s))
        assert {k for k in a if a[k] != b.get(k)} <= {"properties.delivery_tag"}, task_id
        assert set(a) == set(b) and a["headers.id"] == task_id
    fast_events = [e for _, raw in fast.events for e in _event_list(raw)]
    slow_events = [e for _, raw in slow.events for e in _event_list(raw)]
    for e in fast_events + slow_events:
        del e["clock"], e["timestamp"]
    assert fast_events == slow_events and len(fast_events) == len(calls)


@pytest.mark.parametrize("plain", [False, True])
def test_a_kept_builder_renders_every_message_of_later_builds(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, plain: bool
) -> None:
    """The coordinator keeps one TaskMessageBuilder for its batch messages, cut one or two at a time:
    once Celery built two and the template matched, later builds are rendered whole, and still equal
    what Celery builds; with ``plain`` (the coordinator's batches: JSON it decoded) the nested
    values are written by orjson, except what orjson refuses (an integer past 64 bits, a lone
    surrogate), which kombu's encoder writes as before."""
    from carpool.celery_edge import task_messages as bulk
    from carpool.celery_edge.app import app

    real = app.amqp.create_task_message
    celery_builds = _count_celery_builds(app, monkeypatch)
    options = {"app": app, "queue": "carpool.batches", "sent_events": False, "ignore_result": True}
    builder = bulk.TaskMessageBuilder("carpool.run_batch", **options)
    items: list[Any] = [
        [101, 7592, 102],
        {"query": "Ünïcödé 東京 🚀", "scores": [0.1, -2.5e-7, 1e300], "nested": {"ok": [True, None]}},
        2**70,  # past 64 bits: orjson refuses, kombu's encoder writes it
        "lone \ud800 surrogate",  # orjson refuses this too
        'quote " and \\ backslash',
    ]
    batches: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
        ([{"id": f"b{i}", "requests": [{"id": f"r{i}", "len": i, "item": item, "deadline": 1.5 + i}]}], {})
        for i, item in enumerate(items)
    ]
    ids = [f"00000000-0000-4000-8000-{i:012d}" for i in range(5)]
    reprs = [f"size=1 bin={i}" for i in range(5)]
    out: list[tuple[str, list[str]]] = []
    for i in range(5):  # one batch per build, as a saturated coordinator cuts them
        out.extend(
            builder.build(
                batches[i : i + 1], task_ids=ids[i : i + 1], argsreprs=reprs[i : i + 1], plain=plain
            ).pushes.items()
        )
    assert celery_builds == ids[:2], "Celery builds the first two messages only"
    monkeypatch.setattr(app.amqp, "create_task_message", real)
    slow = _build("carpool.run_batch", batches, task_ids=ids, argsreprs=reprs, **options)
    (key, slow_raws), *_ = slow.pushes.items()
    assert [k for k, _ in out] == [key] * 5
    for task_id, (_, (fast,)), s in zip(ids, out, slow_raws, strict=True):
        a, b = _flat(_with_body(fast)), _flat(_with_body(s))
        assert {k for k in a if a[k] != b.get(k)} <= {"properties.delivery_tag"}, task_id
        assert set(a) == set(b) and a["headers.id"] == task_id and a["headers.ignore_result"] is True
    # What the worker reads back: each item equal to what the coordinator put in the batch.
    read = [_with_body(fast)["body"][0][0]["requests"][0]["item"] for _, (fast,) in out]
    assert read == items
    # Rendered (past the first two), the last batch is written by orjson (compact) only when plain.
    body = base64.b64decode(json.loads(out[4][1][0])["body"])
    assert (b", " not in body) is plain


def test_a_batch_message_taken_by_a_claim_reads_as_celery_delivers_it(clean_redis: EmbeddedRedis) -> None:
    """What a worker's claim takes off the batch queue (:mod:`carpool.celery_edge.received`): the
    coordinator's batch messages, Celery-built and rendered alike, carry the text the claim script
    looks for and read back to the batch and the task fields Celery's request would give; one
    sent with an expiry is left to Celery."""
    from carpool.celery_edge import task_messages as bulk
    from carpool.celery_edge.app import app
    from carpool.celery_edge.received import accepted, marker, read_task

    options = {"app": app, "queue": "carpool.batches", "sent_events": False, "ignore_result": True}
    builder = bulk.TaskMessageBuilder("carpool.run_batch", **options)
    accept = accepted(app.conf.accept_content)
    batches = [
        {"id": f"b{i}", "requests": [{"id": f"r{i}", "len": 3, "item": [101, i, 102]}]} for i in range(4)
    ]
    raws = []
    for i, one in enumerate(batches):  # the first two built by Celery, the rest rendered
        built = builder.build([([one], {})], task_ids=[f"t{i}"], argsreprs=[f"size=1 bin={i}"], plain=True)
        raws += built.pushes["carpool.batches"]
    for i, raw in enumerate(raws):
        assert marker("carpool.run_batch") in raw
        task = read_task(raw, "carpool.run_batch", accept)
        assert task is not None and task.args == [batches[i]] and task.kwargs == {}
        assert (task.request.id, task.request.argsrepr, task.request.retries) == (
            f"t{i}",
            f"size=1 bin={i}",
            0,
        )
    later = _build("carpool.run_batch", [([batches[0]], {})], task_ids=["t9"], **{**options, "expires": 60})
    assert (
        read_task(later.pushes["carpool.batches"][0], "carpool.run_batch", accepted(app.conf.accept_content))
        is None
    )


def test_the_coordinators_batch_messages_keep_a_nan_in_a_requests_links(clean_redis: EmbeddedRedis) -> None:
    """A batch message is written by orjson, except when a request's links (signatures as a client
    sent them; Python's json writes a nan as NaN) hold a float JSON lacks: orjson would make it null,
    so that batch is written by kombu's encoder and the callback gets its nan."""
    import math

    import redis

    from carpool.batching.types import Batch, FlushReason, Request
    from carpool.celery_edge.app import app
    from carpool.config import Settings
    from carpool.coordinator.publish import BatchPublisher
    from carpool.models.task import InferSpec
    from carpool.redis_edge.keys import Keys
    from carpool.redis_edge.store import RequestStore

    settings = Settings(model="toy")
    client = redis.Redis(port=clean_redis.port)
    store = RequestStore(client, Keys(settings.request_queue), 30)
    from carpool.models import get_model

    spec = InferSpec("carpool.infer", model_of=get_model)
    publisher = BatchPublisher(app, store, settings, {"toy": spec}, "coordinator@test")

    def batch(*links: Any) -> Batch:
        slots = []
        for i, link in enumerate(links):
            slot: dict[str, Any] = {"id": f"r{i}", "item": [101, 7, 102], "len": 3, "deadline": 2.0}
            if link is not None:
                slot["links"] = link
            slots.append(slot)
        requests = tuple(Request(s["id"], "toy", 3, 0.0, 60.0, payload=s) for s in slots)
        return Batch("toy", "1-16", requests, 3, FlushReason.FULL)

    nan_link = {"callbacks": [{"task": "t", "args": [float("nan")], "kwargs": {}, "options": {}}]}
    each_batch: list[tuple[Any, ...]] = [(None,), (None,), (None, None), (None, nan_link), ({},)]
    for links in each_batch:
        publisher.publish(settings.batch_queue, [batch(*links)], 0.0, None)
    raws = [as_bytes(r) for r in reversed(client.lrange(settings.batch_queue, 0, -1))]
    bodies = [base64.b64decode(json.loads(raw)["body"]) for raw in raws]
    assert len(bodies) == 5
    # Past Celery's two builds the template renders: compact (orjson) unless a nan rides along.
    assert [b", " not in body for body in bodies[2:]] == [True, False, True]
    [[message], _, _] = json.loads(bodies[3])
    [plain_slot, linked_slot] = message["requests"]
    assert "links" not in plain_slot and plain_slot["item"] == [101, 7, 102]
    assert math.isnan(linked_slot["links"]["callbacks"][0]["args"][0])


def test_delay_keeps_its_builder_and_renders_later_messages_with_their_own_sent_at(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``.delay()`` keeps one builder per thread and options: Celery builds its first two messages
    only, and every later one, rendered from the template with its own sent-at header, equals what
    Celery builds for the same call."""
    import redis

    from carpool.celery_edge.app import app, state_of
    from carpool.tasks import infer

    state_of(app).builders.clear()
    real = app.amqp.create_task_message
    celery_builds = _count_celery_builds(app, monkeypatch)
    texts = ["one", "two words", 'a "quoted" text', "Ünïcödé 東京", "five"]
    results = [infer.delay(t, "toy") for t in texts]
    assert celery_builds == [r.id for r in results[:2]], "Celery builds the first two messages only"
    monkeypatch.setattr(app.amqp, "create_task_message", real)
    client = redis.Redis(port=clean_redis.port)
    sent = [json.loads(as_bytes(client.rpop("carpool.requests"))) for _ in texts]  # LPUSHed: oldest first
    stamps = [m["headers"]["carpool_sent_at"] for m in sent]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps), "each message has its own time"
    for text, result, message in zip(texts, results, sent, strict=True):
        assert message["headers"]["id"] == result.id
        celery = _build(
            "carpool.infer",
            [((text, "toy"), {})],
            task_ids=[result.id],
            app=app,
            queue="carpool.requests",
            headers={"carpool_sent_at": message["headers"]["carpool_sent_at"]},
        )
        (raw,) = next(iter(celery.pushes.values()))
        a, b = _flat(_with_body(json.dumps(message))), _flat(_with_body(raw))
        assert {k for k in a if a[k] != b.get(k)} <= {"properties.delivery_tag"}, text
        assert set(a) == set(b)


def test_get_sends_no_unsubscribe_of_its_own_and_settled_channels_leave_in_bulk(
    clean_redis: EmbeddedRedis,
) -> None:
    """``.get()`` returns on its result's message without an UNSUBSCRIBE per result: a settled
    result's channel leaves Celery's set at once, and Redis with the others in one UNSUBSCRIBE."""
    import queue
    import threading

    import redis

    from carpool.celery_edge.app import app
    from carpool.celery_edge.result_consumer import _SETTLED_KEPT
    from carpool.celery_edge.results import SUCCESS
    from carpool.tasks import infer
    from carpool.tools.harness import release_result_consumer

    to_store: queue.Queue[tuple[str, int] | None] = queue.Queue()

    def store() -> None:  # another thread: the results arrive as pub/sub messages during .get()
        while (item := to_store.get()) is not None:
            time.sleep(0.001)
            app.backend.store_many([(item[0], SUCCESS, item[1])])

    release_result_consumer(app)  # no channels left over from earlier tests
    storer = threading.Thread(target=store)
    storer.start()
    client = redis.Redis(port=clean_redis.port)
    consumer = app.backend.result_consumer
    before = _commandstats(client)
    keys = []
    try:
        for i in range(_SETTLED_KEPT + 5):
            result = infer.delay(f"text {i}", "toy")
            to_store.put((result.id, i))
            assert result.get(timeout=10) == i
            keys.append(as_bytes(app.backend.get_key_for_task(result.id)))
    finally:
        to_store.put(None)
        storer.join()
    assert not set(keys) & consumer.subscribed_to
    unsubscribes = _commandstats(client).get("cmdstat_unsubscribe", 0) - before.get("cmdstat_unsubscribe", 0)
    assert unsubscribes == 1, "one UNSUBSCRIBE for every settled channel gathered"
    still = {as_bytes(c) for c in client.pubsub_channels("celery-task-meta-*")}
    assert still & set(keys) == set(keys[_SETTLED_KEPT:]), "the rest wait for the next one"


def _event_list(raw: str) -> list[dict[str, Any]]:
    envelope = json.loads(raw)
    events: list[dict[str, Any]] = json.loads(base64.b64decode(envelope["body"]))
    return events


def test_fanout_encoder_matches_what_celery_publishes(clean_redis: EmbeddedRedis) -> None:
    """carpool.celery_edge.fanout builds event messages itself; Celery's own event dispatcher,
    publishing through
    kombu, must produce the same envelope (all but the per-message delivery tag), on the same topic."""
    import redis

    from carpool.celery_edge.app import app
    from carpool.celery_edge.fanout import event_encoder

    client = redis.Redis(port=clean_redis.port)
    listener = cast("Any", client).pubsub()  # typed in some redis-py releases, not all
    listener.psubscribe("/0.celeryev/*")
    assert listener.get_message(timeout=10)["type"] == "psubscribe"
    event = {"type": "task-started", "uuid": "abc", "hostname": "h@x", "timestamp": 1.5}
    with app.connection_for_write() as conn:
        dispatcher = app.events.Dispatcher(conn, hostname="h@x")
        dispatcher.publish("task-started", {"uuid": "abc"}, dispatcher.producer)
        dispatcher.close()
    by_celery = listener.get_message(timeout=5)
    encoder = event_encoder(app, "task.started", "h@x")
    client.publish(encoder.topic, encoder.encode(event))
    by_carpool = listener.get_message(timeout=5)
    listener.close()
    assert by_celery is not None and by_carpool is not None
    assert by_carpool["channel"] == by_celery["channel"]
    a, b = _flat(json.loads(by_celery["data"])), _flat(json.loads(by_carpool["data"]))
    assert set(a) == set(b)
    assert {k for k in a if a[k] != b[k]} == {"body", "properties.delivery_tag"}
    celery_body = json.loads(base64.b64decode(a["body"]))
    carpool_body = json.loads(base64.b64decode(b["body"]))
    assert carpool_body == event and celery_body["type"] == "task-started" and celery_body["uuid"] == "abc"


def test_a_kept_builders_task_sent_events_equal_a_fresh_builders_for_every_build(
    clean_redis: EmbeddedRedis,
) -> None:
    """A builder kept for many builds (``.delay()`` keeps one per thread) reuses its events' encoder:
    each build's task-sent message still goes to the topic, in the envelope, with the events a
    one-off builder gives for the same call; a new message channel (after ``app.close()``) gets an
    encoder of its own."""
    from carpool.celery_edge.app import app, state_of
    from carpool.celery_edge.task_messages import TaskMessageBuilder

    options: dict[str, Any] = {"app": app, "queue": "carpool.requests", "sent_events": True}
    kept = TaskMessageBuilder("carpool.infer", **options)
    for round_ in range(2):
        for i in range(3):
            task_id = f"00000000-0000-4000-8000-{round_:06d}{i:06d}"
            calls: list[tuple[tuple[str, str], dict[str, Any]]] = [((f"text {i}", "toy"), {})]
            mine = kept.build(calls, task_ids=[task_id])
            fresh = _build("carpool.infer", calls, task_ids=[task_id], **options)
            [(topic, raw)] = mine.events
            [(fresh_topic, fresh_raw)] = fresh.events
            assert topic == fresh_topic
            a, b = _flat(json.loads(raw)), _flat(json.loads(fresh_raw))
            assert set(a) == set(b)
            assert {k for k in a if a[k] != b[k]} == {"body", "properties.delivery_tag"}
            [event], [expected] = _event_list(raw), _event_list(fresh_raw)
            for e in (event, expected):
                del e["clock"], e["timestamp"]
            assert event == expected and event["uuid"] == task_id and event["type"] == "task-sent"
        channel = state_of(app).message_channel()
        assert kept._sent_encoder is not None and kept._sent_encoder[0] is channel
        state_of(app).close()  # the next round builds on a new message channel
        assert state_of(app).message_channel() is not channel


def test_a_builder_checks_its_sent_event_template_also_when_its_second_build_sends_none(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CARPOOL_EVENTS=auto a producer's second build may leave its task-sent events out (nobody
    listened to the first): the template is trusted only after its sent event matched Celery's."""
    from carpool.celery_edge import task_messages
    from carpool.celery_edge.app import app

    checked: list[str] = []
    real = task_messages._MessageTemplate.sent_event

    def spy(self: Any, task_id: str, *args: Any) -> Any:
        checked.append(task_id)
        return real(self, task_id, *args)

    monkeypatch.setattr(task_messages._MessageTemplate, "sent_event", spy)
    kept = task_messages.TaskMessageBuilder(
        "carpool.infer", app=app, queue="carpool.requests", sent_events=True
    )
    first = kept.build([(("one", "toy"), {})], task_ids=["id-1"], events=True)
    second = kept.build([(("two", "toy"), {})], task_ids=["id-2"], events=False)
    assert first.events and not second.events
    assert kept._trusted and checked == ["id-2"], "trusted without comparing the sent event"
    third = kept.build([(("three", "toy"), {})], task_ids=["id-3"], events=True)
    [(_, raw)] = third.events
    [event] = _event_list(raw)
    assert event["type"] == "task-sent" and event["uuid"] == "id-3" and event["queue"] == "carpool.requests"


def test_one_pipelined_publish_for_hundreds_of_requests(clean_redis: EmbeddedRedis) -> None:
    import redis

    from carpool.producer.submit import submit_many

    client = redis.Redis(port=clean_redis.port)
    submit_many(["warm up"], model="toy")  # first use opens the producer's connection
    client.delete("carpool.requests")
    texts = mixed_texts(400, seed=11)
    events = cast("Any", client).pubsub()  # typed in some redis-py releases, not all
    events.psubscribe("/0.celeryev/*")  # where kombu's Redis transport publishes the event exchange
    assert events.get_message(timeout=10)["type"] == "psubscribe"
    # The warm-up's task-sent events reached nobody: the producer asks again after this long.
    time.sleep(PROBE_INTERVAL_S)
    before = _commandstats(client)
    with _count_sends(db=0) as broker_sends, _count_sends(db=1) as backend_sends:
        results = submit_many(texts, model="toy")
    after = _commandstats(client)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert len(broker_sends) == 1, "all messages must go out in one pipelined write"
    assert len(backend_sends) == 0, "no subscription per result: they come back through the inbox"
    assert delta.get("cmdstat_multi") == 1 and delta.get("cmdstat_exec") == 1
    assert delta.get("cmdstat_lpush") == 1, "one multi-value LPUSH per priority list"
    assert delta.get("cmdstat_publish") == 1, "the task-sent events in one task.multi list message"
    message = events.get_message(timeout=5)
    assert message is not None and message["type"] == "pmessage", message
    assert message["channel"].endswith(b"task.multi")
    envelope = json.loads(message["data"])
    assert envelope["properties"]["delivery_info"]["routing_key"] == "task.multi"
    sent = json.loads(
        base64.b64decode(envelope["properties"]["body_encoding"] == "base64" and envelope["body"])
    )
    assert [e["uuid"] for e in sent] == [r.id for r in results], "one task-sent event per request, in order"
    for event in sent[:3]:
        assert event["type"] == "task-sent" and event["name"] == "carpool.infer"
        assert event["queue"] == "carpool.requests" and event["hostname"] and event["clock"] > 0
        assert abs(event["timestamp"] - time.time()) < 60 and event["args"].startswith("(")
    events.close()
    # All landed, in submission order for the coordinator (it pops from the right).
    raws = client.lrange("carpool.requests", 0, -1)
    ids = [json.loads(r)["headers"]["id"] for r in reversed(raws)]
    assert ids == [r.id for r in results]


def test_chunked_submit_publishes_each_chunk_as_it_is_built(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default one MULTI/EXEC per chunk, from FIRST_CHUNK messages doubling up to STREAM_CHUNK, in
    order, with the builder's template carried over (Celery builds only the first two of the whole
    call); a call of at most STREAM_CHUNK messages, or chunk_size=None: one for all."""
    import redis

    from carpool.celery_edge.app import app
    from carpool.celery_edge.task_messages import TaskMessageBuilder
    from carpool.producer.submit import FIRST_CHUNK, STREAM_CHUNK, submit_many

    client = redis.Redis(port=clean_redis.port)
    submit_many(["warm up"], model="toy")
    client.delete("carpool.requests")
    texts = mixed_texts(1050, seed=12)
    built_by_celery: list[object] = []
    real = app.amqp.create_task_message

    def counting(*args: Any, **kwargs: Any) -> Any:
        built_by_celery.append(args[0])
        return real(*args, **kwargs)

    app.amqp.create_task_message = counting
    chunk_sizes: list[int] = []
    build = TaskMessageBuilder.build

    def sizing(self: TaskMessageBuilder, calls: Any, *args: Any, **kwargs: Any) -> Any:
        chunk_sizes.append(len(calls))
        return build(self, calls, *args, **kwargs)

    monkeypatch.setattr(TaskMessageBuilder, "build", sizing)
    before = _commandstats(client)
    try:
        with _count_sends(db=0) as broker_sends:
            results = submit_many(texts, model="toy", expires=60)
    finally:
        del app.amqp.create_task_message
    delta = {k: v - before.get(k, 0) for k, v in _commandstats(client).items()}
    assert (FIRST_CHUNK, STREAM_CHUNK) == (64, 500)
    assert chunk_sizes == [64, 128, 256, 500, 102]
    chunks = len(chunk_sizes)
    assert len(broker_sends) == chunks and delta.get("cmdstat_exec") == chunks
    assert len(built_by_celery) == 2, "the template outlives a chunk"
    raws = client.lrange("carpool.requests", 0, -1)
    messages = [json.loads(r) for r in reversed(raws)]
    assert [m["headers"]["id"] for m in messages] == [r.id for r in results]
    assert len({m["headers"]["expires"] for m in messages}) == 1, "one expiry instant for every chunk"
    before = _commandstats(client)
    with _count_sends(db=0) as broker_sends:
        whole = submit_many(texts, model="toy", chunk_size=None)
    delta = {k: v - before.get(k, 0) for k, v in _commandstats(client).items()}
    assert len(broker_sends) == 1 and delta.get("cmdstat_exec") == 1, "chunk_size=None: all at once"
    assert client.llen("carpool.requests") == len(results) + len(whole)
    chunk_sizes.clear()
    one_chunk = submit_many(texts[:STREAM_CHUNK], model="toy")
    assert chunk_sizes == [STREAM_CHUNK] and len(one_chunk) == STREAM_CHUNK, "one chunk: all or nothing"
    with pytest.raises(ValueError, match="chunk_size"):
        submit_many(["a"], model="toy", chunk_size=0)


def test_chunked_submit_interrupted_says_what_was_sent(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis failing after the first chunk: SubmitInterrupted carries the AsyncResults of what went out
    (those messages are in the queue), the rest was not sent and its subscriptions are cancelled."""
    import redis

    from carpool.celery_edge.app import app, state_of
    from carpool.errors import SubmitInterrupted
    from carpool.producer import submit as bulk

    client = redis.Redis(port=clean_redis.port)
    bulk.submit_many(["warm up"], model="toy")
    client.delete("carpool.requests")
    publisher = state_of(app).publisher()
    real_pipeline = publisher.pipeline
    calls: list[int] = []

    def failing_after_one(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            raise redis.ConnectionError("Redis went away (test)")
        return real_pipeline(*args, **kwargs)

    monkeypatch.setattr(publisher, "pipeline", failing_after_one)
    # Results subscribed one by one (no result inbox), so that the unsent ones' subscriptions show.
    state = state_of(app)
    monkeypatch.setattr(state, "settings", state.settings.model_copy(update={"result_inbox": False}))
    texts = mixed_texts(25, seed=13)
    subscribed_before = set(app.backend.result_consumer.subscribed_to)
    with pytest.raises(SubmitInterrupted, match="after 10 of 25") as info:
        bulk.submit_many(texts, model="toy", chunk_size=10)
    sent = info.value.results
    assert len(sent) == 10 and isinstance(info.value.__cause__, redis.ConnectionError)
    queued = [json.loads(r)["headers"]["id"] for r in reversed(client.lrange("carpool.requests", 0, -1))]
    assert queued == [r.id for r in sent]
    new_subscriptions = app.backend.result_consumer.subscribed_to - subscribed_before
    assert new_subscriptions == {app.backend.get_key_for_task(r.id) for r in sent}, (
        "the unsent chunk's are gone"
    )
    monkeypatch.undo()
    # Nothing of a first chunk that fails was sent: the original error, not SubmitInterrupted.
    monkeypatch.setattr(
        publisher, "pipeline", lambda *a, **k: (_ for _ in ()).throw(redis.ConnectionError("x"))
    )
    with pytest.raises(redis.ConnectionError):
        bulk.submit_many(texts, model="toy", chunk_size=10)
    assert client.llen("carpool.requests") == 10
    client.close()  # the exceptions' tracebacks hold it in a cycle: not left to the collector


def test_bad_input_raises_at_submit_time_and_sends_nothing(clean_redis: EmbeddedRedis) -> None:
    import redis

    from carpool.errors import InputTooLong, InvalidInput, UnknownModel
    from carpool.producer.submit import submit_many

    client = redis.Redis(port=clean_redis.port)
    with pytest.raises(InvalidInput, match="text must be a str") as info:
        submit_many(["fine", 42, "fine too"], model="toy")
    assert any("payloads[1]" in note for note in info.value.__notes__)
    with pytest.raises(UnknownModel, match="unknown model 'nope'"):
        submit_many(["a", "b"], model="nope")
    with pytest.raises(InputTooLong):
        submit_many(["x" * 70_000], model="toy")
    # ASCII texts take a shorter check: its limits are the general one's, to the byte.
    with pytest.raises(InputTooLong, match="65537 bytes") as too_long:
        submit_many(["x" * 65_536, "x" * 65_537], model="toy")
    assert any("payloads[1]" in note for note in too_long.value.__notes__)
    with pytest.raises(InputTooLong, match="65538 bytes"):
        submit_many(["\u00e9" * 32_769])  # 32,769 characters, two bytes each
    with pytest.raises(InvalidInput, match="lone surrogate"):
        submit_many(["fine", "half a pair: \ud800"])
    with pytest.raises(UnknownModel, match="unknown model 'nope'"):
        submit_many(["an ASCII text"], model="nope")
    with pytest.raises(InvalidInput, match="takes"):
        submit_many([{"text": "a", "colour": "red"}])
    with pytest.raises(TypeError, match="countdown"):
        submit_many(["a"], model="toy", countdown=3)
    # One payload passed bare would be split: a string into characters, a mapping into its keys.
    with pytest.raises(InvalidInput, match=r"not a str .*never split into characters"):
        submit_many("hello", model="toy")
    with pytest.raises(InvalidInput, match="not a dict"):
        submit_many({"text": "a"}, model="toy")
    with pytest.raises(InvalidInput, match="not a bytes"):
        submit_many(b"hi", task="tests.integration.batched_tasks.count")
    assert client.llen("carpool.requests") == 0
    assert submit_many([], model="toy") == []


def test_gather_reads_stored_results_in_one_mget_and_raises_like_get(clean_redis: EmbeddedRedis) -> None:
    """No coordinator: results stored directly, one of them a failure."""
    import redis
    from celery.exceptions import TimeoutError as CeleryTimeout

    from carpool.celery_edge.app import app
    from carpool.celery_edge.results import FAILURE, SUCCESS
    from carpool.errors import DeadlineExceeded
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many

    results = submit_many([f"text {i}" for i in range(50)], model="toy")
    entries: list[tuple[str, str, Any]] = [(r.id, SUCCESS, i) for i, r in enumerate(results)]
    entries[17] = (results[17].id, FAILURE, DeadlineExceeded("too late"))
    app.backend.store_many(reversed(entries))
    client = redis.Redis(port=clean_redis.port)
    before = _commandstats(client)
    with pytest.raises(DeadlineExceeded, match="too late"):
        gather(results, timeout=10)
    assert _commandstats(client).get("cmdstat_mget", 0) - before.get("cmdstat_mget", 0) == 1
    values = gather(results, timeout=10, return_exceptions=True)
    assert isinstance(values[17], DeadlineExceeded)
    assert [v for i, v in enumerate(values) if i != 17] == [i for i in range(50) if i != 17]
    # .get() agrees, without another round trip for what gather already read.
    assert results[3].get(timeout=1) == 3
    with pytest.raises(DeadlineExceeded):
        results[17].get(timeout=1)

    # Nothing will ever answer this one: gather times out like .get().
    (lonely,) = submit_many(["nobody home"], model="toy")
    t0 = time.monotonic()
    with pytest.raises(CeleryTimeout):
        gather([lonely], timeout=0.3)
    assert time.monotonic() - t0 < 2.5


def test_gather_waits_for_results_published_later(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from carpool.celery_edge.app import app
    from carpool.celery_edge.inbox import inbox_of
    from carpool.celery_edge.results import SUCCESS
    from carpool.producer import gather as gathering
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many

    backend = app.backend
    client = redis.Redis(port=clean_redis.port)

    def commands() -> dict[str, int]:
        stats = _commandstats(client)
        return {c: stats.get(f"cmdstat_{c}", 0) for c in ("subscribe", "unsubscribe")}

    # No quiet-time re-read of the store within the test: only pub/sub can bring these results.
    monkeypatch.setattr(gathering, "_QUIET_RECHECK_S", 600.0)
    results = submit_many([f"later {i}" for i in range(20)], model="toy")
    # Stored as a worker stores them: each to its own channel and to its producer's inbox.
    inboxes = {r.id: inbox_of(r) or "" for r in results}
    backend.store_many([(r.id, SUCCESS, i) for i, r in enumerate(results[:10])], inboxes=inboxes)
    before = commands()
    rest = [(r.id, SUCCESS, i + 10) for i, r in enumerate(results[10:])]
    worker = store_later(backend, rest, 0.3, inboxes=inboxes)
    assert gather(results, timeout=10) == list(range(20))
    worker.join()
    after = commands()
    assert after["subscribe"] - before["subscribe"] == 1, "the inbox, subscribed while gather waits"
    assert after["unsubscribe"] - before["unsubscribe"] == 1
    assert not backend.result_consumer.subscribed_to

    # Results subscribed one by one come back as ever, unsubscribed in one command at the end.
    plain = submit_many([f"plain {i}" for i in range(20)], model="toy", subscribe=False)
    assert all(inbox_of(r) is None for r in plain)
    before = commands()
    # Stored once gather has subscribed (it does only when its first read finds results missing).
    subscribed = backend.get_key_for_task(plain[0].id)
    worker = store_later(
        backend,
        [(r.id, SUCCESS, r.id) for r in plain],
        0.3,
        when=lambda: client.pubsub_numsub(subscribed)[0][1] > 0,
    )
    assert gather(plain, timeout=10) == [r.id for r in plain]
    worker.join()
    after = commands()
    assert after["subscribe"] - before["subscribe"] == 1
    assert after["unsubscribe"] - before["unsubscribe"] == 1
    assert not backend.result_consumer.subscribed_to

    # Stored with no inbox message (an older coordinator, a plain Celery worker): read from the
    # store after a quiet second.
    monkeypatch.undo()
    (late,) = submit_many(["no inbox message"], model="toy")
    worker = store_later(backend, [(late.id, SUCCESS, 1)], 0.2)
    assert gather([late], timeout=10) == [1]
    worker.join()
    # Stored with no message at all while gather waits on the result's own channel (as if it was
    # published while the SUBSCRIBE was on its way): read from the store after a quiet second too.
    (quiet,) = submit_many(["no message at all"], model="toy", subscribe=False)
    meta = backend._get_result_meta(result=2, state=SUCCESS, traceback=None, request=None)
    meta["task_id"] = quiet.id
    key = backend.get_key_for_task(quiet.id)
    silent_store = threading.Timer(0.2, backend.client.set, (key, backend.encode(meta)))  # no PUBLISH
    silent_store.start()
    assert gather([quiet], timeout=10) == [2]
    silent_store.join()
    client.close()


def test_gather_collects_large_results_published_in_bursts(clean_redis: EmbeddedRedis) -> None:
    """Embeddings are ~7 KB messages that reach the subscriber in several TCP segments, published by
    another process while gather reads. None may be lost: reading the next message with a zero
    timeout once gave up half-way through one (redis-py reads the rest with the same timeout),
    dropping it, and a single long gather then waited forever for results already stored."""
    import json

    from carpool.celery_edge.inbox import inbox_of
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many

    n = 1500
    results = submit_many([f"big {i}" for i in range(n)], model="toy")
    store = (
        "import json, sys, time\n"
        "from carpool.celery_edge.app import app\n"
        "ids = json.loads(sys.argv[1])\n"
        "for start in range(0, len(ids), 32):\n"
        "    time.sleep(0.005)\n"
        "    app.backend.store_many([(t, 'SUCCESS', [i / 7.0 + k for k in range(384)])\n"
        "                            for i, t in enumerate(ids[start:start + 32], start)],\n"
        "                           inboxes={t: sys.argv[2] for t in ids})\n"
    )
    inbox = inbox_of(results[0])
    assert inbox is not None, "published to gather's inbox, as a worker does"
    proc = subprocess.Popen([sys.executable, "-c", store, json.dumps([r.id for r in results]), inbox])
    try:
        got = gather(results, timeout=60)
    finally:
        proc.wait(timeout=60)
    assert got == [[i / 7.0 + k for k in range(384)] for i in range(n)]
    assert gc.isenabled(), "the collector is paused only while results keep coming"


def test_gather_keeps_the_collector_paused_while_results_keep_coming(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collection after each read of results, and every tenth of those walking the results already
    gathered again, cost more than decoding them: while results keep coming (here a chunk every
    15 ms, each read on its own) the collector stays paused from one read to the next, and it is
    back on once gather returns."""
    import json

    import carpool.producer.gather as gathering
    from carpool.celery_edge.inbox import inbox_of
    from carpool.producer.submit import submit_many

    n, chunk = 600, 30
    results = submit_many([f"streamed {i}" for i in range(n)], model="toy")
    store = (
        "import json, sys, time\n"
        "from carpool.celery_edge.app import app\n"
        "ids = json.loads(sys.argv[1])\n"
        f"for start in range(0, len(ids), {chunk}):\n"
        "    time.sleep(0.015)\n"
        "    app.backend.store_many([(t, 'SUCCESS', [i, [i] * 8, {'i': i}])\n"
        f"                            for i, t in enumerate(ids[start:start + {chunk}], start)],\n"
        "                           inboxes={t: sys.argv[2] for t in ids})\n"
    )
    reads: list[tuple[bool, int]] = []  # (collector on as the read began, messages it brought)
    from carpool.celery_edge.result_consumer import read_result_messages as read

    def recorded(*args: Any) -> tuple[list[tuple[str, Any]], bool]:
        on = gc.isenabled()
        messages, intact = read(*args)
        reads.append((on, len(messages)))
        return messages, intact

    monkeypatch.setattr(gathering, "read_result_messages", recorded)
    ids, inbox = json.dumps([r.id for r in results]), inbox_of(results[0])
    assert inbox is not None
    proc = subprocess.Popen([sys.executable, "-c", store, ids, inbox])
    try:
        got = gathering.gather(results, timeout=60)
    finally:
        proc.wait(timeout=60)
    assert got == [[i, [i] * 8, {"i": i}] for i in range(n)]
    assert gc.isenabled()
    after_results = [on for (on, _), (_, brought) in zip(reads[1:], reads, strict=False) if brought]
    print(f"reads (collector on, messages): {reads}")
    assert len(after_results) >= 5, reads
    # A busy host may stretch a gap past the 50 ms that ends a stream: most reads, not every one.
    assert sum(not on for on in after_results) >= len(after_results) / 2, reads


def test_submit_many_results_equal_delay_results(processes: Processes) -> None:
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from carpool.tasks import infer

    start_stack(processes, **TOY)
    texts = mixed_texts(300, seed=21)
    bulk = submit_many(texts, model="toy")
    got = gather(bulk, timeout=120)
    one_by_one = [infer.delay(t, "toy") for t in texts]
    want = [r.get(timeout=120) for r in one_by_one]
    assert_same_vectors(got, want)
    assert len(got) == 300 and all(isinstance(v, list) and len(v) == 32 for v in got)
    # Plain .get() reads the very result gather did.
    assert bulk[5].get(timeout=5) == got[5]


def test_gather_with_a_request_that_fails_in_the_service(processes: Processes) -> None:
    from celery.exceptions import TaskRevokedError

    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many

    start_stack(processes, **TOY)
    fine = submit_many(mixed_texts(30, seed=2), model="toy")
    doomed = submit_many(["this one expires at once"], model="toy", expires=0.0005)
    results = fine[:10] + doomed + fine[10:]
    with pytest.raises(TaskRevokedError, match="expired"):  # as Celery answers an expired task
        gather(results, timeout=60)
    values = gather(results, timeout=60, return_exceptions=True)
    assert isinstance(values[10], TaskRevokedError)
    assert all(isinstance(v, list) for i, v in enumerate(values) if i != 10)


def test_gather_async(processes: Processes) -> None:
    from celery.exceptions import TaskRevokedError
    from celery.exceptions import TimeoutError as CeleryTimeout

    from carpool.producer.gather import gather, gather_async
    from carpool.producer.submit import submit_many

    start_stack(processes, **TOY)
    texts = mixed_texts(200, seed=4)

    async def main() -> tuple[list[Any], list[Any], list[Any]]:
        first = submit_many(texts[:100], model="toy", subscribe=False)
        second = submit_many(texts[100:], model="toy")  # marked for the inbox: subscribed one by one
        a, b = await asyncio.gather(gather_async(first, timeout=60), gather_async(second, timeout=60))
        doomed = submit_many(["expires"], model="toy", expires=0.0005, subscribe=False)
        with pytest.raises(TaskRevokedError):
            await gather_async(first[:3] + doomed, timeout=60)
        assert gc.isenabled(), "a gather that raised left the collector paused"
        mixed = await gather_async(first[:3] + doomed, timeout=60, return_exceptions=True)
        (never,) = submit_many(["x"], model="toy", queue="carpool.nobody", subscribe=False)
        with pytest.raises(CeleryTimeout):
            await gather_async([never], timeout=0.3)
        assert gc.isenabled()
        return a, b, mixed

    a, b, mixed = asyncio.run(main())
    assert_same_vectors(a + b, gather(submit_many(texts, model="toy"), timeout=60))
    assert isinstance(mixed[3], TaskRevokedError) and mixed[:3] == a[:3]


@pytest.mark.parametrize("serializer", ["msgpack", "json"])
def test_a_plain_celery_client_reads_the_results_gather_returns(
    processes: Processes, serializer: str
) -> None:
    """Results written from a model's float32 rows are standard Celery result metas: a Celery app that
    knows nothing of carpool (only the URLs and the result serializer) reads each one equal to what
    gather returns; under msgpack each value is the model's float32 value exactly, under json equal
    to it once cast to float32."""
    import numpy as np
    from celery import Celery

    from carpool.celery_edge.app import create_app
    from carpool.models.simdevice import output_table
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from carpool.tools.harness import release_result_consumer

    sim = {"CARPOOL_MODEL": "sim-h100", "CARPOOL_MODELS": "sim-h100", "CARPOOL_RESULT_SERIALIZER": serializer}
    start_stack(processes, **sim)
    app = create_app(
        processes.settings().model_copy(
            update={"model": "sim-h100", "models": ("sim-h100",), "result_serializer": serializer}
        )
    )
    plain = Celery("plain", broker=processes.broker_url, backend=processes.result_backend)
    plain.conf.update(
        result_serializer=serializer, accept_content=["json"], result_accept_content=[serializer]
    )
    try:
        results = submit_many(mixed_texts(40, seed=5), app=app)
        got = gather(results, timeout=60)
        read = [plain.AsyncResult(r.id).get(timeout=10) for r in results]
    finally:
        release_result_consumer(app)
        plain.backend.result_consumer.stop()  # every result was got: nothing is subscribed
        plain.close()
    assert read == got
    rows = {row.tobytes() for row in output_table()}  # what the model returns, a row per request
    assert all(isinstance(v, float) for v in got[0])
    assert all(np.array(g, dtype=np.float64).astype(np.float32).tobytes() in rows for g in got)
    if serializer == "msgpack":  # the float32 values themselves, widened: row.tolist() exactly
        exact = {tuple(row.tolist()) for row in output_table()}
        assert all(tuple(g) in exact for g in got)


def test_closing_the_app_closes_every_connection_carpool_opened(processes: Processes) -> None:
    """``app.close()`` closes the connections carpool keeps beside Celery's pool: the publisher of
    ``.delay()`` and ``submit_many``, the result backend's client and its pub/sub. (Celery keeps the
    app as the thread's current app, so nothing would be garbage-collected: what close leaves open
    stays open.) Celery's own broker pool is shared by every app of the process on the same broker,
    and a producer that uses only carpool's paths never opens it."""
    import psutil

    import carpool.tasks  # noqa: F401  (registers carpool.infer on every app)
    from carpool.celery_edge.app import create_app
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many

    def to_redis() -> int:
        port = server_of(processes).port
        connections = psutil.Process().net_connections(kind="tcp")
        return sum(1 for c in connections if c.raddr and c.raddr.port == port and c.status == "ESTABLISHED")

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy")
    gc.collect()  # earlier tests' clients caught in reference cycles close now, not mid-count
    before = to_redis()
    app = create_app(processes.settings().model_copy(update={"model": "toy", "models": ("toy",)}))
    one = app.tasks["carpool.infer"].delay("a single request")
    assert isinstance(one.get(timeout=60), list)
    assert len(gather(submit_many(["first", "second text"], app=app), timeout=60)) == 2
    assert to_redis() > before, "the app's connections are open while it is used"
    app.close()
    assert to_redis() == before
    # Closed, not broken: a closed Celery app is used again the same way, and so is carpool's.
    assert isinstance(app.tasks["carpool.infer"].delay("after close").get(timeout=60), list)
    app.close()


def test_results_returned_or_forgotten_are_not_kept_in_the_consumers_buffer(
    clean_redis: EmbeddedRedis,
) -> None:
    # A result that arrived before its .get() was buffered, then buffered again when .get() read
    # its stored meta: 8,192 returned results per thread stayed (135 MB with 384-float results).
    # A forgotten one still arrived (its UNSUBSCRIBE waits for others) and stayed.
    from carpool.celery_edge.app import app
    from carpool.celery_edge.results import SUCCESS
    from carpool.tasks import infer
    from carpool.tools.harness import release_result_consumer

    release_result_consumer(app)
    consumer = app.backend.result_consumer
    sent = [infer.delay(f"text {i}", "toy") for i in range(40)]
    app.backend.store_many([(r.id, SUCCESS, [i / 7.0] * 384) for i, r in enumerate(sent)])
    assert sent[-1].get(timeout=10) == [39 / 7.0] * 384  # every message read: the others buffered
    got = [r.get(timeout=10) for r in sent[:30]]
    assert got == [[i / 7.0] * 384 for i in range(30)]
    for r in sent[30:-1]:
        r.forget()
    consumer.drain_events(timeout=0.5)  # their messages, still published on subscribed channels
    leftover = [r.id for r in sent if r.id in consumer._pending_messages]
    assert leftover == [], f"{len(leftover)} results kept after they were returned or forgotten"
    # Sent later, stored in one go and read in reverse: each still answered.
    later, last = infer.delay("later", "toy"), infer.delay("last", "toy")
    app.backend.store_many([(later.id, SUCCESS, 1.5), (last.id, SUCCESS, 2.5)])
    assert (last.get(timeout=10), later.get(timeout=10)) == (2.5, 1.5)
    assert [i for i in (later.id, last.id) if i in consumer._pending_messages] == []


def test_get_keeps_its_timeout_and_does_not_return_a_result_that_came_after_it(
    clean_redis: EmbeddedRedis,
) -> None:
    # Celery's drainer read for up to a second before it looked at its clock: .get(timeout=0.1)
    # returned a result stored 0.4 s later, or raised a second late.
    from celery.exceptions import TimeoutError as CeleryTimeoutError

    from carpool.celery_edge.app import app
    from carpool.celery_edge.results import SUCCESS
    from carpool.tasks import infer

    late = infer.delay("answered after the caller's timeout", "toy")  # no coordinator: never batched
    storer = threading.Timer(0.4, lambda: app.backend.store_many([(late.id, SUCCESS, 1.5)]))
    storer.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(CeleryTimeoutError):
            late.get(timeout=0.1)
        assert time.monotonic() - t0 < 2.0  # a bound that catches a hang, not a timing
    finally:
        storer.join()
    assert late.get(timeout=5) == 1.5  # the result itself is there for a later call


def test_results_sent_from_one_thread_can_be_waited_on_from_many_at_once(processes: Processes) -> None:
    """Found by the producer review: eight threads each .get()-ing a slice of one submit_many's
    results shared the sending thread's result consumer, whose pub/sub connection they each
    replaced or read at once: some waited out their timeout for results already stored, others
    met InvalidResponse. Each now waits on its own thread's consumer."""
    from concurrent.futures import ThreadPoolExecutor

    from carpool.producer.submit import submit_many

    start_stack(processes, **TOY)
    threads = 8
    for attempt in range(3):  # the race it met was lost in most rounds, not all
        results = submit_many([f"round {attempt} text {i}" for i in range(400)], model="toy")
        with ThreadPoolExecutor(threads) as pool:
            slices = list(pool.map(_got_and_left, _dealt(results, threads)))
        assert sum(len(values) for values, _ in slices) == 400
        assert all(isinstance(v, list) and len(v) == 32 for values, _ in slices for v in values)
        # Nothing settled is left registered in any thread's backend (the review of the fix found
        # every result kept for good in the waiting thread's).
        assert [left for _, left in slices] == [0] * threads


def test_a_result_set_built_in_one_thread_is_joined_from_another(processes: Processes) -> None:
    """Found by the review of the mend above: ResultSet.get() in another thread than the one that
    sent its members and built it timed out with every result stored (plain Celery does the same)."""
    from concurrent.futures import ThreadPoolExecutor

    from celery.result import ResultSet

    from carpool.tasks import infer

    start_stack(processes, **TOY)
    sent = [infer.delay(f"set member {i}", model="toy") for i in range(5)]
    wait_for("every member stored", lambda: all(r.ready() for r in sent))
    members = ResultSet([infer.AsyncResult(r.id) for r in sent])  # nothing settled on these objects
    with ThreadPoolExecutor(1) as pool:
        values = pool.submit(lambda: members.get(timeout=10)).result()
    assert len(values) == 5 and all(len(v) == 32 for v in values)


def _dealt(items: list[Any], hands: int) -> list[list[Any]]:
    return [items[k::hands] for k in range(hands)]


def _got_and_left(results: list[Any]) -> tuple[list[Any], int]:
    """Each result's value by ``.get()``, and how many results this thread's backend still holds
    as pending afterwards."""
    from carpool.celery_edge.app import app

    values = [r.get(timeout=15) for r in results]
    pending = app.backend._pending_results
    return values, len(pending.concrete) + len(pending.weak)
