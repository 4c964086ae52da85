"""Contract tests of the Lua scripts in carpool/redis_edge/scripts, one real redis-server per session.

Each test drives one script through :class:`RequestStore` (or ``finish_call`` for the results-only
mode the result backend uses) and checks the state it leaves in Redis. Leases use Redis's clock, so
expiry is tested with a tiny lease and a short sleep.
"""

from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis

from carpool.redis_edge import lua
from carpool.redis_edge.keys import PRIORITY_SEP, Keys
from carpool.redis_edge.marks import DeviceMarks
from carpool.redis_edge.store import (
    LINKS_TRIES,
    REPORTS_KEPT,
    REPORTS_TTL_S,
    Claimed,
    LinksDue,
    RequestStore,
    ResultWrites,
    finish_call,
)
from carpool.tools.embedded import EmbeddedRedis
from tests.integration.conftest import as_bytes, requests_in

pytestmark = pytest.mark.integration

KEYS = Keys("scripts.requests")
LEASE_S = 30.0
RESULTS_DB = 1


@pytest.fixture()
def client(clean_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = redis.Redis(port=clean_redis.port)
    yield c
    c.close()


@pytest.fixture()
def results(clean_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = redis.Redis(port=clean_redis.port, db=RESULTS_DB)
    yield c
    c.close()


@pytest.fixture()
def store(client: redis.Redis) -> RequestStore:
    return RequestStore(client, KEYS, LEASE_S)


def message(task_id: str, **extra: Any) -> bytes:
    """A Celery protocol-2 message as kombu's Redis transport stores it (enough for take)."""
    return json.dumps(
        {
            "body": "W10=",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"lang": "py", "task": "carpool.infer", "id": task_id, "root_id": task_id},
            "properties": {"delivery_tag": "t", "body_encoding": "base64"},
            **extra,
        }
    ).encode()


def request_list(step: int) -> str:
    return KEYS.request_queue if step == 0 else f"{KEYS.request_queue}{PRIORITY_SEP}{step}"


def enqueue(client: redis.Redis, *ids: str, step: int = 0) -> None:
    """Send like ``.delay()`` does: LPUSH onto the list of the priority step, so the oldest is RPOPped."""
    for task_id in ids:
        client.lpush(request_list(step), message(task_id))


def in_flight(store: RequestStore, *ids: str, step: int = 0) -> list[tuple[str, bytes]]:
    enqueue(store.client, *ids, step=step)
    taken, _ = store.take(len(ids))
    assert [i for i, _ in taken] == list(ids)
    return taken


def now_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def lease(client: redis.Redis, task_id: str) -> float | None:
    return client.zscore(KEYS.inflight_lease, task_id)


def assert_lease_about(client: redis.Redis, task_id: str, lease_s: float) -> None:
    expiry = lease(client, task_id)
    assert expiry is not None, f"{task_id} has no lease"
    remaining_ms = expiry - now_ms(client)
    assert lease_s * 1000 - 5_000 < remaining_ms <= lease_s * 1000, remaining_ms


def forgotten(client: redis.Redis, task_id: str) -> bool:
    """True when ``task_id`` is in none of the in-flight keys."""
    return (
        lease(client, task_id) is None
        and not client.hexists(KEYS.inflight_raw, task_id)
        and not client.hexists(KEYS.inflight_owner, task_id)
        and not client.hexists(KEYS.inflight_claimed, task_id)
        and not client.hexists(KEYS.inflight_origin, task_id)
    )


def subscribed(client: redis.Redis, *channels: str | bytes) -> Any:
    pubsub = cast("Any", client).pubsub()  # typed in some redis-py releases, not all
    pubsub.subscribe(*channels)
    for _ in channels:
        assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    return pubsub


def published(pubsub: Any, expect: int = 0, wait_s: float = 0.3) -> list[tuple[bytes, bytes]]:
    """Every message published to the subscription until none arrives for ``wait_s``, waiting longer
    (a loaded host) for the first ``expect`` of them."""
    got: list[tuple[bytes, bytes]] = []
    while (m := pubsub.get_message(timeout=5.0 if len(got) < expect else wait_s)) is not None:
        if m["type"] == "message":
            got.append((m["channel"], m["data"]))
    return got


# --- the scripts ship and load ---------------------------------------------------------------


def test_every_script_loads_into_redis(client: redis.Redis) -> None:
    from importlib.resources import files

    shipped = sorted(
        p.name[:-4] for p in (files("carpool.redis_edge") / "scripts").iterdir() if p.name.endswith(".lua")
    )
    assert lua.PRELUDE in shipped  # the helpers every script is loaded after
    names = [n for n in shipped if n != lua.PRELUDE]
    assert names == [
        "claim",
        "dispatch",
        "finish",
        "heartbeat",
        "outbox",
        "renew",
        "renew_held",
        "requeue",
        "stats",
        "take",
    ]
    for name in names:
        sha = client.script_load(lua.source(name))
        assert lua.register(client, name).sha == sha


def _kill_held_connection(client: redis.Redis, connections: lua.ThreadConnections) -> None:
    """Close this thread's held connection from the server's side, as a restart would. Only that one:
    killing every client would also cut the connections other tests' Celery pools keep."""
    conn = connections.get()
    conn.send_command("CLIENT", "ID")
    assert client.client_kill_filter(_id=conn.read_response()) == 1


def test_a_held_script_reloads_after_a_flush_and_reconnects_after_a_kill(client: redis.Redis) -> None:
    connections = lua.ThreadConnections(client)
    held = lua.HeldScript(lua.register(client, "heartbeat"), connections)
    assert held([KEYS.workers], ["w1", 30_000]) == 1
    client.script_flush()  # NOSCRIPT: loaded again, then sent again
    assert held([KEYS.workers], ["w2", 30_000]) == 2
    _kill_held_connection(client, connections)
    client.script_flush()  # a restarted server: the connection is gone and so is the script
    assert held([KEYS.workers], ["w3", 30_000]) == 3
    with pytest.raises(redis.ResponseError):  # a script's error is raised, the connection stays usable
        held([KEYS.workers], ["w4", "not a number"])
    assert held([KEYS.workers], ["w4", 30_000]) == 4


def test_a_held_connection_goes_back_to_the_pool_when_its_thread_ends(clean_redis: EmbeddedRedis) -> None:
    """Threads that come and go (a coordinator run in an application's thread, restarted) each
    hold a connection while they live; a pool of two serves any number of them one after another,
    and dropping the held scripts gives back what living threads held."""
    small = redis.Redis(port=clean_redis.port, max_connections=2)
    pool = small.connection_pool
    held = lua.HeldScript(lua.register(small, "heartbeat"), lua.ThreadConnections(small))
    beats = [threading_call(lambda i=i: held([KEYS.workers], [f"w{i}", 30_000])) for i in range(6)]
    assert beats == [1, 2, 3, 4, 5, 6]
    # Two threads alive at once hold both connections: a third finds the pool used up.
    started, release = threading.Barrier(3, timeout=30), threading.Event()

    def hold() -> None:
        held([KEYS.workers], ["holder", 30_000])
        started.wait()
        release.wait(30)

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
    try:
        for thread in holders:
            thread.start()
        started.wait()
        assert len(pool._in_use_connections) == 2
        with pytest.raises(redis.ConnectionError, match="Too many connections"):
            threading_call(lambda: held([KEYS.workers], ["third", 30_000]))
    finally:
        release.set()
    for thread in holders:
        thread.join(30)
    # This thread's own, from the pool again; given back when what holds it goes.
    mine = [lua.HeldScript(lua.register(small, "heartbeat"), lua.ThreadConnections(small))]
    assert mine[0]([KEYS.workers], ["after", 30_000]) >= 7
    assert len(pool._in_use_connections) == 1
    mine.clear()
    gc.collect()
    lua._give_back_ended()  # what the next call on any thread does first
    assert len(pool._in_use_connections) == 0
    small.close()


def test_a_held_connection_dropped_by_the_collector_inside_the_pools_lock_does_not_deadlock(
    clean_redis: EmbeddedRedis,
) -> None:
    """The collector may free the connections of living threads (a cycle holding the held scripts)
    while some thread is inside the pool's code with its lock held: giving them back right then
    would wait on that lock for good. They are given back by the next call instead."""
    pool: Any = cast("Any", redis.BlockingConnectionPool)(port=clean_redis.port, max_connections=2, timeout=1)
    blocking = redis.Redis(connection_pool=pool)
    cycle: list[Any] = [lua.HeldScript(lua.register(blocking, "heartbeat"), lua.ThreadConnections(blocking))]
    cycle.append(cycle)  # freed only by the collector
    box, ready, done = [cycle], threading.Event(), threading.Event()

    def hold() -> None:
        box[0][0]([KEYS.workers], ["holder", 30_000])
        ready.set()
        done.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert ready.wait(10)
        box.clear()
        del cycle
        collected = threading.Event()

        def collect_under_the_lock() -> None:
            with pool.pool.mutex:  # the queue's own lock, as inside get_connection or release
                gc.collect()
            collected.set()

        threading.Thread(target=collect_under_the_lock, daemon=True).start()
        assert collected.wait(10), "the collector's release waited on the pool's lock"
        assert blocking.ping()
        lua._give_back_ended()
        assert pool.pool.qsize() == 2, "the holder's connection is back in the pool"
    finally:
        done.set()
    holder.join(30)
    blocking.close()


def test_a_forked_process_takes_a_held_connection_of_its_own(client: redis.Redis) -> None:
    """A child forked from a process that holds a connection does not write to the parent's socket."""
    connections = lua.ThreadConnections(client)
    held = lua.HeldScript(lua.register(client, "heartbeat"), connections)
    assert held([KEYS.workers], ["parent", 30_000]) == 1
    parents = connections.get()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        try:
            beat = held([KEYS.workers], ["child", 30_000])
            own = connections.get() is not parents
            os.write(write, b"%d %d" % (own, beat))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 32) == b"1 2", "the child used the parent's connection"
    os.close(read)
    os.close(write)
    assert connections.get() is parents and held([KEYS.workers], ["parent", 30_000]) == 2


