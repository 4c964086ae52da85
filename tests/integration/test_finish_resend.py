"""A finish whose reply is lost, sent again, against the session's redis-server.

Redis may run a worker's finish script and lose its reply (a socket timeout, a reset connection);
the call is then sent again, with the same bytes, by the held script's reconnection or by the
worker's own retries. That resend finds the results stored and must answer as the first sending
did, so that the worker applies its requests' links and reports the batch once, while a genuine
rerun (another run's results for requests answered meanwhile) is still refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import redis

from carpool.celery_edge import links
from carpool.redis_edge import lua
from carpool.redis_edge.store import RequestStore, ResultWrites
from carpool.tools.embedded import EmbeddedRedis
from carpool.wire import Links, RequestSlot, batch_message
from tests.integration.test_redis_scripts import (
    KEYS,
    LEASE_S,
    RESULTS_DB,
    forgotten,
    in_flight,
    message,
    published,
    subscribed,
)

COORDINATOR = "coord"
EVENTS = "events"
INBOX_PREFIX = "box:"
INBOX = f"{INBOX_PREFIX}producer"  # the one producer's result inbox


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


def batch_writes(ids: Sequence[str], run: str) -> ResultWrites:
    """The encoded results one run of a batch stores for ``ids``, each in its producer's inbox."""
    payloads = [json.dumps({"task_id": i, "run": run}).encode() for i in ids]
    return ResultWrites([f"res:{i}" for i in ids], payloads, 60, [INBOX] * len(ids), INBOX_PREFIX)


def events_of(batch_id: str) -> bytes:
    return json.dumps({"batch": batch_id}).encode()


def as_key(key: bytes | str) -> bytes:
    return key if isinstance(key, bytes) else key.encode()


def finish_batch(
    store: RequestStore, writes: ResultWrites, ack_ids: Sequence[str], batch_id: str
) -> list[int]:
    """A worker's finish of batch ``batch_id``: its results, acks, report and task events."""
    return store.finish(
        results_db=RESULTS_DB,
        broker_db=0,
        writes=writes,
        ack_ids=ack_ids,
        report={"batch_id": batch_id, "size": len(ack_ids)},
        coordinator=COORDINATOR,
        events=(EVENTS, events_of(batch_id)),
    )


def reports(client: redis.Redis) -> list[Any]:
    """The batch reports pushed to the coordinator, newest first."""
    return [json.loads(r) for r in client.lrange(KEYS.reports_for(COORDINATOR), 0, -1)]


def test_a_finish_sent_again_returns_what_its_first_sending_stored_and_reports_once(
    client: redis.Redis, results: redis.Redis, store: RequestStore
) -> None:
    ids = ["a", "b", "c"]
    answered = "b"  # by an earlier run: refused to both sendings
    results.set(f"res:{answered}", b"earlier")
    writes = batch_writes(ids, "this")
    channels = subscribed(client, *writes.keys, INBOX, EVENTS)
    in_flight(store, *ids)
    first = finish_batch(store, writes, ids, "b1")
    resent = finish_batch(store, writes, ids, "b1")
    mine = [i for i, request_id in enumerate(ids, 1) if request_id != answered]
    assert first == mine and resent == first
    assert results.get(f"res:{answered}") == b"earlier"
    assert all(forgotten(client, i) for i in ids)
    assert reports(client) == [{"batch_id": "b1", "size": len(ids)}]
    # Each stored result reached its channel and its inbox once. The events are not published, by
    # either sending: one result was refused, so they would say what its caller never gets (the
    # worker publishes them corrected).
    sent = [writes.payloads[i - 1] for i in mine]
    got = published(channels, 2 * len(sent))
    assert sorted(got) == sorted(
        [(as_key(writes.keys[i - 1]), writes.payloads[i - 1]) for i in mine]
        + [(INBOX.encode(), p) for p in sent]
    )
    channels.close()


def test_a_rerun_after_a_resend_is_refused_and_still_reports(
    client: redis.Redis, results: redis.Redis, store: RequestStore
) -> None:
    ids = ["a", "b"]
    writes = batch_writes(ids, "first")
    in_flight(store, *ids)
    first = finish_batch(store, writes, ids, "b1")
    assert first and finish_batch(store, writes, ids, "b1") == first
    # Another run of the same requests (their leases ran out, say): other bytes, refused.
    rerun = batch_writes(ids, "second")
    late = "late"  # a request only the rerun answers
    in_flight(store, late)
    more = ResultWrites(
        [*rerun.keys, f"res:{late}"],
        [*rerun.payloads, b"late"],
        60,
        [*rerun.inboxes, ""],
        INBOX_PREFIX,
    )
    assert finish_batch(store, more, [*ids, late], "b2") == [len(more.keys)]
    assert finish_batch(store, rerun, ids, "b3") == []
    assert [results.get(k) for k in writes.keys] == list(writes.payloads)
    assert [r["batch_id"] for r in reports(client)] == ["b3", "b2", "b1"]


