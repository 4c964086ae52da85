"""The coordinator's loop with its clocks injected and its Redis edge faked: no network, no sleeping."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery.exceptions import TaskRevokedError
from redis.exceptions import NoPermissionError, ResponseError

from carpool.celery_edge import links
from carpool.celery_edge.events import TaskEvents
from carpool.codec import loads
from carpool.config import Settings
from carpool.coordinator.dispatch import OutstandingBatch
from carpool.coordinator.loop import Coordinator
from carpool.coordinator.waiting import FORCED_POLL_S, Wait, WaitFor
from carpool.errors import ConfigError, DeadlineExceeded, QueueFull
from carpool.redis_edge.store import Consumers, LinksDue
from carpool.wire import WIRE_VERSION, batch_report, read_batch
from tests.unit.messages import message

MONO_START = 50.0
WALL_START = 1_700_000_000.0


class Clocks:
    """Both clocks of the coordinator, moved by hand."""

    def __init__(self) -> None:
        self.elapsed = 0.0

    def mono(self) -> float:
        return MONO_START + self.elapsed

    def wall(self) -> float:
        return WALL_START + self.elapsed

    def advance(self, seconds: float) -> None:
        self.elapsed += seconds


class FakeStore:
    """The coordinator's calls into Redis, answered from memory."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.renewals = 0
        self.renew_error: Exception | None = None  # what the next renewal raises, once
        self.queue: list[tuple[str, bytes]] = []
        self.reports: list[dict[str, Any]] = []
        self.acked: list[str] = []
        self.dispatched: list[tuple[str, list[str]]] = []
        self.reaped: set[str] = set()  # ids another coordinator reaped: dispatch no longer assigns them
        self.wait_error: Exception | None = None  # what a wait in Redis answers
        self.consumers: Consumers | None = None  # which workers consume which batch queues
        self.deaths: dict[str, int] = {}  # as RequestStore.deaths: how often a worker died running each
        self.filed: list[tuple[str, bytes]] = []  # the links outbox's entries, by answer
        self.emptied: list[str] = []  # and those emptied, by links_sent
        self.links_renewed: list[list[str]] = []  # the outbox entries renewed, at each renewal

    def take(
        self, count: int, reports_of: str | None = None
    ) -> tuple[list[tuple[str, bytes]], list[dict[str, Any]]]:
        taken, self.queue = self.queue[:count], self.queue[count:]
        reports, self.reports = (self.reports, []) if reports_of is not None else ([], self.reports)
        return taken, reports

    def wait_then_take(
        self, wait_list: str, timeout_s: float, count: int, reports_of: str | None = None
    ) -> tuple[Exception | None, Any]:
        self.waited_on = wait_list
        return self.wait_error, self.take(count, reports_of)

    def pop_reports(self, coordinator: str) -> list[dict[str, Any]]:
        reports, self.reports = self.reports, []
        return reports

    def live_workers(self) -> int:
        return self.workers

    def batch_queue_workers(self) -> Consumers:
        if self.consumers is not None:
            return self.consumers
        return Consumers({}, [f"worker-{i}" for i in range(self.workers)])  # their queues unknown

    def renew_held(self, ids: Sequence[str]) -> int:
        if self.renew_error is not None:
            error, self.renew_error = self.renew_error, None
            raise error
        self.renewed = list(ids)
        self.renewals += 1
        return len(ids)

    def requeue(self, ids: Sequence[str]) -> int:
        self.requeued = list(ids)
        return len(ids)

    def reap(self) -> int:
        return 0

    def links_due(self, limit: int = 100) -> LinksDue:
        return LinksDue([], [])  # a dead worker's links: tests/integration/test_links_outbox.py

    def links_renew(self, ids: Sequence[str]) -> None:
        self.links_renewed.append(list(ids))

    def ack(self, ids: Sequence[str]) -> None:
        self.acked.extend(ids)

    def answer(
        self,
        backend: FakeBackend,
        dbs: Any,
        writes: FakeWrites,
        ack_ids: Sequence[str],
        *,
        outbox: Sequence[tuple[int, str, bytes]] = (),
        **_: Any,
    ) -> list[int]:
        """As RequestStore.answer: results, acknowledgements and outbox entries in one step."""
        stored = backend.store_encoded(writes)
        self.acked.extend(ack_ids)
        self.filed.extend((request_id, entry) for i, request_id, entry in outbox if i in stored)
        return stored

    def links_sent(self, ids: Sequence[str]) -> None:
        self.emptied.extend(ids)

    def dispatch(
        self, queue_list: str, batches: Sequence[tuple[str, Sequence[str], Any]], events: Any
    ) -> int:
        self.dispatched.extend((batch_id, list(ids)) for batch_id, ids, _ in batches)
        # dispatch.lua assigns only what is still in flight: a request reaped meanwhile is not.
        return sum(1 for _, ids, _ in batches for i in ids if i not in self.reaped)


#: What FakeBackend.store_args gives: the entries and their inboxes, as they were.
FakeWrites = tuple[list[tuple[str, str, Any]], dict[str, str]]


class FakeBackend:
    def __init__(self) -> None:
        self.stored: list[tuple[str, str, Any]] = []
        self.inboxes: dict[str, str] = {}

    def store_args(
        self, entries: list[tuple[str, str, Any]], inboxes: dict[str, str] | None = None
    ) -> FakeWrites:
        return list(entries), dict(inboxes or {})

    def store_encoded(self, writes: FakeWrites) -> list[int]:
        """Stores every entry: their 1-based indexes."""
        entries, inboxes = writes
        self.store_many(entries, inboxes)
        return list(range(1, len(entries) + 1))

    def store_many(
        self, entries: list[tuple[str, str, Any]], inboxes: dict[str, str] | None = None
    ) -> list[str]:
        self.stored.extend(entries)
        self.inboxes.update(inboxes or {})
        return [task_id for task_id, _, _ in entries]