def threading_call(call: Any) -> Any:
    """``call()`` on a thread of its own; its exception raised here."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, call()))
        except Exception as exc:
            box.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def test_a_held_scripts_call_after_a_command_answers_both_and_reconnects(client: redis.Redis) -> None:
    """``after`` sends a command and the script's call in one write, as the coordinator's wait and
    take go: both replies come back, an error reply as a value (the call behind it still runs), a
    NOSCRIPT too (the next plain call loads the script), and a killed connection is reconnected."""
    connections = lua.ThreadConnections(client)
    held = lua.HeldScript(lua.register(client, "heartbeat"), connections)
    client.rpush("waited", "x")
    waited, beat = held.after(
        ("BLMOVE", "waited", "waited", "RIGHT", "RIGHT", 1), [KEYS.workers], ["w1", 30_000]
    )
    assert waited == b"x" and beat == 1
    t0 = time.monotonic()
    waited, beat = held.after(
        ("BLMOVE", "empty", "empty", "RIGHT", "RIGHT", 0.05), [KEYS.workers], ["w2", 30_000]
    )
    assert waited is None and beat == 2, "a wait that timed out, then the call"
    assert time.monotonic() - t0 < 4.0
    client.script_flush()
    waited, beat = held.after(("LLEN", "waited"), [KEYS.workers], ["w3", 30_000])
    assert waited == 1 and isinstance(beat, redis.exceptions.NoScriptError)
    assert held([KEYS.workers], ["w3", 30_000]) == 3  # loaded by the plain call
    waited, beat = held.after(
        ("BLMOVE", "waited", "waited", "UP", "RIGHT", 1), [KEYS.workers], ["w4", 30_000]
    )
    assert isinstance(waited, redis.ResponseError) and beat == 4
    _kill_held_connection(client, connections)
    waited, beat = held.after(("LLEN", "waited"), [KEYS.workers], ["w5", 30_000])
    assert waited == 1 and beat == 5


# --- take ------------------------------------------------------------------------------------


def test_take_drains_higher_priority_lists_first_and_oldest_first(
    client: redis.Redis, store: RequestStore
) -> None:
    enqueue(client, "low-1", "low-2")
    enqueue(client, "mid-1", step=3)
    enqueue(client, "high-1", "high-2", step=9)
    enqueue(client, "six-1", step=6)
    taken, reports = store.take(4)
    assert [i for i, _ in taken] == ["high-1", "high-2", "six-1", "mid-1"]
    assert reports == []
    assert client.llen(KEYS.request_queue) == 2  # the rest waits for the next take
    rest, _ = store.take(10)
    assert [i for i, _ in rest] == ["low-1", "low-2"]
    assert store.take(10) == ([], [])


def test_take_stops_at_its_byte_budget_and_leaves_the_rest_where_it_was(
    client: redis.Redis, store: RequestStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from carpool.redis_edge import store as store_module

    pad = "x" * 1000  # each message about 1.3 KB
    monkeypatch.setattr(store_module, "TAKE_MAX_BYTES", 2000)
    for task_id in ("h1", "h2", "h3", "h4"):
        client.lpush(request_list(9), message(task_id, pad=pad))
    for task_id in ("b1", "b2"):
        client.lpush(KEYS.request_queue, message(task_id, pad=pad))
    taken, _ = store.take(10)
    assert [i for i, _ in taken] == ["h1", "h2"], "up to the message that reaches 2,000 bytes"
    assert client.llen(request_list(9)) == 2 and store.in_flight() == 2
    taken, _ = store.take(10)
    assert [i for i, _ in taken] == ["h3", "h4"], "what was put back comes next, in order"
    taken, _ = store.take(10)
    assert [i for i, _ in taken] == ["b1", "b2"]
    assert store.in_flight() == 6 and store.queued() == 0

    # A budget reached by a list's last message: the next list is left as it is, untouched.
    client.lpush(request_list(9), message("p1", pad=pad), message("p2", pad=pad))
    client.lpush(KEYS.request_queue, message("q1"))
    popped_before = int(client.info("commandstats").get("cmdstat_rpop", {}).get("calls", 0))
    assert [i for i, _ in store.take(10)[0]] == ["p1", "p2"]
    assert int(client.info("commandstats")["cmdstat_rpop"]["calls"]) == popped_before + 1
    assert [i for i, _ in store.take(10)[0]] == ["q1"]

    # One message over the budget is taken alone, never left behind.
    client.lpush(KEYS.request_queue, message("big", pad="y" * 5000), message("after"))
    taken, _ = store.take(10)
    assert [i for i, _ in taken] == ["big"]
    assert [i for i, _ in store.take(10)[0]] == ["after"]


def test_take_keeps_the_raw_message_and_sets_a_lease(client: redis.Redis, store: RequestStore) -> None:
    raw = message("abc", extra_field="x")
    client.lpush(KEYS.request_queue, raw)
    taken, _ = store.take(10)
    assert taken == [("abc", raw)]
    assert client.hget(KEYS.inflight_raw, "abc") == raw
    assert_lease_about(client, "abc", LEASE_S)
    assert store.in_flight() == 1 and store.queued() == 0


def test_take_finds_ids_in_unusual_messages_and_names_garbage(
    client: redis.Redis, store: RequestStore
) -> None:
    decoy = message("real-id", id="decoy")  # two '"id": "' keys: decoded, headers.id wins
    no_id = b'{"headers": {"task": "carpool.infer"}}'
    not_json = b"\x00\xffnot json"
    empty_id = message("")  # never a field name: '' is the field that keeps a hash a hash table
    for raw in (decoy, no_id, not_json, empty_id):
        client.lpush(KEYS.request_queue, raw)
    taken, _ = store.take(10)
    ids = [i for i, _ in taken]
    assert ids[0] == "real-id"
    assert all(i.startswith("carpool-garbage-") for i in ids[1:])
    assert len(set(ids)) == 4  # named by the message's hash, so distinct messages stay distinct
    assert [client.hget(KEYS.inflight_raw, i) for i in ids] == [decoy, no_id, not_json, empty_id]
    assert all(lease(client, i) is not None for i in ids)


def test_take_reads_an_id_with_an_escape_in_its_json_form_as_its_caller_named_it(
    client: redis.Redis, store: RequestStore
) -> None:
    """Celery allows any task_id=; kombu's JSON escapes what is not printable ASCII, and quotes."""
    names = ["naïve-1", "東京", "a\\b", 'q"x', "plain-1"]
    for name in names:
        client.lpush(KEYS.request_queue, message(name))  # ensure_ascii, as kombu writes it
    taken, _ = store.take(10)
    assert [i for i, _ in taken] == names
    assert [client.hget(KEYS.inflight_raw, i) for i in names] == [message(n) for n in names]