def test_a_resent_finish_naming_a_key_twice_answers_as_its_first_sending(
    client: redis.Redis, store: RequestStore
) -> None:
    # The second write of a key in one call is refused, though it writes the same bytes: it is not
    # this call's first sending's, and counting it would apply the request's links twice.
    once = batch_writes(["a"], "this")
    twice = ResultWrites([*once.keys, *once.keys], [*once.payloads, *once.payloads], 60)
    in_flight(store, "a")
    first = finish_batch(store, twice, ["a"], "b1")
    assert first == [1]
    assert finish_batch(store, twice, ["a"], "b1") == first
    assert len(reports(client)) == 1


# --- a worker's batch ------------------------------------------------------------------------


def lose_reply_in_held_script(monkeypatch: pytest.MonkeyPatch, held: lua.HeldScript) -> list[Any]:
    """Make the first reply to ``held``'s script time out after Redis ran it, on this thread's
    connection: the held script reconnects and sends the call once more. Returns the lost replies."""
    conn = held._connections.get()
    sha = held.script.sha.encode()
    send, read = conn.send_packed_command, conn.read_response
    lost: list[Any] = []
    sending = [False]

    def send_packed_command(command: Any, *args: Any, **kwargs: Any) -> None:
        is_call = any(sha in part for part in command)
        send(command, *args, **kwargs)  # a health check's PING may go (and be answered) first
        sending[0] = is_call

    def read_response(*args: Any, **kwargs: Any) -> Any:
        reply = read(*args, **kwargs)
        if sending[0] and not lost:
            lost.append(reply)
            raise redis.TimeoutError("Timeout reading from socket")
        return reply

    monkeypatch.setattr(conn, "send_packed_command", send_packed_command)
    monkeypatch.setattr(conn, "read_response", read_response)
    return lost


def lose_reply_after_held_script(monkeypatch: pytest.MonkeyPatch, store: RequestStore) -> list[Any]:
    """Make the first finish fail with a reset connection after Redis ran it: the worker's own
    retries send it again. Returns the lost replies."""
    held = store._finish_held
    lost: list[Any] = []

    def finish(keys: Sequence[Any], args: Sequence[Any]) -> Any:
        reply = held(keys=keys, args=args)
        if not lost:
            lost.append(reply)
            raise redis.ConnectionError("Connection reset by peer")
        return reply

    monkeypatch.setattr(store, "_finish_held", finish)
    return lost


LOSSES: dict[str, Callable[[pytest.MonkeyPatch, Any], list[Any]]] = {
    "resent-by-the-held-script": lambda mp, rt: lose_reply_in_held_script(mp, rt.store._finish_held),
    "resent-by-the-worker": lambda mp, rt: lose_reply_after_held_script(mp, rt.store),
}


@pytest.fixture()
def applied(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids whose success links the worker applies."""
    out: list[str] = []

    def on_success(app: Any, request_id: str, lk: Links, result: Any, send: Any = None) -> list[Any]:
        out.append(request_id)
        return []

    monkeypatch.setattr(links, "on_success", on_success)
    return out


@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_worker_whose_finish_reply_is_lost_applies_its_links_and_reports_once(
    clean_redis: EmbeddedRedis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    applied: list[str],
    loss: str,
) -> None:
    from carpool.celery_edge.app import app
    from carpool.gpu_worker.runtime import WorkerRuntime

    rt: Any = WorkerRuntime(app)
    rt.device, rt.events.mode = "cpu", False
    assert rt.dbs is not None, "results and broker share the session's server: one finish script"
    ids = ["req-a", "req-b"]
    store: RequestStore = rt.store
    for request_id in ids:
        store.client.lpush(store.keys.request_queue, message(request_id))
    assert [i for i, _ in store.take(len(ids))[0]] == ids
    store.dispatch("q", [("b1", ids, b"m")])
    lost = LOSSES[loss](monkeypatch, rt)
    callback: Links = {"callbacks": [{"task": "x", "args": [], "kwargs": {}, "options": {}}]}
    slots: list[RequestSlot] = [
        {"id": i, "item": [101, 7, 102], "len": 3, "sent_at": 1.7e9, "deadline": 2e9, "links": callback}
        for i in ids
    ]
    batch = batch_message(
        batch_id="b1",
        task="carpool.infer",
        model="toy",
        bin_label="1-16",
        flush="full",
        padded_len=8,
        dispatched_at=1.7e9,
        coordinator=COORDINATOR,
        requests=slots,
    )
    with caplog.at_level(logging.WARNING):
        rt.run(batch)
    assert len(lost) == 1, "the finish's first reply was lost"
    assert sorted(applied) == sorted(ids), "each stored success's callback applied once"
    assert not [r for r in caplog.records if "answered already" in r.getMessage()]
    assert [r["batch_id"] for r in store.pop_reports(COORDINATOR)] == ["b1"]
    assert all(rt.backend.client.exists(rt.backend.get_key_for_task(i)) for i in ids)