class Built:
    def __init__(self, raws: list[bytes]) -> None:
        self.pushes = {"carpool.batches": raws}

    def published(self) -> None:
        pass


class FakeBuilder:
    """Records the task arguments instead of building Celery messages (which needs the broker)."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def build(self, calls: list[tuple[list[Any], dict[str, Any]]], **_: Any) -> Built:
        self.batches.extend(args[0] for args, _ in calls)
        return Built([b"message"] * len(calls))


class FakePipeline:
    def __enter__(self) -> FakePipeline:
        return self

    def __exit__(self, *_: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class FakeClient:
    def register_script(self, script: str) -> Any:
        return lambda **kwargs: None

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        return FakePipeline()

    def zrange(self, key: str, start: int, end: int) -> list[bytes]:
        return []  # no other coordinator: nothing to compare what this one serves with

    def info(self, section: str | None = None) -> dict[str, Any]:
        return {}  # a server that evicts nothing


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


def coordinator(clocks: Clocks, workers: int, **overrides: Any) -> Any:
    from carpool.celery_edge.app import app

    fields: dict[str, Any] = {"model": "toy", "models": ("toy",), "events": False, "max_wait_s": 0.05}
    fields.update(overrides)
    c = Coordinator(Settings(**fields), app, client=FakeClient(), clock=clocks.mono, wall=clocks.wall)  # type: ignore[arg-type]
    c.store = FakeStore(workers)  # type: ignore[assignment]
    c.publisher.store = c.store
    c.backend = FakeBackend()
    c.publisher._builders[c.settings.batch_queue] = FakeBuilder()  # type: ignore[assignment]
    return c


def iso(wall_s: float) -> str:
    return datetime.fromtimestamp(wall_s, UTC).isoformat()


def test_with_no_worker_alive_held_requests_do_not_set_the_loop_polling(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=0)
    c.store.queue.append(("a", message("a", "hello there")))
    wait = c.step()
    assert len(c.policy) == 1 and c.workers == 0
    # Nothing can leave until housekeeping counts a worker: a wait in Redis, not a 2 ms poll.
    assert wait == Wait(c.settings.idle_poll_s, WaitFor.REPORTS)


def test_the_loop_sleeps_on_work_queued_behind_the_running_batches_only(clocks: Clocks) -> None:
    """With every slot taken and a request held, the loop sleeps half of the work queued behind
    what each worker runs, and blocks on the report list when nothing waits behind it: what runs may
    end any moment, and a sleep would then leave its worker idle."""
    c = coordinator(clocks, workers=1, prefetch_batches=0, prefetch_s=0.0)
    now = clocks.mono()
    c.outstanding["running"] = OutstandingBatch(["x"], "toy", 0.010, now)
    c.store.queue.append(("a", message("a", "hello there")))
    wait = c.step()
    assert len(c.policy) == 1 and list(c.outstanding) == ["running"]
    assert wait == Wait(c.settings.idle_poll_s, WaitFor.REPORTS)
    c.outstanding["queued-1"] = OutstandingBatch(["y"], "toy", 0.006, now)
    c.outstanding["queued-2"] = OutstandingBatch(["z"], "toy", 0.006, now)
    assert c.step() == Wait(0.006)  # half of the 12 ms queued behind the running batch


def test_a_request_expires_on_the_coordinators_clock(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=0)  # nobody to run it: it is held until it expires
    c.store.queue.append(
        ("a", message("a", "hello there", sent_at=WALL_START - 0.5, expires=iso(WALL_START + 1)))
    )
    c.step()
    assert len(c.policy) == 1 and c.backend.stored == []
    clocks.advance(0.99)
    c.step()
    assert len(c.policy) == 1 and c.backend.stored == []
    clocks.advance(0.02)
    c.step()
    assert len(c.policy) == 0
    [(request_id, state, error)] = c.backend.stored
    # Its caller's expires= passed: Celery answers that REVOKED, TaskRevokedError('expired').
    assert request_id == "a" and state == "REVOKED" and isinstance(error, TaskRevokedError)
    assert error.args == ("expired",)
    assert c.store.acked == ["a"] and c.stats.failed["deadline"] == 1


def test_a_request_late_on_arrival_says_how_long_ago_its_producer_sent_it(clocks: Clocks) -> None:
    """A producer clock behind by more than the default deadline fails fresh requests: the error says
    when the producer's clock says it was sent, which points at the clock."""
    c = coordinator(clocks, workers=1, default_deadline_s=30.0)
    c.store.queue.append(("a", message("a", "hello there", sent_at=WALL_START - 95.0)))
    c.step()
    [(request_id, state, error)] = c.backend.stored
    assert request_id == "a" and state == "FAILURE" and isinstance(error, DeadlineExceeded)
    assert "deadline passed 65.000s ago" in str(error)
    assert "sent 95.000s ago by its producer's clock" in str(error) and "synchronise" in str(error)


def test_a_producers_result_inbox_travels_in_the_slot_and_with_the_refusals(clocks: Clocks) -> None:
    inbox = {"carpool_inbox": "celery-task-meta-carpool.inbox.abc"}
    c = coordinator(clocks, workers=1)
    c.store.queue += [
        ("a", message("a", "one two three", extra_headers=inbox)),
        ("b", message("b", "one two three")),
        ("bad", message("bad", 42, extra_headers=inbox)),  # refused at intake
    ]
    c.step()
    for _ in range(10):
        if c.outstanding:
            break
        clocks.advance(0.05)
        c.step()
    [batch] = c.publisher._builders[c.settings.batch_queue].batches
    slots = {r["id"]: r for r in read_batch(loads(json.dumps(batch)))["requests"]}
    assert slots["a"]["inbox"] == inbox["carpool_inbox"] and "inbox" not in slots["b"]
    assert c.backend.inboxes == {"bad": inbox["carpool_inbox"]}

    # Held until it expires (nobody to run it): its failure goes to its inbox too.
    c = coordinator(clocks, workers=0)
    c.store.queue.append(("late", message("late", "hi", expires=iso(WALL_START + 1), extra_headers=inbox)))
    c.step()
    clocks.advance(1.01)
    c.step()
    assert [e[0] for e in c.backend.stored] == ["late"]
    assert c.backend.inboxes == {"late": inbox["carpool_inbox"]}