def with_raw_id(raw_id: bytes, **extra: Any) -> bytes:
    """A message whose id is written as the bytes ``raw_id``, unescaped (a client writing UTF-8,
    or bytes that are not UTF-8)."""
    return message("RAW-ID", **extra).replace(b'"RAW-ID"', b'"' + raw_id + b'"')


def test_take_names_an_id_that_is_not_utf8_as_garbage_and_keeps_every_utf8_one(
    client: redis.Redis, store: RequestStore
) -> None:
    """Every process decodes the ids a take hands over (strict UTF-8, as Python's decoder): an id
    it would refuse is named as garbage, each read by the take's fast path, by a decode (a second
    id key) and by pattern (a message cjson refuses)."""
    utf8 = [
        "naïve".encode(),
        "東京".encode(),
        "😀".encode(),
        b"\xef\xbf\xbf",
        b"\xf4\x8f\xbf\xbf",
        b"\xed\x9f\xbf",
    ]
    invalid = [
        b"bad\xff\xfeid",
        b"\xc0\xaf",  # overlong
        b"\xe0\x80\xaf",  # overlong
        b"\xf0\x80\x80\xaf",  # overlong
        b"\xed\xa0\x80",  # a surrogate
        b"\xf4\x90\x80\x80",  # past U+10FFFF
        b"\xf5\x80\x80\x80",
        b"\xc3",  # cut short
        b"\xe2\x82",
        b"a\x80b",  # a lone continuation byte
        b"ok\xc3(",
    ]
    rng = random.Random(5)
    alphabet = [b for b in range(0x20, 0x100) if b not in b'"\\']
    fuzz = [bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(400)]
    for raw_ids in (utf8 + invalid, fuzz):
        # each id three ways (distinct ids: an ASCII suffix keeps bytes UTF-8 or not as they were)
        ids = [i + suffix for i in dict.fromkeys(raw_ids) for suffix in (b"", b"-d", b"-p")]
        raws = []
        for raw_id in ids:
            extra: dict[str, Any] = {"id": "decoy"} if raw_id.endswith(b"-d") else {}
            if raw_id.endswith(b"-p"):
                extra["bad"] = "\ud800"  # a lone surrogate escape: cjson refuses the message
            raws.append(with_raw_id(raw_id, **extra))
        client.lpush(KEYS.request_queue, *raws)  # taken in this order
        taken, _ = store.take(len(raws))  # raises where an id that is not UTF-8 comes back
        assert [raw for _, raw in taken] == raws
        for (request_id, raw), raw_id in zip(taken, ids, strict=True):
            if not_utf8(raw_id):
                assert request_id.startswith("carpool-garbage-"), (raw_id, request_id)
            else:
                assert request_id == raw_id.decode(), (raw_id, request_id)
            assert client.hget(KEYS.inflight_raw, request_id) == raw and lease(client, request_id)
        client.delete(KEYS.inflight_raw, KEYS.inflight_lease)
    assert any(not_utf8(i) for i in fuzz) and any(not not_utf8(i) and max(i) > 0x7F for i in fuzz)


def not_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return True
    return False


def test_take_records_the_origin_of_requests_from_priority_lists_only(
    client: redis.Redis, store: RequestStore
) -> None:
    enqueue(client, "low")
    enqueue(client, "three", step=3)
    enqueue(client, "nine", step=9)
    taken, _ = store.take(10)
    assert [i for i, _ in taken] == ["nine", "three", "low"]
    assert client.hgetall(KEYS.inflight_origin) == {
        b"nine": request_list(9).encode(),
        b"three": request_list(3).encode(),
    }


def test_take_pops_this_coordinators_reports_only_when_asked(
    client: redis.Redis, store: RequestStore
) -> None:
    mine = KEYS.reports_for("coord-a")
    for n in range(3):
        client.lpush(mine, json.dumps({"batch_id": f"b{n}"}))
    client.lpush(KEYS.reports_for("coord-b"), json.dumps({"batch_id": "theirs"}))
    enqueue(client, "r1")
    taken, reports = store.take(10)  # no reports asked
    assert [i for i, _ in taken] == ["r1"] and reports == []
    assert client.llen(mine) == 3
    _, reports = store.take(10, reports_of="coord-a", max_reports=2)
    assert [r["batch_id"] for r in reports] == ["b0", "b1"]  # oldest first
    _, reports = store.take(10, reports_of="coord-a")
    assert [r["batch_id"] for r in reports] == ["b2"]
    assert client.llen(mine) == 0 and client.llen(KEYS.reports_for("coord-b")) == 1


