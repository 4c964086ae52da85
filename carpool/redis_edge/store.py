"""Redis state shared by coordinators and workers: in-flight requests, leases, heartbeats, reports.

A request's life in Redis:
  request list --take--> in flight (raw kept, lease set) --dispatch--> owned by a batch
    --claim (worker)--> running --ack--> gone (its result is in the result backend)
  and from any in-flight state, when its lease runs out (the holder died): --reap--> back at the
  front of the request list it came from (its priority's), verbatim.

Every step that must be atomic, or one round trip, is a Lua script in ``scripts/<name>.lua`` whose
header gives its KEYS, ARGV and reply; this module is the only Python that knows those layouts.
``take``'s pop and move into the in-flight hash are atomic, so a coordinator killed at any instant
leaves every request either in the list or in flight, never nowhere. Leases use Redis's clock (TIME),
so hosts with skewed clocks agree on expiry.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from carpool.errors import ConfigError
from carpool.redis_edge import lua, reply_text
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.replication import fence, script_then_wait

log = logging.getLogger(__name__)

REPORTS_TTL_S = 3600  # a dead coordinator's report list expires after this many idle seconds
REPORTS_KEPT = 10_000  # newest reports kept per coordinator
RENEW_CHUNK = 2000  # request ids per lease-renewal script (a few milliseconds of Redis each)
# Bytes of messages one take moves at most (past the message that reaches it): a take's reply
# stays well within any socket timeout however large the messages queued.
TAKE_MAX_BYTES = 8 * 1024 * 1024
DEAD_LETTERS_KEPT = 1000  # newest dead letters kept per request queue
DEAD_LETTER_BYTES = 16 * 1024  # a dead letter's entry, as stored, at most: its message's start fills it


# What a take moved into flight, as (request id, raw message), and the batch reports it popped.
Taken = tuple[list[tuple[str, bytes]], list[dict[str, Any]]]


#: How often a coordinator may take one links outbox entry to send its links (``outbox.lua``).
LINKS_TRIES = 3


@dataclass(frozen=True, slots=True)
class LinksDue:
    """What :meth:`RequestStore.links_due` took: the entries to send, and the ids of those dropped
    after :data:`LINKS_TRIES` takes."""

    entries: list[tuple[str, bytes]]
    dropped: list[str]


@dataclass(frozen=True, slots=True)
class ResultWrites:
    """Encoded results to store write-once: ``payloads[i]`` under ``keys[i]``, each for ``expiry_s``
    (0: for good);
    with ``inboxes`` (one per result, ``""`` for none), each result stored is also published in its
    inbox's one message, when that channel starts with ``inbox_prefix``."""

    keys: Sequence[bytes | str]
    payloads: Sequence[bytes]
    expiry_s: int
    inboxes: Sequence[str] = ()
    inbox_prefix: bytes | str = ""


@dataclass(frozen=True, slots=True)
class Consumers:
    """The batch queues live workers consume, as their heartbeats say: queue -> hostnames, and the
    live workers that did not say (a release before the heartbeat carried its queues)."""

    by_queue: dict[str, list[str]]
    unknown: list[str]

    def unserved(self, queues: Sequence[str]) -> list[str]:
        """Those of ``queues`` no live worker consumes; none while a live worker's queues are unknown
        (it may consume any of them)."""
        if self.unknown:
            return []
        return [queue for queue in queues if not self.by_queue.get(queue)]


def consumers(live: Sequence[str], declared: dict[Any, Any]) -> Consumers:
    """:class:`Consumers` of the ``live`` workers from the worker queues hash ``declared`` (raw
    replies); a value that is not a JSON list of names counts as unknown."""
    queues = {reply_text(k): v for k, v in declared.items()}
    by_queue: dict[str, list[str]] = {}
    unknown = []
    for hostname in sorted(live):
        try:
            names = json.loads(queues[hostname])
        except (KeyError, ValueError):
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            unknown.append(hostname)
            continue
        for name in names:
            by_queue.setdefault(name, []).append(hostname)
    return Consumers(by_queue, unknown)