def test_the_batch_message_is_what_the_worker_reads_and_its_report_frees_the_worker(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    c = coordinator(clocks, workers=1)
    c.store.queue += [(i, message(i, "one two three")) for i in ("a", "b")]
    c.step()
    for _ in range(10):  # a partial batch waits a little for company, then leaves
        if c.outstanding:
            break
        clocks.advance(0.05)
        c.step()
    [batch] = c.publisher._builders[c.settings.batch_queue].batches
    got = read_batch(loads(json.dumps(batch)))
    assert got["version"] == WIRE_VERSION and got["coordinator"] == c.hostname
    assert [r["id"] for r in got["requests"]] == ["a", "b"]
    assert c.store.dispatched == [(got["id"], ["a", "b"])] and list(c.outstanding) == [got["id"]]
    # Every worker is busy, and nothing is held that a freed slot could take: the loop waits for
    # requests (the take one wakes reads the reports too)...
    assert c.step().block_on is WaitFor.REQUESTS
    # ...and for a report once a request waits for a worker.
    c.store.queue.append(("c", message("c", "one two three")))
    assert c.step().block_on is WaitFor.REPORTS

    fields: dict[str, Any] = {
        "batch_id": got["id"],
        "model": "toy",
        "worker": "w",
        "device": "cpu",
        "bin_label": got["bin"],
        "flush": got["flush"],
        "size": 2,
        "padded_len": 8,
        "real_tokens": 8,
        "run_s": 0.01,
        "failed_model": 0,
        "failed_deadline": 0,
        "done_at": WALL_START,
    }
    c.store.reports.append({**batch_report(**fields), "version": WIRE_VERSION + 1})
    with caplog.at_level(logging.ERROR):
        c.step()
    assert list(c.outstanding) == [got["id"]], "a report of another version is refused"
    assert any("batch report refused" in r.message for r in caplog.records)

    c.store.reports.append(dict(batch_report(**fields)))
    wait = c.step()
    assert got["id"] not in c.outstanding
    assert c.latency.predict("toy", 16) == pytest.approx(0.01), "the latency model learnt the run time"
    # The freed worker takes the request that waited; then nothing is held.
    assert [o.ids for o in c.outstanding.values()] == [["c"]]
    assert wait.block_on is WaitFor.REQUESTS


def test_a_batch_queue_no_live_worker_consumes_is_said_once_and_its_return_once(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    c = coordinator(clocks, workers=1)
    c.store.queue += [(i, message(i, "one two three")) for i in ("a", "b")]
    for _ in range(10):
        c.step()
        if c.outstanding:
            break
        clocks.advance(0.05)
    queue = c.settings.batch_queue
    said = f"wait on batch queue {queue}, which no live worker consumes"
    caplog.set_level(logging.INFO, logger="carpool.coordinator.loop")

    def check(consumers: Consumers) -> list[str]:
        caplog.clear()
        c.store.consumers = consumers
        c._check_batch_queues()
        return [f"{r.levelname} {r.getMessage()}" for r in caplog.records if "batch queue" in r.getMessage()]

    def workers_on(q: str) -> float | None:
        value: float | None = c.metrics.registry.get_sample_value("carpool_batch_queue_workers", {"queue": q})
        return value

    assert check(Consumers({queue: ["w1"]}, [])) == [] and workers_on(queue) == 1
    [line] = check(Consumers({"elsewhere": ["w1"]}, []))
    assert line.startswith("ERROR") and said in line and "the live ones consume elsewhere" in line
    assert "carpool.infer" in line and workers_on(queue) == 0
    assert check(Consumers({"elsewhere": ["w1"]}, [])) == [], "said once, not at every check"
    # A live worker of an earlier release may consume it: neither said again nor said back.
    assert check(Consumers({}, ["w0"])) == []
    assert check(Consumers({queue: ["w2"]}, [])) == [f"INFO batch queue {queue} has a worker again"]
    assert workers_on(queue) == 1


def test_the_policy_is_asked_only_when_something_may_have_changed(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=1)
    asked: list[float] = []
    poll = c.policy.poll

    def counting_poll(now: float, *args: Any, **kwargs: Any) -> Any:
        asked.append(now)
        return poll(now, *args, **kwargs)

    c.policy.poll = counting_poll
    c.step()
    assert len(asked) == 1
    c.step()
    clocks.advance(FORCED_POLL_S / 2)
    c.step()
    assert len(asked) == 1, "nothing changed: the last plan stands"
    clocks.advance(FORCED_POLL_S / 2)
    c.step()
    assert len(asked) == 2, "asked again after the forced-poll interval"
    c.store.queue.append(("a", message("a", "hi")))
    c.step()
    assert len(asked) == 3, "a new request changes the plan"


class RecordingEvents:
    """The coordinator's task events, kept in order instead of published."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict[str, Any]]] = []
        self.enabled = True  # as TaskEvents says while a monitor listens

    def received(self, task_id: str, argsrepr: str, kwargsrepr: str = "{}", **fields: Any) -> None:
        self.sent.append(("received", task_id, {"args": argsrepr, "kwargs": kwargsrepr, **fields}))

    received_of = TaskEvents.received_of  # what a message's received event carries, as sent

    def failed(self, task_id: str, exc: BaseException, *_: Any, **__: Any) -> None:
        self.sent.append(("failed", task_id, {"exception": exc}))

    def revoked(self, task_id: str, expired: bool = False) -> None:
        self.sent.append(("revoked", task_id, {"expired": expired}))

    def take(self) -> None:
        return None

    def flush(self) -> None:
        pass

    def of(self, task_id: str) -> list[str]:
        return [kind for kind, i, _ in self.sent if i == task_id]


def with_reprs(raw: bytes, argsrepr: str, kwargsrepr: str) -> bytes:
    """``raw`` with the argsrepr/kwargsrepr headers Celery's producer sets."""
    envelope = json.loads(raw)
    envelope["headers"].update(argsrepr=argsrepr, kwargsrepr=kwargsrepr)
    return json.dumps(envelope).encode()


def test_a_request_refused_at_intake_is_received_before_it_fails(clocks: Clocks) -> None:
    # Nobody to run anything, room for two, too-long texts refused rather than cut.
    c = coordinator(clocks, workers=0, max_pending=2, truncate=False)
    events = c.events = RecordingEvents()
    c.store.queue += [
        ("long", message("long", "word " * 400)),
        ("ok", message("ok", "hello there", expires=iso(WALL_START + 1))),
        ("bad", with_reprs(message("bad", 123), "[123]", "{'model': 'toy'}")),
        ("full", message("full", "one too many")),
    ]
    c.step()
    assert sorted(c.stats.failed.items()) == [("invalid", 1), ("queue_full", 1), ("too_long", 1)]
    for task_id in ("long", "bad", "full"):
        assert events.of(task_id) == ["received", "failed"], task_id
    [(_, _, bad)] = [e for e in events.sent if e[:2] == ("received", "bad")]
    assert bad["args"] == "[123]" and bad["kwargs"] == "{'model': 'toy'}" and bad["name"] == "carpool.infer"
    assert events.of("ok") == ["received"]
    [(_, _, ok)] = [e for e in events.sent if e[:2] == ("received", "ok")]
    assert ok["expires"] == iso(WALL_START + 1), "as the task-sent event had it: Flower keeps the later"

    clocks.advance(1.01)
    c.step()  # its expires= passed in the coordinator's queue: received once, then revoked, expired
    assert events.of("ok") == ["received", "revoked"]
    assert [e[2] for e in events.sent if e[:2] == ("revoked", "ok")] == [{"expired": True}]


def test_with_nobody_listening_requests_are_admitted_without_received_events(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=0)
    events = c.events = RecordingEvents()
    events.enabled = False  # no monitor: TaskEvents builds no events, so none are asked for
    c.store.queue += [(i, message(i, "hello there")) for i in ("a", "b")]
    c.step()
    assert len(c.policy) == 2 and events.sent == []
    events.enabled = True  # a monitor came: the next chunk's requests are received
    c.store.queue += [("c", message("c", "hello again"))]
    c.step()
    assert len(c.policy) == 3 and events.of("c") == ["received"] and events.of("a") == []


# --- countdown / eta -------------------------------------------------------------------------------
def test_held_leases_are_renewed_four_times_a_lease_not_at_every_housekeeping(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=0, recovery_timeout_s=8.0)  # no worker: the requests stay held
    c.store.queue += [(i, message(i, "hello there")) for i in ("a", "b")]
    c.step()  # housekeeping (and the first renewal), then the take
    assert c.store.renewals == 1 and len(c.held) == 2
    # Housekeeping runs every second (a quarter of 8 s, capped at 1 s), here at 1.2 s: no renewal.
    for _ in range(3):
        clocks.advance(0.6)
        c.step()
    assert c.store.renewals == 1
    clocks.advance(0.5)  # 2.3 s: a quarter lease after the first renewal
    c.step()
    assert c.store.renewals == 2 and sorted(c.store.renewed) == ["a", "b"]


def test_a_renewal_that_fails_is_retried_at_the_next_step_and_nothing_held_is_dropped(
    clocks: Clocks,
) -> None:
    c = coordinator(clocks, workers=0, recovery_timeout_s=8.0)
    c.store.queue += [(i, message(i, "hello there")) for i in ("a", "b")]
    c.step()
    assert c.store.renewals == 1 and len(c.held) == 2
    clocks.advance(2.1)  # a quarter lease later: the next renewal is due, and Redis drops the connection
    c.store.renew_error = redis.ConnectionError("Connection reset by peer")
    with pytest.raises(redis.ConnectionError):
        c.step()  # run() backs off and steps again, as the next line does
    assert c.store.renewals == 1 and len(c.held) == 2
    clocks.advance(0.1)
    c.step()  # not a quarter lease later: the missed renewal is due now, not skipped
    assert c.store.renewals == 2 and sorted(c.store.renewed) == ["a", "b"] and len(c.held) == 2


def test_a_request_is_held_until_its_eta_then_batched(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=1, idle_poll_s=1.0)
    c.store.queue.append(("later", message("later", "hello", eta=iso(WALL_START + 0.5))))
    c.step()
    wait = c.step()
    assert len(c.deferred) == 1 and len(c.policy) == 0 and c.store.dispatched == []
    # Nothing else to do: it waits for new requests, but no longer than until the eta.
    assert wait.block_on is WaitFor.REQUESTS and wait.seconds == pytest.approx(0.5)
    clocks.advance(0.2)
    c._next_housekeeping = c._next_renewal = 0.0
    c.step()
    assert "later" in c.store.renewed, "its lease is renewed while it is held"
    clocks.advance(0.29)
    c.step()
    assert c.store.dispatched == [] and len(c.deferred) == 1
    clocks.advance(0.02)
    for _ in range(10):  # due: it joins the policy, and a partial batch leaves after its short wait
        c.step()
        if c.store.dispatched:
            break
        clocks.advance(0.05)
    assert len(c.deferred) == 0
    assert [ids for _, ids in c.store.dispatched] == [["later"]]
    [batch] = c.publisher._builders[c.settings.batch_queue].batches
    [slot] = batch["requests"]
    assert slot["deadline"] == pytest.approx(WALL_START + 0.5 + c.settings.default_deadline_s)


def test_requests_held_for_their_eta_are_handed_back_at_shutdown(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=1)
    c.store.queue += [
        ("later", message("later", "hello", eta=iso(WALL_START + 60.0))),
        ("now", message("now", "hello")),
    ]
    c.step()
    c.shutdown()
    assert sorted(c.store.requeued) == ["later", "now"]


def test_held_requests_count_toward_max_pending(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=0, max_pending=2)
    c.store.queue += [(i, message(i, "x", eta=iso(WALL_START + 60.0))) for i in ("a", "b", "c")]
    c.step()
    assert len(c.deferred) == 2
    [(request_id, state, error)] = c.backend.stored
    assert request_id == "c" and state == "FAILURE" and isinstance(error, QueueFull)
    # The refusal says what counts, and the gauges show them: status showed nothing pending.
    assert "per coordinator" in str(error) and "held for their countdown or eta count too" in str(error)
    written: list[dict[str, int]] = []

    class Recording:
        def write(self, stats: Any, depths: Any, gauges: Any, task_of: Any = None, spans: Any = None) -> None:
            written.append(dict(gauges))

    c._stats_writer = Recording()
    c._write_stats()
    assert written[0]["deferred"] == 2 and written[0]["pending"] == 0


def test_an_overload_of_refusals_logs_a_few_and_counts_the_rest(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the ops review: past CARPOOL_MAX_PENDING each refused request took an INFO line,
    2,990 of them for 3,000 requests sent, just when the coordinator was busiest."""
    from carpool.coordinator.answers import LOGGED_REFUSALS

    caplog.set_level("INFO", logger="carpool.coordinator.answers")
    c = coordinator(clocks, workers=0, max_pending=2)
    c.store.queue += [(f"r{i}", message(f"r{i}", "x")) for i in range(40)]
    c.step()
    assert sum(1 for _, state, error in c.backend.stored if isinstance(error, QueueFull)) == 38
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "INFO" and "failed (queue_full)" in r.getMessage()
    ]
    assert len(lines) == LOGGED_REFUSALS + 1
    assert lines[-1] == f"{38 - LOGGED_REFUSALS} more requests failed (queue_full)"


def test_a_request_expiring_before_its_eta_is_answered_expired_at_once_as_celery_would_at_its_eta(
    clocks: Clocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery's worker answers it REVOKED ('expired') when the eta comes, calling no error callback
    and sending no further chain step."""
    called: list[str] = []
    monkeypatch.setattr(links, "on_failure", lambda app, rid, task, lk, exc: called.append(rid))
    c = coordinator(clocks, workers=1)
    errback = {"task": "carpool.infer", "args": [], "kwargs": {}, "options": {}}
    step = {**errback, "options": {"task_id": "chained"}}
    embed = {"callbacks": None, "errbacks": [errback], "chain": [step], "chord": None}
    c.store.queue.append(
        (
            "doomed",
            message("doomed", "hi", eta=iso(WALL_START + 10), expires=iso(WALL_START + 5), embed=embed),
        )
    )
    c.step()
    assert len(c.deferred) == 0 and c.store.acked == ["doomed"]
    [(task_id, state, error)] = c.backend.stored
    assert (task_id, state, error.args) == ("doomed", "REVOKED", ("expired",))
    assert called == [] and c.stats.failed["deadline"] == 1


# --- revoke ---------------------------------------------------------------------------------------
class HeardRevokes:
    """Stands in for the revoke listener's thread."""

    def __init__(self) -> None:
        self.heard: list[str] = []

    def take(self) -> list[str]:
        heard, self.heard = self.heard, []
        return heard


def test_revoked_requests_held_here_are_answered_revoked_and_never_batched(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=0)  # nobody to run anything: the coordinator holds it all
    c.revokes = HeardRevokes()
    c.store.queue += [
        ("later", message("later", "hi", eta=iso(WALL_START + 60.0))),
        ("held", message("held", "hi")),
        ("kept", message("kept", "hi")),
    ]
    c.step()
    assert len(c.deferred) == 1 and len(c.policy) == 2
    c.revokes.heard += ["later", "held", "unknown"]
    c.step()
    assert len(c.deferred) == 0 and len(c.policy) == 1
    assert [(i, state) for i, state, _ in c.backend.stored] == [("later", "REVOKED"), ("held", "REVOKED")]
    assert all(isinstance(error, TaskRevokedError) for _, _, error in c.backend.stored)
    assert c.store.acked == ["later", "held"]
    assert c.stats.failed["revoked"] == 2, "counted, so taken = dispatched + failed + requeued holds"
    # One revoked before it was taken is answered when it is, without being decoded or batched.
    c.store.queue.append(("unknown", b"not even a message"))
    c.store.workers = 1
    c._next_housekeeping = 0.0
    for _ in range(10):
        c.step()
        clocks.advance(0.05)
    assert c.backend.stored[-1][:2] == ("unknown", "REVOKED")
    assert [ids for _, ids in c.store.dispatched] == [["kept"]]
    assert c.stats.failed["revoked"] == 3


def test_a_revoke_broadcast_names_its_task_ids() -> None:
    import base64

    from carpool.coordinator.revokes import revoked_task_ids

    def broadcast(command: dict[str, Any]) -> bytes:
        body = base64.b64encode(json.dumps(command).encode()).decode()
        return json.dumps({"body": body, "properties": {"body_encoding": "base64"}}).encode()

    revoke = {"method": "revoke", "arguments": {"task_id": "a", "terminate": False}, "destination": None}
    assert revoked_task_ids(broadcast(revoke)) == ["a"]
    several = {**revoke, "arguments": {"task_id": ["a", "b"]}}
    assert revoked_task_ids(broadcast(several)) == ["a", "b"]
    assert revoked_task_ids(broadcast({**revoke, "destination": ["some-worker@host"]})) == []
    assert revoked_task_ids(broadcast({"method": "ping", "arguments": {}})) == []
    assert revoked_task_ids(b"garbage") == []


def test_the_take_behind_a_wait_in_redis_is_the_next_steps_take(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=1)
    assert c.step().block_on is WaitFor.REQUESTS
    c.store.queue.append(("a", message("a", "one two three")))
    c._ahead = c._wait(Wait(0.01, WaitFor.REQUESTS))  # as the loop keeps it
    assert c.store.waited_on == c.keys.request_queue and c.store.queue == []
    c.store.queue.append(("b", message("b", "one two three")))  # came after that take
    c.step()
    assert c.held == {"a"} and [i for i, _ in c.store.queue] == ["b"], "the step took nothing more"


class NamedUser(FakeClient):
    connection_pool = SimpleNamespace(connection_kwargs={"username": "carpool-coordinator"})


def test_a_redis_user_without_blmove_is_a_config_error_not_an_old_redis(clocks: Clocks) -> None:
    c = coordinator(clocks, workers=1)
    c.client = NamedUser()
    c.store.wait_error = NoPermissionError(
        "User carpool-coordinator has no permissions to run the 'blmove' command"
    )
    c.store.queue.append(("a", message("a", "taken behind the refused wait")))
    with pytest.raises(
        ConfigError,
        match=r"'carpool-coordinator' may not BLMOVE 'carpool\.requests'.*carpool acl --role coordinator",
    ):
        c._wait(Wait(0.01, WaitFor.REQUESTS))
    assert c.pacer.can_block, "a denied BLMOVE is not taken for a Redis without it"
    assert c.store.requeued == ["a"], "what the take behind the refused wait got goes back at once"
    # It ends the loop (run() then hands back what the process holds): retrying cannot mend it.
    c.step = lambda: Wait(0.01, WaitFor.REQUESTS)
    c.stopping.wait = lambda _s=None: c.stopping.set()  # a retry's backoff ends the loop instead
    with pytest.raises(ConfigError):
        c._loop()

    # Another error is passing (a replica briefly away, Redis out of memory): the next wait blocks.
    for passing in (
        "NOREPLICAS Not enough good replicas to write.",
        "READONLY You can't write against a read only replica.",
    ):
        c.store.wait_error = ResponseError(passing)
        c._wait(Wait(0.01, WaitFor.REQUESTS))
        assert c.pacer.can_block, passing
    # A Redis before 6.2 does not know the command: the coordinator polls instead.
    c.store.wait_error = ResponseError("ERR unknown command 'BLMOVE', with args beginning with: ")
    c._wait(Wait(0.01, WaitFor.REQUESTS))
    assert not c.pacer.can_block


def test_a_stop_during_a_wait_hands_back_what_the_wait_took(clocks: Clocks) -> None:
    """The stop signal comes while a wait in Redis takes requests on its way out: no step admits
    them, and shutdown hands them back at once rather than leaving them to their lease."""
    c = coordinator(clocks, workers=1)
    c.store.queue += [("first", message("first", "hello")), ("second", message("second", "there"))]

    def wait_and_stop(wait: Wait) -> Any:
        taken = Coordinator._wait(c, wait)
        c.stopping.set()  # SIGTERM's handler, between the take and the next step
        return taken

    c._wait = wait_and_stop
    c.step = lambda: Wait(0.01, WaitFor.REQUESTS)
    c._loop()
    assert c.store.queue == [], "the wait took both"
    c.shutdown()
    assert sorted(c.store.requeued) == ["first", "second"]
    # Taken from the lists, so counted taken as they are counted requeued: taken - requeued is what
    # was sent, as docs/OBSERVABILITY.md says.
    assert c.stats.taken == 2 and c.stats.requeued["shutdown"] == len(c.store.requeued)


def test_a_step_that_fails_after_its_take_keeps_the_take_for_the_next(clocks: Clocks) -> None:
    """Redis fails between a take and its admission (here: the replicas' acknowledgement): the
    take is neither dropped to its lease nor taken twice; the next step admits it, renewals cover
    it meanwhile, and a stop hands it back."""
    c = coordinator(clocks, workers=1, wait_replicas=1)
    c.store.queue += [("first", message("first", "hello")), ("second", message("second", "there"))]
    failures = [redis.ConnectionError("the replica went away")]

    def replicated(_what: str) -> None:
        if failures:
            raise failures.pop()

    c.store.replicated = replicated
    with pytest.raises(redis.ConnectionError):
        c.step()
    assert c.store.queue == [] and len(c.policy) == 0
    clocks.advance(c.settings.recovery_timeout_s / 4)
    c.housekeeping(clocks.mono())
    assert sorted(c.store.renewed) == ["first", "second"], "the take's leases are renewed while it waits"

    c.step()
    assert sorted(r.id for r in c.policy.drain()) == ["first", "second"]
    assert c._ahead is None

    c.store.queue += [("third", message("third", "again"))]
    failures.append(redis.ConnectionError("and again"))
    with pytest.raises(redis.ConnectionError):
        c.step()
    c.shutdown()
    assert c.store.requeued == ["third"]


def test_a_failed_publish_puts_back_the_batches_of_every_queue_it_did_not_reach(clocks: Clocks) -> None:
    """One plan holds batches for two batch queues (infer's and a @batched task's own): when the
    first queue's publish fails, the second's batches, already cut from the policy, go back too,
    rather than staying held, their leases renewed, and never run."""
    c = coordinator(clocks, workers=1, imports=("tests.integration.batched_tasks",), max_wait_s=0.0)
    c.publisher._builders["carpool.batches.pairs"] = FakeBuilder()
    c.store.queue += [
        ("text", message("text", "hello there")),
        ("pair", message("pair", {"a": [1], "b": [2]}, task="tests.pairs")),
    ]
    dispatch = c.store.dispatch
    failures = [redis.ConnectionError("connection reset before Redis ran the script")]

    def failing_once(*args: Any) -> int:
        if failures:
            raise failures.pop()
        assigned: int = dispatch(*args)
        return assigned

    c.store.dispatch = failing_once
    with pytest.raises(redis.ConnectionError):
        c.step()
    assert c.store.dispatched == [] and c.outstanding == {}
    assert len(c.policy) == 2, "both back in the policy, to leave with a later plan"
    c.step()
    assert sorted(i for _, ids in c.store.dispatched for i in ids) == ["pair", "text"]
    assert c.held == set() and len(c.policy) == 0


def test_shutdown_hands_back_the_requests_it_holds_oldest_first(clocks: Clocks) -> None:
    """The requeue puts them back in the order given, and the next take serves them in that order:
    across bins (each drained on its own), the oldest must still come first."""
    c = coordinator(clocks, workers=0)  # no worker: everything waits in the policy
    arrivals = [("long-1", "a fairly long text " * 8), ("short", "hi"), ("long-2", "a fairly long text " * 8)]
    for request_id, text in arrivals:
        c.store.queue.append((request_id, message(request_id, text)))
        c.step()
        clocks.advance(0.01)
    assert len(c.policy) == 3
    c.shutdown()
    assert c.store.requeued == ["long-1", "short", "long-2"]


def test_a_received_event_carries_the_messages_eta_and_canvas_ids_also_when_refused(clocks: Clocks) -> None:
    """A Celery worker's task-received carries the message's eta, expires, root and parent ids;
    Flower takes each field of the later event over the task-sent one's."""
    c = coordinator(clocks, workers=0, truncate=False)
    events = c.events = RecordingEvents()
    due = iso(WALL_START - 5)  # an eta already due: admitted at once, its eta still shown
    canvas = {"root_id": "root-1", "parent_id": "parent-1"}
    c.store.queue += [
        ("due", message("due", "hello", eta=due)),
        ("child", message("child", "word " * 400, extra_headers=canvas)),  # refused: too long
        ("shadowed", message("shadowed", "hi", extra_headers={"shadow": "embed-for-tenant-a"})),
    ]
    c.step()
    fields = {task_id: f for kind, task_id, f in events.sent if kind == "received"}
    assert fields["due"]["eta"] == due
    assert (fields["child"]["root_id"], fields["child"]["parent_id"]) == ("root-1", "parent-1")
    # shadow= names the task in monitors, as a Celery worker's events name it.
    assert fields["shadowed"]["name"] == "embed-for-tenant-a" and fields["due"]["name"] == "carpool.infer"
    assert events.of("child") == ["received", "failed"]


def test_a_task_whose_model_is_missing_here_is_logged_at_start_and_the_others_served(
    clocks: Clocks, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    from carpool.adapters import reranker
    from carpool.registry import BatchedSpec

    c = coordinator(clocks, workers=1)
    missing = reranker(tmp_path / "not-mounted-here")
    c.specs = {**c.specs, "unit.rerank": BatchedSpec("unit.rerank", missing, missing.length)}
    with caplog.at_level(logging.ERROR, logger="carpool.coordinator.loop"):
        c.warm_up()  # no raise: carpool.infer is still served
    [record] = caplog.records
    assert "unit.rerank cannot measure its requests" in record.getMessage()
    assert "not-mounted-here is not a directory" in record.getMessage()


def test_a_batch_unreported_past_its_lease_is_let_go_without_saying_it_died(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    # A slow function's batch still runs, its requests leased by its worker: the log says both cases.
    from carpool.coordinator.dispatch import OutstandingBatch
    from carpool.coordinator.reports import give_up_unreported

    c = coordinator(clocks, workers=1)
    c.outstanding["slow"] = OutstandingBatch(["a", "b"], "toy", 0.5, 100.0)
    c.outstanding["recent"] = OutstandingBatch(["c"], "toy", 0.5, 100.0 + 40)
    with caplog.at_level(logging.WARNING, logger="carpool.coordinator.reports"):
        give_up_unreported(c, 100.0 + c.settings.recovery_timeout_s + 5)
    assert list(c.outstanding) == ["recent"]
    [record] = caplog.records
    waited = c.settings.recovery_timeout_s + 5
    assert f"batch slow (2 requests) not reported within {waited:.0f} s" in record.getMessage()
    assert "still running, it keeps its requests" in record.getMessage()


def test_a_database_the_server_lacks_stops_the_loop_naming_the_settings(clocks: Clocks) -> None:
    # A traceback per retry, for ever, would hide what only a changed URL (or server) can mend.
    c = coordinator(clocks, workers=1)

    def step() -> Wait:
        raise redis.ResponseError("DB index is out of range")

    c.step = step
    c.stopping.wait = lambda _s=None: False
    with pytest.raises(ConfigError, match=r"no such database.*CARPOOL_BROKER_URL and CARPOOL_RESULT_BACKEND"):
        c._loop()


def test_refused_credentials_are_logged_as_the_settings_to_change_and_retried(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    """Like a Celery worker's broker connection, the loop retries (mending the user in Redis heals it
    without a restart), but says which settings hold the password rather than that Redis is away."""
    c = coordinator(clocks, workers=1)
    failures = [redis.AuthenticationError("invalid username-password pair or user is disabled.")]

    def step() -> Wait:
        if failures:
            raise failures.pop()
        c.stopping.set()
        return Wait(0.0, WaitFor.REQUESTS)

    c.step = step
    c.stopping.wait = lambda _s=None: False  # the backoff, without sleeping
    with caplog.at_level(logging.WARNING, logger="carpool.coordinator.loop"):
        c._loop()
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert "invalid username-password pair" in record.getMessage()
    assert "CARPOOL_BROKER_URL and CARPOOL_RESULT_BACKEND" in record.getMessage()
    assert "redis unavailable" not in record.getMessage()


def test_requests_reaped_while_the_coordinator_stalled_are_not_counted_dispatched(clocks: Clocks) -> None:
    # Another coordinator reaped them past their leases, took them again and dispatches them: its
    # count holds them, so taken = dispatched + requeued still adds up across the two.
    c = coordinator(clocks, workers=1)
    c.store.queue += [(i, message(i, "one two three")) for i in ("a", "b", "c")]
    c.store.reaped = {"b", "c"}
    for _ in range(10):
        c.step()
        clocks.advance(0.05)
    assert [ids for _, ids in c.store.dispatched] == [["a", "b", "c"]]
    assert c.stats.dispatched == 1 and c.stats.batches == 1


def test_shutdown_writes_the_counts_of_this_run_before_it_ends(clocks: Clocks) -> None:
    """Counts move to Redis every quarter second: what a run counted since its last write is written
    on the way out, or a restart would lose it (a deploy under load lost thousands)."""
    c = coordinator(clocks, workers=1)
    c.store.queue += [(i, message(i, "one two three")) for i in ("a", "b")]
    for _ in range(10):
        c.step()
        clocks.advance(0.05)
    assert c.stats.dispatched == 2
    calls: list[Any] = []

    class Recording:
        def write(self, stats: Any, depths: Any, gauges: Any, task_of: Any = None, spans: Any = None) -> None:
            calls.append(("write", stats.taken, stats.dispatched, dict(gauges)))

        def leave(self) -> None:
            calls.append(("leave",))

    c._stats_writer = Recording()
    c.shutdown()
    assert [call[:3] for call in calls] == [("write", 2, 2), ("leave",)]
    gauges = calls[0][3]
    assert {k: gauges[k] for k in ("pending", "outstanding")} == {"pending": 0, "outstanding": 1}
    # The batch still out counts on the queue it waits on, too: status names one no worker consumes.
    # (Each other batch queue of the tasks registered, by tests elsewhere in this process, counts 0.)
    on_queues = {k: n for k, n in gauges.items() if k.startswith("outstanding:")}
    assert on_queues.pop("outstanding:carpool.batches") == 1 and set(on_queues.values()) <= {0}


class EvictingClient(FakeClient):
    """A server whose eviction count grows by ``step`` at each INFO stats."""

    def __init__(self, step: int) -> None:
        self.evicted, self.step = 0, step

    def info(self, section: str | None = None) -> dict[str, Any]:
        if section == "stats":
            self.evicted += self.step
            return {"evicted_keys": self.evicted}
        return {"maxmemory_policy": "allkeys-lru", "maxmemory": 1 << 20}


def test_the_peer_check_says_when_redis_evicted_keys(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    from carpool.coordinator.loop import PEER_CHECK_S

    c = coordinator(clocks, workers=1)
    c.client = EvictingClient(step=7)
    caplog.set_level(logging.ERROR, logger="carpool")
    for _ in range(3):  # the first look sets the count; each later one tells what it grew by
        c._bookkeeping(clocks.mono())
        clocks.advance(PEER_CHECK_S)
    evicted = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert len(evicted) == 2 and all("evicted 7 keys" in m for m in evicted)


def test_a_request_a_worker_died_running_runs_alone_and_one_back_again_is_named_and_waits(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    """requeue.lua counts a request put back after the worker that had claimed it stopped renewing
    its lease; the take says so (RequestStore.deaths). It runs in a batch of its own, the others
    batch as ever. Back a second time, an ERROR names it and it waits a recovery timeout before it
    runs alone again, so that the others it came back with run before it can kill the next worker."""
    c = coordinator(clocks, workers=4)
    ids = ["a", "b", "died-once", "c", "died-twice"]
    c.store.queue += [(i, message(i, "one two three")) for i in ids]
    c.store.deaths.update({"died-once": 1, "died-twice": 2})

    def dispatched() -> list[list[str]]:
        return sorted(sorted(batch_ids) for _, batch_ids in c.store.dispatched)

    with caplog.at_level(logging.ERROR):
        for _ in range(20):
            c.step()
            clocks.advance(0.05)
            if len(dispatched()) == 2:
                break
    assert dispatched() == [["a", "b", "c"], ["died-once"]]
    (named,) = [r.getMessage() for r in caplog.records if "came back" in r.getMessage()]
    assert "died-twice" in named and "came back 2 times" in named
    assert "died-twice" in c.held and len(c.deferred) == 1, "held, its lease renewed, until then"
    assert c.store.deaths == {}, "each count is used once, as its request is admitted"
    clocks.advance(c.settings.recovery_timeout_s)
    for _ in range(20):
        c.step()
        clocks.advance(0.05)
        if len(dispatched()) == 3:
            break
    assert dispatched() == [["a", "b", "c"], ["died-once"], ["died-twice"]]


def test_each_housekeeping_says_when_it_reached_redis_for_the_healthcheck(clocks: Clocks) -> None:
    from carpool.coordinator.metrics import HOUSEKEEPING_GAUGE

    c = coordinator(clocks, workers=1)
    c.step()
    assert c.metrics.registry.get_sample_value(HOUSEKEEPING_GAUGE) == clocks.wall()


def test_housekeeping_sends_the_outbox_off_the_loop_and_stops_on_an_acl_refusal_there(clocks: Clocks) -> None:
    import redis

    c = coordinator(clocks, workers=1)
    due_on: list[str] = []

    def links_due(limit: int = 100) -> LinksDue:
        due_on.append(threading.current_thread().name)
        return LinksDue([], [])

    c.store.links_due = links_due
    c.step()
    assert c.link_sender.flush(10.0) and due_on == ["carpool-links"]
    c.link_sender.refused = redis.exceptions.NoPermissionError("no permissions to run the 'zadd' command")
    with pytest.raises(redis.exceptions.NoPermissionError):
        c.housekeeping(clocks.mono())


def test_bin_settings_a_binless_policy_leaves_unused_are_named_at_start(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="carpool.coordinator.loop"):
        coordinator(clocks, workers=1, policy="fifo", bin_edges=(8, 16), auto_bins=3)
    assert (
        "CARPOOL_AUTO_BINS and CARPOOL_BIN_EDGES set, which CARPOOL_POLICY=fifo leaves unused" in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="carpool.coordinator.loop"):
        coordinator(clocks, workers=1, policy="fifo")
        coordinator(clocks, workers=1, bin_edges=(8, 16))  # binned: they are used
    assert "CARPOOL_BIN_EDGES" not in caplog.text and "CARPOOL_AUTO_BINS" not in caplog.text