def test_wait_then_take_takes_the_moment_the_wait_ends(client: redis.Redis, store: RequestStore) -> None:
    """The take runs behind the wait in one pipeline: at once when a request is there, after a push
    ends the wait, and also after a wait that timed out (other lists are looked at then)."""
    client.script_flush()  # as after a restart: the take is left to the caller, who loads it
    assert store.wait_then_take(KEYS.request_queue, 0.01, 10) == (None, None)
    store.take(0)  # loads it
    enqueue(client, "r1")
    error, taken = store.wait_then_take(KEYS.request_queue, 5.0, 10)
    assert error is None and taken == ([("r1", message("r1"))], [])
    assert_lease_about(client, "r1", LEASE_S)

    pusher = redis.Redis(port=client.connection_pool.connection_kwargs["port"])
    timer = threading.Timer(0.2, enqueue, (pusher, "r2"))
    timer.start()
    t0 = time.monotonic()
    error, taken = store.wait_then_take(KEYS.request_queue, 5.0, 10)
    timer.join()
    pusher.close()
    assert error is None and [i for i, _ in (taken or ([], []))[0]] == ["r2"]
    assert time.monotonic() - t0 < 4.0, "the push ended the wait"

    enqueue(client, "nine", step=9)  # not the list waited on: taken when the wait times out
    error, taken = store.wait_then_take(KEYS.request_queue, 0.05, 10)
    assert error is None and [i for i, _ in (taken or ([], []))[0]] == ["nine"]
    assert store.queued() == 0 and store.in_flight() == 3


# --- dispatch --------------------------------------------------------------------------------


def test_dispatch_records_owners_of_requests_still_in_flight(
    client: redis.Redis, store: RequestStore
) -> None:
    short = RequestStore(client, KEYS, 1)
    in_flight(short, "x", "y", "z")
    events = subscribed(client, "events")
    assigned = store.dispatch(
        "batches",
        [("b1", ["x", "y", "gone"], b"batch-1 message"), ("b2", ["z"], b"batch-2 message")],
        events=("events", b"the events"),
    )
    assert assigned == 3
    assert requests_in(client, KEYS.inflight_owner) == {b"x": b"b1", b"y": b"b1", b"z": b"b2"}
    assert not forgotten(client, "x") and forgotten(client, "gone")  # not in flight: not recorded
    for task_id in ("x", "y", "z"):
        assert_lease_about(client, task_id, LEASE_S)  # renewed with the dispatching store's lease
    assert client.rpop("batches", 2) == [b"batch-1 message", b"batch-2 message"]
    assert published(events, 1) == [(b"events", b"the events")]
    events.close()


def test_the_owner_and_claimed_hashes_stay_hash_tables_however_few_requests_they_hold(
    client: redis.Redis, store: RequestStore
) -> None:
    # A hash of a few short fields would be one flat list searched end to end on every access.
    for round_ in range(2):
        in_flight(store, "x", "y")
        store.dispatch("batches", [(f"b{round_}", ["x", "y"], b"m")])
        store.claim(f"b{round_}", ["x"])
        for key in (KEYS.inflight_owner, KEYS.inflight_claimed):
            assert client.object("encoding", key) == b"hashtable", key
        assert requests_in(client, KEYS.inflight_owner) == {
            b"x": f"b{round_}".encode(),
            b"y": f"b{round_}".encode(),
        }
        assert requests_in(client, KEYS.inflight_claimed) == {b"x": f"b{round_}".encode()}
        finish(store, ack_ids=["x", "y"])
        assert forgotten(client, "x") and forgotten(client, "y")
        for key in (KEYS.inflight_owner, KEYS.inflight_claimed):
            assert requests_in(client, key) == {} and client.object("encoding", key) == b"hashtable", key


def test_dispatch_and_claim_keep_a_lease_renewed_lately(client: redis.Redis, store: RequestStore) -> None:
    # Moving a lease costs Redis a skiplist move: one with seven eighths of its length left stays.
    in_flight(store, "r")
    taken = lease(client, "r")
    time.sleep(0.01)
    assert store.dispatch("q", [("b1", ["r"], b"m")]) == 1
    assert lease(client, "r") == taken
    time.sleep(0.01)
    assert store.claim("b1", ["r"]) == [True]
    assert lease(client, "r") == taken


def test_dispatch_and_claim_renew_a_short_lease_even_when_fresh(client: redis.Redis) -> None:
    # A worker renews once a second: a lease kept must also have two seconds left.
    short = RequestStore(client, KEYS, 1.5)
    in_flight(short, "r")
    taken = lease(client, "r")
    time.sleep(0.01)
    assert short.dispatch("q", [("b1", ["r"], b"m")]) == 1
    dispatched = lease(client, "r")
    assert taken is not None and dispatched is not None and dispatched > taken
    time.sleep(0.01)
    assert short.claim("b1", ["r"]) == [True]
    claimed = lease(client, "r")
    assert claimed is not None and claimed > dispatched


def test_dispatch_without_events_publishes_nothing(client: redis.Redis, store: RequestStore) -> None:
    in_flight(store, "x")
    events = subscribed(client, "events")
    assert store.dispatch("batches", [("b1", ["x"], b"m")]) == 1
    assert published(events) == []
    assert client.lrange("batches", 0, -1) == [b"m"]
    events.close()


# --- renew_held ------------------------------------------------------------------------------


def test_renew_held_renews_all_but_what_a_worker_claimed(client: redis.Redis) -> None:
    short = RequestStore(client, KEYS, 1)
    long = RequestStore(client, KEYS, LEASE_S)
    in_flight(short, "held", "dispatched", "claimed", "reclaimed")
    short.dispatch("q", [("b1", ["dispatched", "claimed", "reclaimed"], b"m1")])
    assert short.claim("b1", ["claimed", "reclaimed"]) == [True, True]
    short.dispatch("q", [("b2", ["reclaimed"], b"m2")])  # a new owner supersedes the old claim
    before = lease(client, "claimed")
    assert long.renew_held(["held", "dispatched", "claimed", "reclaimed", "not-in-flight"]) == 3
    for task_id in ("held", "dispatched", "reclaimed"):
        assert_lease_about(client, task_id, LEASE_S)
    assert lease(client, "claimed") == before
    assert lease(client, "not-in-flight") is None  # never added
    assert long.renew_held([]) == 0


# --- claim / claim_fresh ---------------------------------------------------------------------


def test_claim_takes_only_what_the_batch_still_owns(client: redis.Redis) -> None:
    short = RequestStore(client, KEYS, 1)
    worker = RequestStore(client, KEYS, LEASE_S)
    in_flight(short, "mine", "stale", "theirs")
    short.dispatch("q", [("old", ["stale"], b"m0"), ("b1", ["mine", "theirs"], b"m1")])
    short.dispatch("q", [("b2", ["theirs"], b"m2")])  # moved to another batch
    assert worker.claim("b1", ["mine", "theirs", "stale", "unknown"]) == [True, False, False, False]
    assert requests_in(client, KEYS.inflight_claimed) == {b"mine": b"b1"}
    assert_lease_about(client, "mine", LEASE_S)
    assert worker.claim("b1", ["mine"]) == [True]  # the same batch claiming again still owns it
    assert worker.claim("b1", []) == []


def test_claim_refuses_a_request_no_longer_in_flight(client: redis.Redis, store: RequestStore) -> None:
    in_flight(store, "r")
    store.dispatch("q", [("b1", ["r"], b"m")])
    client.zrem(KEYS.inflight_lease, "r")  # owner left behind, lease gone
    assert store.claim("b1", ["r"]) == [False]
    assert not client.hexists(KEYS.inflight_claimed, "r")