def finish_call(
    writes: ResultWrites,
    *,
    inflight_keys: Sequence[str] = (),
    results_db: int | str = "",
    broker_db: int | str = "",
    report: str | bytes = "",
    events: tuple[str, bytes] | None = None,
    ack_ids: Sequence[str] = (),
    outbox: Sequence[tuple[int, str, bytes]] = (),
    outbox_due_ms: int = 0,
) -> tuple[list[bytes | str], list[Any]]:
    """(KEYS, ARGV) of ``finish.lua``. With only ``writes`` it stores the results (write-once, each
    published) in the caller's database and touches nothing else. ``inflight_keys``: lease, raw,
    owner, claimed, origin, report list, deaths and the links outbox's ZSET and HASH, needed when
    acknowledging or reporting. ``outbox``: (1-based index of the result, request id, entry) of the
    requests whose links go into the outbox, due ``outbox_due_ms`` from now, if this call stores
    their results."""
    if outbox and len(inflight_keys) < 9:
        raise ValueError("the links outbox needs the in-flight keys, its ZSET and HASH last")
    topic, message = events if events is not None else ("", b"")
    keys = [*writes.keys, *inflight_keys]
    args: list[Any] = [len(writes.payloads), results_db, broker_db, writes.expiry_s, *writes.payloads]
    args += [report, REPORTS_KEPT, REPORTS_TTL_S, topic, message]
    inboxes = writes.inboxes
    if inboxes:
        if len(inboxes) != len(writes.payloads) or not writes.inbox_prefix:
            raise ValueError("give one inbox per result (or none), and the prefix every inbox starts with")
        args += [len(inboxes), writes.inbox_prefix, *inboxes]
    else:
        args += [0, ""]
    args += [len(outbox), outbox_due_ms]
    for index, request_id, entry in outbox:
        args += [index, request_id, entry]
    args += ack_ids
    return keys, args


@dataclass(frozen=True, slots=True)
class Claimed:
    """What a claim found: per request 0 (not this batch's), 1 (claimed, to run) or 2 (claimed,
    answered already); how many batch messages waited on the batch queues named (None: not
    counted); and the next of them, as (its list, the raw message), where the claim was asked to
    take it and did."""

    flags: list[int]
    batches_queued: int | None
    taken: tuple[str, bytes] | None = None