def test_claim_fresh_also_says_which_are_answered(
    client: redis.Redis, results: redis.Redis, store: RequestStore
) -> None:
    in_flight(store, "fresh", "answered", "elsewhere")
    store.dispatch("q", [("b1", ["fresh", "answered"], b"m1"), ("b2", ["elsewhere"], b"m2")])
    results.set("result:answered", b"done")
    results.set("result:elsewhere", b"done")
    ids = ["fresh", "answered", "elsewhere"]
    claimed = store.claim_fresh("b1", ids, [f"result:{i}" for i in ids], RESULTS_DB)
    assert claimed == Claimed([1, 2, 0], 0)
    assert requests_in(client, KEYS.inflight_claimed) == {b"fresh": b"b1", b"answered": b"b1"}
    assert client.get("result:answered") is None  # the caller's database is still the broker's
    assert store.claim_fresh("b1", [], [], RESULTS_DB) == Claimed([], 0)


def test_claim_fresh_counts_the_batches_queued_on_the_lists_named(
    client: redis.Redis, store: RequestStore
) -> None:
    in_flight(store, "a", "b", "c")
    store.dispatch("q", [("b1", ["a"], b"m1"), ("b2", ["b"], b"m2")])
    store.dispatch("other", [("b3", ["c"], b"m3")])
    client.rpop("q")  # the worker's BRPOP took b1's message
    assert store.claim_fresh("b1", ["a"], ["result:a"], RESULTS_DB, ["q"]).batches_queued == 1
    assert store.claim_fresh("b2", ["b"], ["result:b"], RESULTS_DB, ["q", "other"]) == Claimed([1], 2)


def test_claim_fresh_takes_the_next_batch_message_where_brpop_would_and_only_a_marked_one(
    client: redis.Redis, store: RequestStore
) -> None:
    in_flight(store, "a", "b")
    store.dispatch("q", [("b1", ["a"], b"m1 carpool.run_batch"), ("b2", ["b"], b"m2 carpool.run_batch")])
    client.rpush("q", b"m0 carpool.run_batch")  # at the end BRPOP takes from: the next delivered
    client.rpush("other", b"other task")
    claimed = store.claim_fresh("b1", ["a"], ["result:a"], RESULTS_DB, ["empty", "q"], "carpool.run_batch")
    assert claimed == Claimed([1], 3, ("q", b"m0 carpool.run_batch")), "counted before the take"
    assert client.lrange("q", 0, -1) == [b"m2 carpool.run_batch", b"m1 carpool.run_batch"]
    # Not asked to take, or the next message not marked: nothing moves.
    assert store.claim_fresh("b1", ["a"], ["result:a"], RESULTS_DB, ["q"]).taken is None
    assert store.claim_fresh(
        "b1", ["a"], ["result:a"], RESULTS_DB, ["other", "q"], "carpool.run_batch"
    ) == Claimed([1], 3), "the first list holding any decides, as BRPOP's order would"
    assert client.llen("q") == 2 and client.lrange("other", 0, -1) == [b"other task"]
    assert store.claim_fresh("b2", ["b"], ["result:b"], RESULTS_DB, ["q"], "carpool.run_batch").taken == (
        "q",
        b"m1 carpool.run_batch",
    )


# --- finish ----------------------------------------------------------------------------------


def finish(store: RequestStore, **overrides: Any) -> list[int]:
    args: dict[str, Any] = {
        "results_db": RESULTS_DB,
        "broker_db": 0,
        "writes": ResultWrites([], [], 60),
        "ack_ids": [],
        "report": None,
        "coordinator": "coord",
        "events": None,
    }
    args.update(overrides)
    return store.finish(**args)


def test_finish_stores_write_once_and_publishes_once(
    client: redis.Redis, results: redis.Redis, store: RequestStore
) -> None:
    channels = subscribed(client, "res:1", "res:2")
    first = ResultWrites(["res:1"], [b"first"], 60)
    assert finish(store, writes=first) == [1]
    again = ResultWrites(["res:1", "res:2"], [b"second", b"other"], 60)
    assert finish(store, writes=again) == [2]
    assert results.get("res:1") == b"first" and results.get("res:2") == b"other"
    assert 55 < results.ttl("res:1") <= 60
    assert client.exists("res:1", "res:2") == 0  # results went to the results database only
    assert published(channels, 2) == [(b"res:1", b"first"), (b"res:2", b"other")]
    channels.close()


def test_finish_publishes_the_results_it_stores_to_their_inboxes_too(
    client: redis.Redis, results: redis.Redis, store: RequestStore
) -> None:
    channels = subscribed(client, "box:1", "box:2", "elsewhere", "res:4")
    results.set("res:2", b'{"n":"earlier"}')  # answered already: write-once keeps it out of the inbox
    writes = ResultWrites(
        ["res:1", "res:2", "res:3", "res:4", "res:5", "res:6"],
        [b'{"n":1}', b'{"n":2}', b'{"n":3}', b'{"n":4}', b'{"n":5}', b'{"n":6}'],
        60,
        ["box:1", "box:1", "box:2", "", "box:1", "elsewhere"],
        "box:",
    )
    in_flight(store, "a")
    assert finish(store, writes=writes, ack_ids=["a"], events=("events", b"ev")) == [1, 3, 4, 5, 6]
    # Each result's own channel as ever, and its inbox; none outside the prefix.
    assert published(channels, 4) == [
        (b"box:1", b'{"n":1}'),
        (b"box:2", b'{"n":3}'),
        (b"res:4", b'{"n":4}'),
        (b"box:1", b'{"n":5}'),
    ]
    assert json.loads(results.get("res:5") or b"") == {"n": 5} and forgotten(client, "a")
    channels.close()
    with pytest.raises(ValueError, match="one inbox per result"):
        finish_call(ResultWrites(["k"], [b"{}"], 60, ["box:1", "box:2"], "box:"))


def test_finish_files_the_links_of_the_results_it_stores_and_a_resend_files_nothing(
    client: redis.Redis, results: redis.Redis, store: RequestStore
) -> None:
    results.set("res:2", b"earlier")  # answered already: its links are the first run's to send
    writes = ResultWrites(["res:1", "res:2", "res:3"], [b"one", b"two", b"three"], 60)
    outbox = [(1, "a", b"links of a"), (2, "b", b"links of b")]
    in_flight(store, "a", "b", "c")
    before = now_ms(client)
    assert finish(store, writes=writes, ack_ids=["a", "b", "c"], outbox=outbox) == [1, 3]
    assert client.hgetall(KEYS.links_pending) == {b"a": b"links of a"}
    due = client.zscore(KEYS.links_due, "a")
    assert due is not None and before + LEASE_S * 1000 <= due <= now_ms(client) + LEASE_S * 1000
    store.links_sent(["a"])  # the worker sent them
    assert client.exists(KEYS.links_due, KEYS.links_pending) == 0
    # Sent again (its reply lost): the results count as stored, but what the worker sent and
    # emptied is not filed again.
    assert finish(store, writes=writes, ack_ids=["a", "b", "c"], outbox=outbox) == [1, 3]
    assert client.exists(KEYS.links_due, KEYS.links_pending) == 0
    with pytest.raises(ValueError, match="the links outbox needs the in-flight keys"):
        finish_call(writes, outbox=outbox)


def test_the_outbox_hands_each_due_entry_to_one_caller_and_again_a_lease_later(
    client: redis.Redis, store: RequestStore
) -> None:
    short = RequestStore(client, KEYS, 1)
    in_flight(short, "a", "b")
    writes = ResultWrites(["res:a", "res:b"], [b"A", b"B"], 60)
    outbox = [(1, "a", b"entry a"), (2, "b", b"entry b")]
    assert finish(short, writes=writes, ack_ids=["a", "b"], outbox=outbox) == [1, 2]
    assert short.links_due() == LinksDue([], []), "not due while the worker may still send them"
    time.sleep(1.1)
    client.hdel(KEYS.links_pending, "b")  # emptied between the worker's two writes
    assert short.links_due() == LinksDue([("a", b"entry a")], [])
    assert client.zrange(KEYS.links_due, 0, -1) == [b"a"], "an id with no entry is dropped"
    assert short.links_due().entries == [], "leased to the caller that took it"
    time.sleep(1.1)  # that caller died: due again
    assert short.links_due(limit=5).entries == [("a", b"entry a")]
    short.links_sent(["a"])
    assert client.exists(KEYS.links_due, KEYS.links_pending, KEYS.links_tries) == 0


def test_an_outbox_entry_is_dropped_after_its_tries_and_a_renewed_one_is_not_due(
    client: redis.Redis, store: RequestStore
) -> None:
    """An entry whose links kill (or hang) each coordinator that sends them is taken LINKS_TRIES
    times, then dropped; one whose sender lives and renews it is never handed to another."""
    short = RequestStore(client, KEYS, 1)
    in_flight(short, "a", "b")
    writes = ResultWrites(["res:a", "res:b"], [b"A", b"B"], 60)
    finish(short, writes=writes, ack_ids=["a", "b"], outbox=[(1, "a", b"entry a"), (2, "b", b"entry b")])
    for taken in range(1, LINKS_TRIES + 1):
        time.sleep(1.1)  # due (again): its last taker died
        short.links_renew(["b"])  # b's sender lives and renews it
        assert short.links_due() == LinksDue([("a", b"entry a")], []), f"take {taken}"
        assert client.hget(KEYS.links_tries, "a") == str(taken).encode()
    time.sleep(1.1)
    short.links_renew(["b"])
    assert short.links_due() == LinksDue([], ["a"])
    assert client.hget(KEYS.links_pending, "a") is None and client.zscore(KEYS.links_due, "a") is None
    assert client.hget(KEYS.links_tries, "a") is None
    assert client.zscore(KEYS.links_due, "b") is not None, "never taken while renewed"
    short.links_renew(["gone"])  # an entry no longer there is not filed by a renewal
    assert client.zscore(KEYS.links_due, "gone") is None


def test_a_take_given_back_is_no_try_and_emptying_outlives_an_acl_without_the_tries_key(
    client: redis.Redis, clean_redis: EmbeddedRedis
) -> None:
    """A coordinator whose sends met an outage gives its take back (no try spent on it); a worker
    whose ACL predates the tries' count still empties its entries (only the count's delete is
    refused)."""
    short = RequestStore(client, KEYS, 1)
    in_flight(short, "a")
    finish(short, writes=ResultWrites(["res:a"], [b"A"], 60), ack_ids=["a"], outbox=[(1, "a", b"entry a")])
    time.sleep(1.1)
    assert short.links_due().entries == [("a", b"entry a")]
    assert client.hget(KEYS.links_tries, "a") == b"1"
    short.links_untried(["a", "gone"])
    assert client.hget(KEYS.links_tries, "a") == b"0"
    assert client.hget(KEYS.links_tries, "gone") is None, "no count made for an entry not there"
    client.acl_setuser(
        "old-rules",
        enabled=True,
        passwords=["+pw"],
        commands=["+@all"],
        keys=[KEYS.links_due, KEYS.links_pending],
    )
    old = redis.Redis(port=clean_redis.port, username="old-rules", password="pw")
    try:
        RequestStore(old, KEYS, 1).links_sent(["a"])
    finally:
        old.close()
        client.acl_deluser("old-rules")
    assert client.exists(KEYS.links_due, KEYS.links_pending) == 0, "the entry emptied all the same"


def test_finish_forgets_acked_ids_everywhere_and_keeps_the_rest(
    client: redis.Redis, store: RequestStore
) -> None:
    in_flight(store, "a", "b", "keep")
    store.dispatch("q", [("b1", ["a", "b", "keep"], b"m")])
    store.claim("b1", ["a", "b", "keep"])
    finish(store, ack_ids=["a", "b"])
    assert forgotten(client, "a") and forgotten(client, "b")
    assert client.hget(KEYS.inflight_claimed, "keep") == b"b1"
    assert client.hget(KEYS.inflight_owner, "keep") == b"b1"
    assert lease(client, "keep") is not None


def test_finish_forgets_the_origin_of_a_priority_request(client: redis.Redis, store: RequestStore) -> None:
    in_flight(store, "urgent", step=9)
    store.dispatch("q", [("b1", ["urgent"], b"m")])
    store.claim("b1", ["urgent"])
    assert client.hexists(KEYS.inflight_origin, "urgent")
    finish(store, ack_ids=["urgent"])
    assert forgotten(client, "urgent")


def test_finish_acks_more_ids_than_one_unpack_holds(client: redis.Redis, store: RequestStore) -> None:
    ids = [f"r{i}" for i in range(2_500)]
    with client.pipeline(transaction=False) as pipe:
        for i in ids:
            pipe.lpush(KEYS.request_queue, message(i))
        pipe.execute()
    taken, _ = store.take(len(ids))
    assert len(taken) == len(ids)
    store.dispatch("q", [("b1", ids, b"m")])
    store.claim("b1", ids)
    finish(store, ack_ids=ids)
    for key in (KEYS.inflight_lease, KEYS.inflight_raw):
        assert client.exists(key) == 0, key
    for key in (KEYS.inflight_owner, KEYS.inflight_claimed):
        assert requests_in(client, key) == {}, key


def test_every_in_flight_script_handles_more_ids_than_one_unpack_holds(
    client: redis.Redis, results: redis.Redis, store: RequestStore
) -> None:
    # Each script reads and writes in variadic chunks: several chunks must act like one.
    ids = [f"r{i}" for i in range(2_500)]
    with client.pipeline(transaction=False) as pipe:
        for i in ids:
            pipe.lpush(request_list(9), message(i))
        pipe.execute()
    assert [i for i, _ in store.take(len(ids))[0]] == ids
    assert client.hlen(KEYS.inflight_origin) == len(ids)
    assert store.dispatch("q", [("b1", ids[:1_700], b"m1"), ("b2", [*ids[1_700:], "gone"], b"m2")]) == 2_500
    assert client.hget(KEYS.inflight_owner, ids[1_699]) == b"b1"
    assert client.hget(KEYS.inflight_owner, ids[1_700]) == b"b2"
    results.set(f"result:{ids[1_500]}", b"done")
    claimed = store.claim_fresh("b1", ids, [f"result:{i}" for i in ids], RESULTS_DB)
    assert claimed.flags == [1] * 1_500 + [2] + [1] * 199 + [0] * 800
    assert len(requests_in(client, KEYS.inflight_claimed)) == 1_700
    assert store.renew_held(ids) == 800
    store.renew_running(ids[:1_700])
    assert_lease_about(client, ids[0], LEASE_S)
    assert store.requeue([*ids, ids[0]]) == 2_500
    assert all(requests_in(client, key) == {} for key in (KEYS.inflight_owner, KEYS.inflight_claimed))
    assert all(
        client.exists(key) == 0 for key in (KEYS.inflight_lease, KEYS.inflight_raw, KEYS.inflight_origin)
    )
    assert client.llen(request_list(9)) == 2_500