class RequestStore:
    """The Redis edge for in-flight requests. One per process; thread-safe as redis-py is."""

    def __init__(
        self, client: redis.Redis, keys: Keys, lease_s: float, replicas: int = 0, wait_s: float = 1.0
    ) -> None:
        """``replicas`` > 0: :meth:`finish` and :meth:`replicated` WAIT for that many replicas, up to
        ``wait_s`` (see :mod:`carpool.redis_edge.replication`)."""
        self.client = client
        self.keys = keys
        self.lease_ms = max(1, int(lease_s * 1000))
        self.replicas = replicas
        self.wait_s = wait_s
        self._lagging = False  # the last WAIT saw fewer replicas than asked (warned once)
        # Request id -> how many times a worker died running it, for the requests taken that ever
        # had one die (requeue.lua counts them); popped as they are admitted.
        self.deaths: dict[str, int] = {}
        self._take = lua.register(client, "take")
        self._dispatch = lua.register(client, "dispatch")
        self._renew_held = lua.register(client, "renew_held")
        self._claim = lua.register(client, "claim")
        self._finish = lua.register(client, "finish")
        # The scripts run per batch or per step (a worker's two, the coordinator's take and
        # dispatch), on a connection each calling thread holds.
        held = lua.ThreadConnections(client)
        self._take_held = lua.HeldScript(self._take, held)
        self._dispatch_held = lua.HeldScript(self._dispatch, held)
        self._claim_held = lua.HeldScript(self._claim, held)
        self._finish_held = lua.HeldScript(self._finish, held)
        self._renew = lua.register(client, "renew")
        self._requeue = lua.register(client, "requeue")
        self._heartbeat = lua.register(client, "heartbeat")
        self._outbox = lua.register(client, "outbox")

    # --- coordinator ---------------------------------------------------------------------
    def take(self, count: int, reports_of: str | None = None, max_reports: int = 1000) -> Taken:
        """Atomically move up to ``count`` requests (highest priority list first) into flight, and pop
        the batch reports waiting for coordinator ``reports_of`` (none if None): one round trip."""
        keys, args = self._take_call(count, reports_of, max_reports)
        return self._taken(self._take_held(keys, args))

    def wait_then_take(
        self,
        wait_list: str,
        timeout_s: float,
        count: int,
        reports_of: str | None = None,
        max_reports: int = 1000,
    ) -> tuple[redis.ResponseError | None, Taken | None]:
        """Wait up to ``timeout_s`` for ``wait_list`` to hold an element, then :meth:`take`, sent in
        one write: Redis runs a blocked client's next command the moment its wait ends, so the
        take needs no round trip back to this process.

        The wait is ``BLMOVE wait_list wait_list RIGHT RIGHT``, an atomic rotation onto the list's own
        tail: it takes nothing out of Redis. Returns the wait's error (None once it was served or
        timed out) and the take's reply, or None when the take failed here (its script not loaded
        yet, say): the caller then calls :meth:`take`, which loads it or raises the error.
        Connection errors raise.
        """
        keys, args = self._take_call(count, reports_of, max_reports)
        # Redis >= 6 takes a fractional timeout.
        wait = ("BLMOVE", wait_list, wait_list, "RIGHT", "RIGHT", round(timeout_s, 3))
        waited, took = self._take_held.after(wait, keys, args)
        error = waited if isinstance(waited, redis.ResponseError) else None
        return error, None if isinstance(took, Exception) else self._taken(took)

    def _taken(self, reply: Any) -> Taken:
        """A take's reply as (requests, reports); how often a worker died running each request taken
        (those it ever did) is added to :attr:`deaths`, which the caller pops as it admits them."""
        flat, raw_reports, deaths = reply
        for i in range(0, len(deaths), 2):
            self.deaths[reply_text(deaths[i])] = int(deaths[i + 1])
        taken = [(reply_text(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]
        return taken, [json.loads(r) for r in raw_reports]

    def _take_call(self, count: int, reports_of: str | None, max_reports: int) -> tuple[list[str], list[int]]:
        keys = [
            self.keys.inflight_lease,
            self.keys.inflight_raw,
            self.keys.reports_for(reports_of or ""),
            self.keys.inflight_origin,
            self.keys.inflight_deaths,
            *self.keys.request_lists,
        ]
        return keys, [count, self.lease_ms, max_reports if reports_of is not None else 0, TAKE_MAX_BYTES]

    def dispatch(
        self,
        queue_list: str,
        batches: Sequence[tuple[str, Sequence[str], str | bytes]],
        events: tuple[str, bytes] | None = None,
    ) -> int:
        """Publish ``events`` (topic, raw), then for each (batch id, request ids, task message): record
        the batch as owner of its requests still in flight, renew their leases and LPUSH the message
        onto ``queue_list``. One script: atomic, one round trip. Returns the requests assigned."""
        topic, raw = events if events is not None else ("", b"")
        args: list[Any] = [self.lease_ms, topic, raw]
        for batch_id, ids, message in batches:
            args += [batch_id, len(ids), *ids, message]
        keys = [self.keys.inflight_lease, self.keys.inflight_owner, queue_list]
        return int(self._dispatch_held(keys, args))

    def renew_held(self, ids: Sequence[str]) -> int:
        """Renew leases of requests the coordinator holds or dispatched and no worker claimed yet.

        One script per :data:`RENEW_CHUNK` ids: a deep backlog's renewal in one script would hold
        Redis, and with it every worker's claim and finish, for as long as the whole renewal takes."""
        keys = [self.keys.inflight_lease, self.keys.inflight_owner, self.keys.inflight_claimed]
        renewed = 0
        for first in range(0, len(ids), RENEW_CHUNK):
            renewed += int(
                self._renew_held(keys=keys, args=[self.lease_ms, *ids[first : first + RENEW_CHUNK]])
            )
        return renewed

    def requeue(self, ids: Sequence[str]) -> int:
        """Hand ``ids`` back to the front of the request lists they came from now (shutdown)."""
        if not ids:
            return 0
        return int(self._requeue(keys=self._requeue_keys(), args=[0, *ids]))

    def reap(self, limit: int = 10_000) -> int:
        """Requeue requests whose holder stopped renewing their lease, each to the list it came from.
        Safe from any process."""
        return int(self._requeue(keys=self._requeue_keys(), args=[limit]))

    def _requeue_keys(self) -> list[str]:
        base = self.keys.request_queue
        others = [name for name in self.keys.request_lists if name != base]
        return [*self._forget_keys(), self.keys.inflight_deaths, self.keys.inflight_running, base, *others]

    def _forget_keys(self) -> list[str]:
        """The in-flight keys in the order requeue and finish take them: lease, raw, owner, claimed,
        origin."""
        k = self.keys
        return [k.inflight_lease, k.inflight_raw, k.inflight_owner, k.inflight_claimed, k.inflight_origin]

    def dead_letter(self, request_id: str, raw: bytes, reason: str) -> None:
        """Move a message that is not a carpool request out of flight into the dead-letter list, which
        keeps the newest :data:`DEAD_LETTERS_KEPT` (entries as :func:`dead_letter_entry` makes them:
        give ``reason`` from :func:`dead_letter_reason`, which names bytes that are not UTF-8)."""
        entry = dead_letter_entry(request_id, raw, reason)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.lpush(self.keys.dead_letter, entry)
            pipe.ltrim(self.keys.dead_letter, 0, DEAD_LETTERS_KEPT - 1)
            self._ack_into(pipe, [request_id])
            pipe.execute()

    # --- worker ---------------------------------------------------------------------------
    def claim(self, batch_id: str, ids: Sequence[str]) -> list[bool]:
        """Which of ``ids`` this batch still owns; marks them claimed so only the worker renews them."""
        if not ids:
            return []
        *flags, _ = self._claim(keys=self._claim_keys(), args=[batch_id, self.lease_ms, "", "", *ids])
        return [bool(int(f)) for f in flags]

    def claim_fresh(
        self,
        batch_id: str,
        ids: Sequence[str],
        result_keys: Sequence[str],
        results_db: int,
        batch_lists: Sequence[str] = (),
        take: str = "",
    ) -> Claimed:
        """:meth:`claim` and a check for stored results in one round trip: per id 0 (not this
        batch's), 1 (claimed, to run) or 2 (claimed, already answered). ``result_keys[i]`` is the
        result key of ``ids[i]`` in database ``results_db`` of this same Redis server. Also counts the
        messages waiting on ``batch_lists`` (the batch queues' lists) and, with ``take``, takes the
        next of them (the one BRPOP would deliver from the first list holding any) if it contains
        that text; another message is left where it is."""
        if not ids:
            return Claimed([], 0)
        reply = self._claim_held(
            keys=[*self._claim_keys(), *result_keys, *batch_lists],
            args=[batch_id, self.lease_ms, results_db, take, *ids],
        )
        flags, (queued, *taken) = [int(f) for f in reply[: len(ids)]], reply[len(ids) :]
        if taken:  # its list's position among those named, then the message
            position, raw = taken
            return Claimed(flags, int(queued), (batch_lists[int(position) - 1], raw))
        return Claimed(flags, int(queued))

    def _claim_keys(self) -> list[str]:
        return [self.keys.inflight_lease, self.keys.inflight_owner, self.keys.inflight_claimed]

    def finish(
        self,
        *,
        results_db: int,
        broker_db: int,
        writes: ResultWrites,
        ack_ids: Sequence[str],
        report: dict[str, Any] | None,
        coordinator: str,
        events: tuple[str, bytes] | None,
        outbox: Sequence[tuple[int, str, bytes]] = (),
    ) -> list[int]:
        """Store ``writes`` write-once (publishing each), acknowledge ``ack_ids``, push the report and
        publish ``events`` (topic, raw): one script, one round trip. Results live in database
        ``results_db`` of this server. Returns the 1-based indexes of the results stored. A call
        sent again with the same arguments, its reply lost, returns what its first sending stored
        and, when that was any result, pushes no second report nor events (see ``finish.lua``).
        ``outbox``: (index of the result, request id, entry) of the requests with links, filed in the
        links outbox with their results, due a lease from now; :meth:`links_sent` empties them."""
        keys, args = finish_call(
            writes,
            inflight_keys=[
                *self._forget_keys(),
                self.keys.reports_for(coordinator),
                self.keys.inflight_deaths,
                self.keys.links_due,
                self.keys.links_pending,
            ],
            results_db=results_db,
            broker_db=broker_db,
            report=orjson.dumps(report) if report is not None else "",
            events=events,
            ack_ids=ack_ids,
            outbox=outbox,
            outbox_due_ms=self.lease_ms,
        )
        if not self.replicas:
            return [int(i) for i in self._finish_held(keys=keys, args=args)]
        stored, acked = script_then_wait(self.client, self._finish, keys, args, self.replicas, self.wait_s)
        self._confirmed(acked, "a batch's results and acknowledgements")
        return [int(i) for i in stored]

    def answer(
        self,
        backend: Any,
        dbs: tuple[int, int] | None,
        writes: ResultWrites,
        ack_ids: Sequence[str],
        *,
        report: dict[str, Any] | None = None,
        coordinator: str = "",
        events: tuple[str, bytes] | None = None,
        outbox: Sequence[tuple[int, str, bytes]] = (),
    ) -> list[int]:
        """Answer requests: their results (write-once, each published), their acknowledgements, the
        report, the task events and the links outbox's entries of the results stored. One round trip
        when ``dbs`` (broker db, results db: ``Settings.shared_server_dbs``) says the results live on
        this server (:meth:`finish`); else ``backend.store_encoded`` stores the results on theirs and
        one trip here does the rest, filing only the links of results stored. Returns the 1-based
        indexes in ``writes`` of the results stored (the others had one)."""
        if dbs is not None:
            return self.finish(
                results_db=dbs[1],
                broker_db=dbs[0],
                writes=writes,
                ack_ids=ack_ids,
                report=report,
                coordinator=coordinator,
                events=events,
                outbox=outbox,
            )
        stored: list[int] = backend.store_encoded(writes)
        with self.client.pipeline(transaction=False) as pipe:
            done = set(stored)
            self.file_links_into(pipe, [(rid, e) for i, rid, e in outbox if i in done])
            self.ack_into(pipe, ack_ids, report, coordinator)
            if events is not None and len(stored) == len(writes.keys):  # as finish.lua publishes them
                pipe.publish(*events)
            pipe.execute()
        if self.replicas:  # the results' server, then the broker's, each WAITed on
            self.replicated("results", backend.client)
            self.replicated("acknowledgements")
        return stored

    def file_links_into(self, pipe: Any, entries: Sequence[tuple[str, bytes]]) -> None:
        """Queue on ``pipe`` what ``finish.lua`` files in the links outbox, for results stored on
        another server (due a lease from now by this process's clock)."""
        if not entries:
            return
        due = int(time.time() * 1000) + self.lease_ms
        pipe.zadd(self.keys.links_due, {request_id: due for request_id, _ in entries})
        pipe.hset(self.keys.links_pending, mapping=dict(entries))

    def links_sent(self, request_ids: Sequence[str]) -> None:
        """Empty the links outbox's entries of ``request_ids``, whose links were sent."""
        if not request_ids:
            return
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.links_due, *request_ids)
            pipe.hdel(self.keys.links_pending, *request_ids)
            pipe.hdel(self.keys.links_tries, *request_ids)
            replies = pipe.execute(raise_on_error=False)
        # The tries' count is the coordinators' (outbox.lua): an ACL older than it refuses its delete,
        # which leaves a count and no entry, harmless; the entry itself must go.
        for reply in replies[:2]:
            if isinstance(reply, Exception):
                raise reply

    def links_untried(self, request_ids: Sequence[str]) -> None:
        """Take back the last take's count of ``request_ids``' outbox entries (those still there):
        their links were not sent for an outage, which is no try of the process that took them."""
        if not request_ids:
            return
        with self.client.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hexists(self.keys.links_tries, request_id)
            counted = pipe.execute()
        with self.client.pipeline(transaction=False) as pipe:
            for request_id, there in zip(request_ids, counted, strict=True):
                if there:
                    pipe.hincrby(self.keys.links_tries, request_id, -1)
            pipe.execute()

    def links_due(self, limit: int = 100) -> LinksDue:
        """Up to ``limit`` (request id, entry) of the links outbox whose process did not send them
        within a lease, each leased to the caller for another lease (any process may call this;
        one gets each entry): send them, then :meth:`links_sent`. An entry taken
        :data:`LINKS_TRIES` times already is dropped instead (:attr:`LinksDue.dropped`)."""
        flat, dropped = self._outbox(
            keys=[self.keys.links_due, self.keys.links_pending, self.keys.links_tries],
            args=[limit, self.lease_ms, LINKS_TRIES],
        )
        entries = [(reply_text(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]
        return LinksDue(entries, [reply_text(d) for d in dropped])

    def links_renew(self, request_ids: Sequence[str]) -> None:
        """Make the outbox entries of ``request_ids`` due a lease from now (those still there): their
        links are being sent by the caller, which lives, so no other process takes them meanwhile."""
        if request_ids:
            due = int(time.time() * 1000) + self.lease_ms
            self.client.zadd(self.keys.links_due, dict.fromkeys(request_ids, due), xx=True)

    def replicated(self, what: str, client: redis.Redis | None = None) -> bool:
        """WAIT until the replicas have every write the master (of ``client``, by default this
        store's) applied so far; a no-op without ``replicas``. False, warned once until they catch
        up, when fewer confirmed in time."""
        if not self.replicas:
            return True
        return self._confirmed(fence(client or self.client, self.replicas, self.wait_s), what)

    def _confirmed(self, acked: int, what: str) -> bool:
        ok = acked >= self.replicas
        if not ok and not self._lagging:
            log.warning(
                "%s: only %d of CARPOOL_WAIT_REPLICAS=%d replicas confirmed within %gs; going on (a "
                "failover before they catch up makes these requests run again through lease recovery)",
                what,
                acked,
                self.replicas,
                self.wait_s,
            )
        elif ok and self._lagging:
            log.info("replicas confirm writes again")
        self._lagging = not ok
        return ok

    def renew_running(self, ids: Sequence[str]) -> None:
        if ids:
            self._renew(keys=[self.keys.inflight_lease], args=[self.lease_ms, *ids])

    def ack(self, ids: Sequence[str], report: dict[str, Any] | None = None, coordinator: str = "") -> None:
        """Forget answered requests, and send the batch report to its coordinator, in one trip."""
        with self.client.pipeline(transaction=False) as pipe:
            self.ack_into(pipe, ids, report, coordinator)
            pipe.execute()

    def ack_into(
        self, pipe: Any, ids: Sequence[str], report: dict[str, Any] | None = None, coordinator: str = ""
    ) -> None:
        """Queue :meth:`ack`'s commands on ``pipe`` (the caller adds its own and executes)."""
        self._ack_into(pipe, ids)
        if report is not None:
            key = self.keys.reports_for(coordinator)
            pipe.lpush(key, json.dumps(report))
            pipe.ltrim(key, 0, REPORTS_KEPT - 1)
            pipe.expire(key, REPORTS_TTL_S)

    def _ack_into(self, pipe: Any, ids: Sequence[str]) -> None:
        if ids:
            pipe.zrem(self.keys.inflight_lease, *ids)
            pipe.hdel(self.keys.inflight_raw, *ids)
            pipe.hdel(self.keys.inflight_owner, *ids)
            pipe.hdel(self.keys.inflight_claimed, *ids)
            pipe.hdel(self.keys.inflight_origin, *ids)
            pipe.hdel(self.keys.inflight_deaths, *ids)

    def heartbeat(self, hostname: str, ttl_s: float, batch_queues: Sequence[str] | None = None) -> int:
        """Announce ``hostname`` for ``ttl_s`` (with the batch queues it consumes, when given, which
        also drops those of workers gone silent); returns how many workers are live."""
        keys, args = [self.keys.workers], [hostname, str(int(ttl_s * 1000))]
        if batch_queues is not None:
            keys.append(self.keys.worker_queues)
            args.append(json.dumps(list(batch_queues)))
        return int(self._heartbeat(keys=keys, args=args))

    def live_workers(self) -> int:
        return int(self._heartbeat(keys=[self.keys.workers], args=["", 0]))

    def batch_queue_workers(self) -> Consumers:
        """Which live workers consume which batch queues, as their heartbeats say."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.zrange(self.keys.workers, 0, -1, withscores=True)
            pipe.hgetall(self.keys.worker_queues)
            (secs, micros), scored, declared = pipe.execute()
        now_ms = int(secs) * 1000 + int(micros) // 1000
        return consumers([reply_text(name) for name, expiry in scored if expiry > now_ms], declared)

    def leave(self, hostname: str) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.workers, hostname)
            pipe.hdel(self.keys.worker_queues, hostname)
            pipe.execute()

    def remember_revoked(self, ids: Sequence[str], now_s: float, keep_s: float, keep: int) -> None:
        """Record ``ids`` as revoked at ``now_s`` (wall clock; an id recorded already keeps its
        first time, whoever heard it); the set keeps those of the last ``keep_s`` seconds, at most
        the ``keep`` latest (0: no limit, as Celery reads its own settings)."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(self.keys.revoked, dict.fromkeys(ids, now_s), nx=True)
            if keep_s > 0:
                pipe.zremrangebyscore(self.keys.revoked, "-inf", f"({now_s - keep_s}")
            if keep > 0:
                pipe.zremrangebyrank(self.keys.revoked, 0, -keep - 1)
            pipe.execute()

    def revoked_since(self, since_s: float | None) -> list[tuple[str, float]]:
        """(request id, when heard revoked) of the revokes recorded since ``since_s`` (None: all)."""
        low = "-inf" if since_s is None else since_s
        found: list[tuple[bytes, float]] = self.client.zrangebyscore(  # type: ignore[assignment]  # redis-py's union of replies
            self.keys.revoked, low, "+inf", withscores=True
        )
        return [(reply_text(request_id), float(at)) for request_id, at in found]

    def pop_reports(self, coordinator: str, count: int = 1000) -> list[dict[str, Any]]:
        raw = self.client.rpop(self.keys.reports_for(coordinator), count)
        return [json.loads(r) for r in raw or () if isinstance(r, bytes | str)]

    # --- introspection --------------------------------------------------------------------
    def queued(self) -> int:
        with self.client.pipeline(transaction=False) as pipe:
            for key in self.keys.request_lists:
                pipe.llen(key)
            return sum(pipe.execute())

    def in_flight(self) -> int:
        return int(self.client.zcard(self.keys.inflight_lease))


# How Redis words a command refused inside a script under the user's ACL rules: 6.2 and 7.0, then
# 7.2 on ("ERR ACL failure in script: User <u> has no permissions to run the '<cmd>' command").
_SCRIPT_REFUSALS = ("can't run this command", "ACL failure in script")


def refused_by_acl(error: BaseException) -> bool:
    """Whether Redis refused a command, or a command one of carpool's scripts called, under the
    calling user's ACL rules."""
    return isinstance(error, redis.exceptions.NoPermissionError) or (
        isinstance(error, redis.ResponseError) and any(words in str(error) for words in _SCRIPT_REFUSALS)
    )


def acl_refusal(role: str, client: Any, error: BaseException) -> ConfigError:
    """The deployment error a refusal under the ACL rules of ``role``'s Redis user is: what Redis
    said and how to mend it (a release's scripts may call commands an older release's rules lack)."""
    username = client.connection_pool.connection_kwargs.get("username") or "default"
    return ConfigError(
        f"the {role}'s Redis user {username!r} may not run a command carpool calls ({error}); "
        f"regenerate its rules with `carpool acl --role {role}` (after an upgrade too: a release may "
        "call commands an older one did not) and load them into Redis"
    )


# A '"id": "..."' key's value in a raw message (escapes kept as written).
_ID_VALUE = re.compile(rb'"id": ?"((?:[^"\\]|\\.)*)"')


def utf8_fault(raw: bytes) -> str:
    """What in ``raw`` is not UTF-8, in words, or ``""`` when all of it is: its first task id that is
    not (``take.lua`` names such a message's request ``carpool-garbage-<sha1>``, as it does one
    without an id), else the bytes around the first fault."""
    try:
        raw.decode()
    except UnicodeDecodeError as exc:
        for match in _ID_VALUE.finditer(raw):
            try:
                match.group(1).decode()
            except UnicodeDecodeError:
                return f"its task id {match.group(1)!r} is not UTF-8"
        around = raw[max(0, exc.start - 20) : exc.end + 20]
        return f"it is not UTF-8 (at byte {exc.start}: {around!r})"
    return ""


def dead_letter_entry(request_id: str, raw: bytes, reason: str, at: float | None = None) -> bytes:
    """A dead letter as stored (JSON): the id it was taken under, why, when (epoch seconds), the
    message's size in bytes and as much of its start as text (bytes that are not UTF-8 replaced)
    as keeps the entry within :data:`DEAD_LETTER_BYTES`, so that a flood of huge garbage cannot
    fill Redis's memory, whatever characters it holds."""
    prefix = raw[:DEAD_LETTER_BYTES]
    text = prefix.decode("utf-8", "replace")
    entry: dict[str, Any] = {
        "id": request_id,
        "reason": reason,
        "at": round(time.time() if at is None else at, 3),
        "bytes": len(raw),
        "raw": text,
        "truncated": len(prefix) < len(raw),
    }
    encoded = json.dumps(entry, ensure_ascii=False).encode()
    while len(encoded) > DEAD_LETTER_BYTES and entry["raw"]:
        # Escaped characters (control bytes) and replacements take more than a byte each: cut the
        # text in proportion, a little more each time, until the entry fits.
        keep = len(entry["raw"]) * DEAD_LETTER_BYTES // len(encoded) - 16
        entry["raw"], entry["truncated"] = entry["raw"][: max(keep, 0)], True
        encoded = json.dumps(entry, ensure_ascii=False).encode()
    return encoded


def dead_letter_reason(reason: str, raw: bytes) -> str:
    """``reason``, and for a message that is not UTF-8 what in it is not (:func:`utf8_fault`)."""
    fault = utf8_fault(raw)
    return f"{reason}; {fault}" if fault else reason