def test_finish_pushes_the_report_and_trims_the_list(client: redis.Redis, store: RequestStore) -> None:
    reports = KEYS.reports_for("coord")
    with client.pipeline(transaction=False) as pipe:
        for n in range(REPORTS_KEPT):
            pipe.lpush(reports, json.dumps({"old": n}))
        pipe.execute()
    finish(store, report={"batch_id": "b9", "size": 3})
    assert client.llen(reports) == REPORTS_KEPT
    assert json.loads(as_bytes(client.lindex(reports, 0))) == {"batch_id": "b9", "size": 3}
    assert json.loads(as_bytes(client.lindex(reports, -1))) == {"old": 1}  # the oldest went
    assert REPORTS_TTL_S - 60 < client.ttl(reports) <= REPORTS_TTL_S
    _, popped = store.take(0, reports_of="coord", max_reports=REPORTS_KEPT)
    assert popped[-1] == {"batch_id": "b9", "size": 3}


def test_finish_without_report_or_events_touches_neither(client: redis.Redis, store: RequestStore) -> None:
    events = subscribed(client, "events")
    finish(store, writes=ResultWrites(["res:x"], [b"x"], 60), ack_ids=["nothing"])
    assert client.exists(KEYS.reports_for("coord")) == 0
    assert published(events) == []
    events.close()


def test_finish_publishes_the_events_after_the_results(client: redis.Redis, store: RequestStore) -> None:
    channels = subscribed(client, "res:e", "events")
    finish(store, writes=ResultWrites(["res:e"], [b"e"], 60), events=("events", b"ev"))
    assert published(channels, 2) == [(b"res:e", b"e"), (b"events", b"ev")]
    channels.close()
    # With a result refused (answered meanwhile) the events would say what its caller never gets:
    # not published; the worker sends them corrected.
    channels = subscribed(client, "res:f", "res:e", "events")
    assert finish(
        store, writes=ResultWrites(["res:e", "res:f"], [b"e2", b"f"], 60), events=("events", b"ev")
    ) == [2]
    assert published(channels, 1) == [(b"res:f", b"f")]
    channels.close()


def test_finish_with_results_only_stores_in_the_callers_database(results: redis.Redis) -> None:
    """The result backend's ``store_many`` mode: no acks, no report, no events, no SELECT."""
    script = lua.register(results, "finish")
    channels = subscribed(results, "res:only")
    keys, args = finish_call(ResultWrites(["res:only", "res:only"], [b"one", b"two"], 60))
    assert keys == ["res:only", "res:only"]
    assert script(keys=keys, args=args) == [1]  # the second write of the same key is refused
    assert results.get("res:only") == b"one"
    assert published(channels, 1) == [(b"res:only", b"one")]
    assert results.dbsize() == 1
    channels.close()


def test_ack_and_dead_letter_forget_every_key(client: redis.Redis, store: RequestStore) -> None:
    """The pipelined acknowledgements (results on another server, dead letters) match finish's."""
    in_flight(store, "a", "b", "bad", step=6)
    store.dispatch("q", [("b1", ["a", "b"], b"m")])
    store.claim("b1", ["a", "b"])
    store.ack(["a", "b"], report={"batch_id": "b1"}, coordinator="coord")
    store.dead_letter("bad", b"not a request", "why")
    assert all(forgotten(client, i) for i in ("a", "b", "bad"))
    assert json.loads(as_bytes(client.lindex(KEYS.reports_for("coord"), 0))) == {"batch_id": "b1"}
    assert json.loads(as_bytes(client.lindex(KEYS.dead_letter, 0)))["id"] == "bad"


# --- renew -----------------------------------------------------------------------------------


def test_renew_running_extends_only_requests_still_in_flight(client: redis.Redis) -> None:
    in_flight(RequestStore(client, KEYS, 1), "running")
    RequestStore(client, KEYS, LEASE_S).renew_running(["running", "acked-meanwhile"])
    assert_lease_about(client, "running", LEASE_S)
    assert lease(client, "acked-meanwhile") is None


# --- requeue / reap --------------------------------------------------------------------------


def test_requeue_puts_requests_back_verbatim_at_the_front(client: redis.Redis, store: RequestStore) -> None:
    taken = dict(in_flight(store, "a", "b"))
    store.dispatch("q", [("b1", ["a", "b"], b"m")])
    store.claim("b1", ["a"])
    enqueue(client, "waiting")
    assert store.requeue(["a", "b", "unknown"]) == 2
    assert forgotten(client, "a") and forgotten(client, "b")
    again, _ = store.take(10)
    assert [i for i, _ in again] == ["a", "b", "waiting"]  # in the order given, ahead of the rest
    assert dict(again[:2]) == taken  # verbatim
    assert store.requeue([]) == 0


def test_requeue_puts_each_request_back_on_the_list_it_came_from(
    client: redis.Redis, store: RequestStore
) -> None:
    enqueue(client, "low")
    enqueue(client, "three", step=3)
    enqueue(client, "nine-a", "nine-b", step=9)
    raws = dict(store.take(10)[0])
    enqueue(client, "nine-later", step=9)  # sent while the others were in flight
    assert store.requeue(list(raws)) == 4
    assert all(forgotten(client, i) for i in raws)
    assert client.lrange(request_list(0), 0, -1) == [raws["low"]]
    assert client.lrange(request_list(3), 0, -1) == [raws["three"]]
    assert client.llen(request_list(6)) == 0
    # At the front of its list: served before what was sent at its priority meanwhile.
    again, _ = store.take(10)
    assert [i for i, _ in again[2:]] == ["nine-later", "three", "low"]
    assert again[:2] == [("nine-a", raws["nine-a"]), ("nine-b", raws["nine-b"])]  # verbatim, in order


def test_requeue_puts_a_request_with_an_unknown_origin_on_the_base_list(
    client: redis.Redis, store: RequestStore
) -> None:
    raws = dict(in_flight(store, "odd", step=9))
    client.hset(KEYS.inflight_origin, "odd", "some.other.list")
    assert store.requeue(["odd"]) == 1
    assert client.lrange(request_list(0), 0, -1) == [raws["odd"]]
    assert client.exists("some.other.list", request_list(9)) == 0
    assert forgotten(client, "odd")


def test_reap_returns_expired_priority_requests_to_their_lists(client: redis.Redis) -> None:
    dying = RequestStore(client, KEYS, 0.05)
    alive = RequestStore(client, KEYS, LEASE_S)
    low = dict(in_flight(dying, "low"))
    high = dict(in_flight(dying, "high", step=9))
    dying.dispatch("q", [("b1", ["low", "high"], b"m")])
    dying.claim("b1", ["high"])
    in_flight(alive, "live", step=9)
    time.sleep(0.2)
    assert alive.reap() == 2
    assert forgotten(client, "low") and forgotten(client, "high")
    assert client.lrange(request_list(0), 0, -1) == [low["low"]]
    assert client.lrange(request_list(9), 0, -1) == [high["high"]]
    assert client.hget(KEYS.inflight_origin, "live") == request_list(9).encode()  # not expired: kept


def test_reap_requeues_only_expired_leases_and_cleans_every_key(client: redis.Redis) -> None:
    dying = RequestStore(client, KEYS, 0.05)
    alive = RequestStore(client, KEYS, LEASE_S)
    raws = dict(in_flight(dying, "d1", "d2", "d3"))
    dying.dispatch("q", [("b1", ["d1", "d2"], b"m")])
    dying.claim("b1", ["d1"])
    in_flight(alive, "live")
    time.sleep(0.2)
    assert alive.reap(limit=2) == 2
    assert alive.reap() == 1
    assert alive.reap() == 0
    for task_id in raws:
        assert forgotten(client, task_id)
    assert lease(client, "live") is not None
    back = client.lrange(KEYS.request_queue, 0, -1)
    assert sorted(back) == sorted(raws.values())


def test_reap_counts_a_death_for_each_request_of_a_batch_begun_on_the_device_until_it_is_answered(
    client: redis.Redis,
) -> None:
    dying = RequestStore(client, KEYS, 0.05)
    alive = RequestStore(client, KEYS, LEASE_S)
    marks = DeviceMarks(client, KEYS.inflight_running)
    in_flight(dying, "ran", "ran-too", "dispatched", "held", "waiting", "stored")
    dying.dispatch(
        "q",
        [("b1", ["ran", "ran-too", "dispatched"], b"m"), ("b0", ["waiting"], b"m"), ("b9", ["stored"], b"m")],
    )
    # The worker claimed three batches: it ran b9 and was storing its results, began b1 on the device
    # and died running it, with b0 waiting behind; "dispatched" (b1's) it never claimed.
    dying.claim("b1", ["ran", "ran-too"])
    dying.claim("b0", ["waiting"])
    dying.claim("b9", ["stored"])
    marks.begin("b9")
    marks.end("b9")
    marks.begin("b1")
    time.sleep(0.2)
    assert client.zrange(KEYS.inflight_running, 0, -1) == [b"b1"]  # the marks were sent, not awaited
    assert alive.reap() == 6
    assert client.hgetall(KEYS.inflight_deaths) == {b"ran": b"1", b"ran-too": b"1"}
    assert client.zrange(KEYS.inflight_running, 0, -1) == [b"b1"], "a dead worker's mark stays"
    taken, _ = alive.take(10)  # back in flight: the take says which a worker died running, and how often
    assert sorted(i for i, _ in taken) == ["dispatched", "held", "ran", "ran-too", "stored", "waiting"]
    assert alive.deaths == {"ran": 1, "ran-too": 1}
    alive.deaths.clear()
    back = ["ran", "ran-too", "dispatched", "held", "stored", "waiting"]
    alive.requeue(back)  # a shutdown's hand-back is no death
    assert client.hgetall(KEYS.inflight_deaths) == {b"ran": b"1", b"ran-too": b"1"}
    dying.take(10)
    dying.dispatch("q", [("b2", ["ran"], b"m")])
    dying.claim("b2", ["ran"])
    marks.begin("b2")
    time.sleep(0.2)
    alive.reap()
    alive.take(10)
    assert alive.deaths == {"ran": 2, "ran-too": 1}
    finish(alive, ack_ids=["ran"])  # answered: a worker's finish forgets its count
    alive.ack(["ran-too"])  # and so does the coordinator's acknowledgement of an answer
    assert not client.exists(KEYS.inflight_deaths), "the hash lives only while some request has a count"


def test_reap_counts_a_death_for_the_requests_of_a_marked_batch_whose_leases_run_out_later(
    client: redis.Redis, store: RequestStore
) -> None:
    """A claim leaves a lease with seven eighths of its length as it is, so the leases of one batch
    run out apart and two reaps put its requests back: both count them."""
    in_flight(store, "first", "poison", "second")
    store.dispatch("q", [("b1", ["first", "poison", "second"], b"m")])
    assert store.claim("b1", ["first", "poison", "second"]) == [True, True, True]
    DeviceMarks(client, KEYS.inflight_running).begin("b1")
    past = int(time.time() * 1000) - 1000  # the Redis server runs on this host's clock
    client.zadd(KEYS.inflight_lease, {"first": past}, xx=True)
    assert store.reap() == 1
    assert client.hgetall(KEYS.inflight_deaths) == {b"first": b"1"}
    client.zadd(KEYS.inflight_lease, {"poison": past, "second": past}, xx=True)
    assert store.reap() == 2
    assert client.hgetall(KEYS.inflight_deaths) == {b"first": b"1", b"poison": b"1", b"second": b"1"}


def test_reap_drops_running_marks_a_day_old_and_keeps_those_of_batches_running(
    client: redis.Redis, store: RequestStore
) -> None:
    now_ms = int(time.time() * 1000)
    # A worker died between marking "lost" and unmarking it, its requests answered meanwhile.
    client.zadd(KEYS.inflight_running, {"lost": now_ms - 2 * 86_400_000, "running": now_ms - 60_000})
    assert store.reap() == 0
    assert client.zrange(KEYS.inflight_running, 0, -1) == [b"running"]


def test_a_take_says_nothing_of_deaths_while_no_request_has_one(
    client: redis.Redis, store: RequestStore
) -> None:
    in_flight(store, "a", "b")
    assert store.deaths == {}


# --- heartbeat -------------------------------------------------------------------------------


def test_heartbeat_counts_live_workers_and_drops_the_expired(
    client: redis.Redis, store: RequestStore
) -> None:
    assert store.live_workers() == 0
    assert store.heartbeat("w1", 30) == 1
    assert store.heartbeat("w2", 0.05) == 2
    expiry = client.zscore(KEYS.workers, "w1")
    assert expiry is not None and 25_000 < expiry - now_ms(client) <= 30_000
    time.sleep(0.2)
    assert store.live_workers() == 1
    assert client.zrange(KEYS.workers, 0, -1) == [b"w1"]
    assert store.heartbeat("w1", 30) == 1  # beating again does not count twice
    store.leave("w1")
    assert store.live_workers() == 0


def test_heartbeats_say_which_batch_queues_the_live_workers_consume(
    client: redis.Redis, store: RequestStore
) -> None:
    store.heartbeat("w1", 30, ["carpool.batches", "big"])
    store.heartbeat("w2", 0.05, ["big"])
    found = store.batch_queue_workers()
    assert found.by_queue == {"carpool.batches": ["w1"], "big": ["w1", "w2"]}
    assert found.unknown == []
    time.sleep(0.2)
    # w2 went silent: it no longer counts, and the next heartbeat drops the queues it named, also
    # after a coordinator's count dropped w2 itself (a SIGKILLed worker's field stayed for good).
    assert store.batch_queue_workers().by_queue == {"carpool.batches": ["w1"], "big": ["w1"]}
    assert store.live_workers() == 1
    assert client.hexists(KEYS.worker_queues, "w2")
    store.heartbeat("w1", 30, ["carpool.batches"])
    assert client.hkeys(KEYS.worker_queues) == [b"w1"]
    found = store.batch_queue_workers()
    assert found.by_queue == {"carpool.batches": ["w1"]}
    assert found.unserved(["carpool.batches", "big"]) == ["big"]
    # A live worker that does not say (an earlier release) may consume any queue: none is unserved.
    store.heartbeat("w0", 30)
    found = store.batch_queue_workers()
    assert found.unknown == ["w0"] and found.unserved(["big"]) == []
    store.leave("w1")
    store.leave("w0")
    assert not client.exists(KEYS.worker_queues)
    assert store.batch_queue_workers().unserved(["carpool.batches"]) == ["carpool.batches"]
