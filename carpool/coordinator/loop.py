"""The coordinator process: Redis request list -> policy -> Celery batch tasks on the batch queue.

One ``step``: take requests atomically into flight together with the reports of batches still out
(one round trip), turn them into the policy's requests (``intake``: a small take at once, a large one
chunk by chunk on the intake stage's threads, ``stage``, admitting the chunks finished by each step),
ask the policy what leaves now when something changed (``waiting``), publish those batches in one
script call, fail what expired.
Housekeeping (lease renewal, recovery of requests whose holder died, worker count) runs every
quarter lease.

Celery's semantics on the way: a request with an eta (``countdown=`` / ``eta=``) is held, leased,
until then (``deferred``); one revoked while held here, or before it is taken, is answered REVOKED
(``revokes``); a refused request's failure goes on to its chain and error callbacks (``links``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import redis
from celery import Celery
from celery.exceptions import TaskRevokedError

from carpool.batching import Batch, BatchPolicy, LatencyModel, Plan, Request
from carpool.batching.capacity import Capacity, free_workers, pool_capacity
from carpool.celery_edge import links
from carpool.celery_edge.events import TaskEvents
from carpool.celery_edge.requests import Incoming
from carpool.celery_edge.results import FAILURE, REVOKED
from carpool.config import Settings
from carpool.coordinator import policy_config, revokes, task_policy_config
from carpool.coordinator.deferred import Deferred
from carpool.coordinator.intake import Intake, Malformed, Refused, take_in
from carpool.coordinator.metrics import CoordinatorMetrics
from carpool.coordinator.publish import BatchPublisher
from carpool.coordinator.stage import IntakeStage, auto_threads
from carpool.coordinator.stats import CoordinatorStats, StatsWriter
from carpool.coordinator.waiting import Pacer, Wait, WaitFor
from carpool.errors import ConfigError, DeadlineExceeded, WireError
from carpool.redis_edge.connect import client_for
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.socket_options import client_options
from carpool.redis_edge.store import RequestStore, Taken
from carpool.registry import import_task_modules, registered, routing_keys
from carpool.wire import Links, RequestSlot, read_report

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # how often counters reach Redis for `carpool status` and the demo


# A take made ahead of the step that uses it: how many requests it asked for, and what it got.
_Take = tuple[int, Taken]


@dataclass(slots=True)
class _Outstanding:
    ids: list[str]
    model: str
    predicted_s: float
    dispatched_s: float


class Coordinator:
    def __init__(
        self,
        settings: Settings,
        app: Celery,
        client: redis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.app = app
        self.backend = app.backend
        self.client = client or client_for(settings.broker_url, settings, **client_options(settings))
        self.keys = Keys(settings.request_queue)
        self.store = RequestStore(
            self.client,
            self.keys,
            settings.recovery_timeout_s,
            settings.wait_replicas,
            settings.wait_timeout_s,
        )
        self.clock = clock
        self.wall = wall
        self.latency = LatencyModel()
        import_task_modules(settings.imports)
        self.specs = registered()  # carpool.infer and the tasks of CARPOOL_IMPORTS, by name
        # Requests are batched per routing key: infer's model, else the task's name.
        self.task_of_key = routing_keys(self.specs.values(), settings)
        base = policy_config(settings)
        self.policy = BatchPolicy(
            base, self.latency, per_key={k: task_policy_config(base, s) for k, s in self.task_of_key.items()}
        )
        self.outstanding: dict[str, _Outstanding] = {}
        self.workers = 0
        self.stats = CoordinatorStats()
        self.pacer = Pacer(settings.idle_poll_s)
        self.deferred = Deferred()  # requests waiting for their eta, leased like those in the policy
        self.stage = IntakeStage(self._take_chunk, auto_threads(settings.tokenizer_threads))
        self.revokes: revokes.RevokeListener | None = None  # started by run()
        self._revoked = revokes.Revoked()  # a request revoked before it is taken is never batched
        self.stopping = threading.Event()
        self.hostname = f"carpool-coordinator-{os.getpid()}@{socket.gethostname()}"
        self.events = TaskEvents(app, self.hostname, enabled=settings.events, client=self.client)
        self.metrics = CoordinatorMetrics(task_of=self._task_name)
        self._held: set[str] = set()
        self._next_housekeeping = 0.0
        self._next_stats = 0.0
        self._stats_writer = StatsWriter(self.client, self.keys, self.hostname, self.wall)
        self._wait_lists = {
            WaitFor.REPORTS: self.keys.reports_for(self.hostname),
            WaitFor.REQUESTS: self.keys.request_queue,
        }
        self._refused_kinds: set[tuple[str, str]] = set()
        # Kept for the process's life: the builder renders batch messages from a template it learns
        # from Celery's own first messages.
        self.publisher = BatchPublisher(app, self.store, settings, self.task_of_key, self.hostname)

    def _task_name(self, key: str) -> str:
        spec = self.task_of_key.get(key)
        return key if spec is None else spec.name

    # --- process -------------------------------------------------------------------------
    def run(self) -> None:
        self.metrics.serve(self.settings.metrics_port)
        log.info(
            "coordinator serving %s on %s (policy=%s max_batch=%d max_tokens=%d)",
            ",".join(self.settings.served_models),
            self.settings.request_queue,
            self.settings.policy,
            self.settings.max_batch,
            self.settings.max_tokens,
        )
        self.warm_up()
        self.revokes = revokes.listen(self.app, self.settings)
        try:
            self._loop()
        finally:
            # Also when a ConfigError ends the loop: what this process holds goes back at once.
            if self.revokes is not None:
                self.revokes.stop()
            self.shutdown()

    def _loop(self) -> None:
        backoff = 0.1
        taken: _Take | None = None  # what the last wait took on its way out
        while not self.stopping.is_set():
            try:
                ahead, taken = taken, None
                wait = self.step(ahead)
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Redis restarts: keep what we hold in memory; leases we miss are recovered by reap.
                log.warning("redis unavailable (%s); retrying in %.1fs", exc, backoff)
                self.stopping.wait(backoff)
                backoff = min(5.0, backoff * 2)
                continue
            except Exception:
                # A bug or a surprise must not take the queue down with it: what we hold stays
                # leased (and is recovered if this repeats until the process is replaced).
                log.exception("coordinator step failed; retrying in %.1fs", backoff)
                self.stopping.wait(backoff)
                backoff = min(5.0, backoff * 2)
                continue
            if wait.seconds > 0:
                taken = self._wait(wait)

    def warm_up(self) -> None:
        """Build what each task measures requests with (infer: the tokenizers) before taking any."""
        # The intake stage's threads are the tokenizers' parallelism: a pool inside each call would
        # only compete with them (and with the loop) for the same cores.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        for spec in self.specs.values():
            spec.warm_up(self.settings)

    def install_signal_handlers(self) -> None:
        def _stop(signum: int, _frame: Any) -> None:
            log.info("signal %d: handing back held requests and stopping", signum)
            self.stopping.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def shutdown(self) -> None:
        """Hand every request not yet dispatched back to the front of the request queue."""
        held = [r.id for r in self.policy.drain() + self.deferred.drain()] + self.stage.drain()
        self.stage.close()
        try:
            returned = self.store.requeue(held)
        except redis.ConnectionError:
            log.warning("redis unavailable at shutdown; %d held requests return after their lease", len(held))
            return
        self._held.clear()
        self._stats_writer.leave()
        log.info("handed back %d requests", returned)

    # --- one step ------------------------------------------------------------------------
    def step(self, ahead: _Take | None = None) -> Wait:
        """One iteration; returns how to wait before the next. ``ahead``: the take the wait before it
        made on its way out, used instead of taking again."""
        if self.workers == 0:
            self._bookkeeping(self.clock())  # nothing could leave before the worker count is known
        if self.revokes is not None:
            heard = self.revokes.take()
            if heard:
                self._revoke(heard)
        # One round trip: new requests, and the reports of batches still out (none asked when none are).
        taken: list[tuple[str, bytes]] = []
        reports: list[dict[str, Any]] = []
        if ahead is not None:
            take_n, (taken, reports) = ahead
        else:
            take_n = self._take_count()
            if take_n or self.outstanding:
                taken, reports = self.store.take(take_n, reports_of=self._reports_of())
        if reports:
            self._apply_reports(reports)
        if taken:
            # In flight on the replicas too before any of it is batched.
            if self.settings.wait_replicas:
                self.store.replicated("requests taken into flight")
            self._take_in(taken, self.clock())
        if self.stage.busy:
            self._admit_finished()
        now = self.clock()
        next_eta_s = None
        if len(self.deferred):
            next_eta_s = self._release_due(now)
        if self.pacer.poll_due(now):
            self.pacer.polled(now, self._dispatch(now))
        self.events.flush()
        # After the dispatch: a request that woke this step does not wait behind the bookkeeping.
        self._bookkeeping(now)
        busy = self.workers > 0 and free_workers(self.workers, len(self.outstanding)) == 0
        return self.pacer.next_wait(
            now,
            full_take=take_n > 0 and len(taken) >= take_n,
            held=len(self.policy),
            all_workers_busy=busy,
            next_eta_s=next_eta_s,
            intake_busy=self.stage.busy,
        )

    def _reports_of(self) -> str | None:
        """Whose batch reports a take pops: this coordinator's while it has batches out, else none."""
        return self.hostname if self.outstanding else None

    def _take_count(self) -> int:
        """How many requests to take now: none while the intake stage has more than half a take to
        prepare, else enough to bring it to a full take (which keeps its threads busy between takes)."""
        backlog = len(self.stage)
        if backlog > self.settings.take_max // 2:
            return 0
        return self.settings.take_max - backlog

    def _bookkeeping(self, now: float) -> None:
        """Housekeeping and the stats, when due."""
        if now >= self._next_housekeeping:
            self.housekeeping(now)
            self._next_housekeeping = now + min(1.0, self.settings.recovery_timeout_s / 4)
        if now >= self._next_stats:
            self._write_stats()
            self._next_stats = now + STATS_INTERVAL_S

    def _wait(self, wait: Wait) -> _Take | None:
        """Sleep ``wait.seconds``, or less if its list gets an element first, in Redis
        (:meth:`RequestStore.wait_then_take`: waiting takes nothing out of Redis, and the next step's
        take runs in Redis the moment the wait ends). Returns that take, for the next step."""
        if wait.block_on is None:
            self.stopping.wait(wait.seconds)
            return None
        if wait.block_on is WaitFor.INTAKE:
            self.stage.ready.wait(wait.seconds)
            return None
        key = self._wait_lists[wait.block_on]
        take_n = self._take_count()
        try:
            error, taken = self.store.wait_then_take(key, wait.seconds, take_n, self._reports_of())
        except (redis.ConnectionError, redis.TimeoutError):
            # The next step meets the same error and backs off; a take that ran unanswered holds
            # its requests under a lease that runs out.
            self.stopping.wait(wait.fallback_s)
            return None
        ahead = None if taken is None else (take_n, taken)
        if isinstance(error, redis.exceptions.NoPermissionError):
            # An ACL user without BLMOVE is a deployment error, not an old Redis: polling instead
            # would hide it behind a busy loop. What the take moved into flight goes back first.
            if ahead is not None:
                self.store.requeue([request_id for request_id, _ in ahead[1][0]])
            username = self.client.connection_pool.connection_kwargs.get("username") or "default"
            raise ConfigError(
                f"the coordinator's Redis user {username!r} may not BLMOVE {key!r} ({error}); grant it "
                "+blmove on its request and report lists, as `carpool acl --role coordinator` does"
            ) from error
        if error is not None:  # Redis < 6.2: no BLMOVE
            log.info("this Redis has no BLMOVE (6.2+); polling instead")
            self.pacer.cannot_block()
            self.stopping.wait(wait.fallback_s)
        return ahead

    def _capacity(self) -> Capacity:
        return pool_capacity(
            self.workers, self.settings.prefetch_batches, (o.predicted_s for o in self.outstanding.values())
        )

    # --- intake --------------------------------------------------------------------------
    def _take_in(self, taken: list[tuple[str, bytes]], now: float) -> None:
        """Admit ``taken`` at once when it is small and the stage idle (a lone request gets no extra
        hop), else hand it to the intake stage."""
        self.stats.taken += len(taken)
        self.metrics.requests.inc(len(taken))
        if len(self._revoked):
            taken, revoked = self._revoked.split(taken)
            if revoked:
                self._answer_revoked(revoked)
        room = self.settings.max_pending - len(self.policy) - len(self.deferred) - self.stage.reserved
        if self.stage.busy or len(taken) > self.settings.max_batch:
            self.stage.submit(taken, room)
        else:
            self._admit(self._take_chunk(taken, room), now)

    def _take_chunk(self, taken: Sequence[tuple[str, bytes]], room: int) -> Intake:
        """``taken`` as requests for the policy and refusals, at most ``room`` admitted (any thread)."""
        return take_in(
            taken, settings=self.settings, specs=self.specs, room=room, now=self.clock(), wall_now=self.wall()
        )

    def _admit_finished(self) -> None:
        """Admit the chunks the intake stage finished; a request revoked meanwhile is answered so."""
        intakes, errors = self.stage.finished()
        for error in errors:
            log.error(
                "preparing taken requests failed; they return to the queue when their lease runs out",
                exc_info=error,
            )
        now = self.clock()
        for intake in intakes:
            if len(self._revoked):
                revoked = [msg.id for msg, _ in intake.admitted if msg.id in self._revoked]
                if revoked:
                    inboxes = {m.id: m.inbox for m, _ in intake.admitted if m.inbox and m.id in self._revoked}
                    self._answer_revoked(revoked, inboxes)
                    gone = set(revoked)
                    intake.admitted = [(m, r) for m, r in intake.admitted if m.id not in gone]
            self._admit(intake, now)

    def _admit(self, intake: Intake, now: float) -> None:
        for bad in intake.malformed:
            self._dead_letter(bad)
        refused = intake.refused
        for msg, request in intake.admitted:
            self._held.add(request.id)
            if msg.eta_at is not None and request.arrival_s > now:
                refusal = self._defer(msg, request, now)
                if refusal is not None:
                    refused.append(refusal)
                continue
            self.policy.add(request)
            if msg.links is None:
                self.events.received(request.id, msg.argsrepr, msg.kwargsrepr, name=msg.task)
            else:
                self._received(msg)
        if refused:
            self._fail(refused)
        self.pacer.changed()

    def _received(self, msg: Incoming, eta: str | None = None) -> None:
        links = msg.links or {}
        self.events.received(
            msg.id,
            msg.argsrepr,
            msg.kwargsrepr,
            name=msg.task,
            root_id=links.get("root_id"),
            parent_id=links.get("parent_id"),
            eta=eta,
        )

    # --- revoke ---------------------------------------------------------------------------
    def _revoke(self, ids: list[str]) -> None:
        """Remember revoked ``ids``, and answer REVOKED those held here (for their eta, or while no
        worker is up). Dispatched ones are the workers' to check when they claim them."""
        self._revoked.remember(ids)
        revoked = set(ids)
        held = self.deferred.discard(revoked) + self.policy.discard(revoked)
        if held:
            self._answer_revoked([r.id for r in held], _inboxes(r.payload for r in held))
            self.pacer.changed()

    def _answer_revoked(self, ids: list[str], inboxes: dict[str, str] | None = None) -> None:
        """Answer ``ids`` REVOKED (``inboxes``: the result inboxes of those whose producer named one)."""
        self._held.difference_update(ids)
        entries = [(i, REVOKED, TaskRevokedError("revoked")) for i in ids]
        self.backend.store_many(entries, inboxes=inboxes)
        self.store.ack(ids)
        for request_id in ids:
            self.events.revoked(request_id)
        log.info("revoked %d requests before they were batched", len(ids))

    # --- countdown / eta -----------------------------------------------------------------
    def _defer(self, msg: Incoming, request: Request, now: float) -> Refused | None:
        """Hold ``request`` until its eta (it stays leased in flight meanwhile), or refuse it when it
        expires first: it could never run."""
        if request.deadline_s <= request.arrival_s:
            self._held.discard(request.id)
            error = DeadlineExceeded(
                f"the request expires {request.arrival_s - request.deadline_s:.3f} s before its eta "
                "(countdown/eta later than expires); send it with an expires after its eta"
            )
            return Refused(request.id, "deadline", error, message=msg)
        self.deferred.add(request, request.arrival_s)
        assert msg.eta_at is not None
        self._received(msg, eta=datetime.fromtimestamp(msg.eta_at, UTC).isoformat())
        return None

    def _release_due(self, now: float) -> float | None:
        """Move the requests whose eta has come into the policy; returns when the next one comes due."""
        due = self.deferred.due(now)
        if due:
            for request in due:
                self.policy.add(request)
            self.pacer.changed()
        return self.deferred.next_due_s()

    def _dead_letter(self, bad: Malformed) -> None:
        log.warning("dead-lettering message %s: %s", bad.id, bad.reason)
        self.store.dead_letter(bad.id, bad.raw, bad.reason)
        self.stats.failed["malformed"] += 1
        self.metrics.failed("malformed")

    def _fail(self, refused: list[Refused]) -> None:
        """Store each refusal as its request's failure (and its chain steps'), acknowledge them, then
        call their error callbacks (:mod:`carpool.celery_edge.links`)."""
        entries: list[tuple[str, str, Any]] = [(r.id, FAILURE, r.error) for r in refused]
        linked: list[tuple[Refused, str | None, Links]] = []
        for r in refused:
            task, lk = r.task_and_links()
            if lk:
                linked.append((r, task, lk))
                entries += links.chain_failures(lk, r.error)
        inboxes = {r.id: inbox for r in refused if (inbox := r.inbox_of()) is not None}
        stored = self.backend.store_many(entries, inboxes=inboxes)
        self.store.ack([r.id for r in refused])
        for r in refused:
            self.stats.failed[r.reason] += 1
            self.metrics.failed(r.reason)
            if r.message is not None:  # refused at intake: Flower has not seen it received yet
                self.events.received(r.id, r.message.argsrepr, r.message.kwargsrepr, name=r.message.task)
            self.events.failed(r.id, r.error)
            log.info("request %s failed (%s): %s", r.id, r.reason, r.error)
        if linked:
            answered = set(stored)
            for r, task, lk in linked:
                if r.id in answered:
                    links.on_failure(self.app, r.id, task, lk, r.error)

    # --- dispatch ------------------------------------------------------------------------
    def _dispatch(self, now: float) -> float | None:
        """Carry out the policy's plan for ``now``; returns when the plan wants asking again."""
        if self.workers == 0:
            # Nobody could run a batch: hold everything (a deadline flush would only expire in the
            # batch queue) and fail what expires here.
            plan = Plan(expired=self.policy.expire(now), wake_at_s=self.policy.next_deadline())
        else:
            cap = self._capacity()
            plan = self.policy.poll(now, cap.free_workers, cap.free_slots, cap.ahead_s)
        if plan.expired:
            where = "in the coordinator's queue"
            self._held.difference_update(r.id for r in plan.expired)
            self._fail(
                [
                    Refused(
                        r.id,
                        "deadline",
                        DeadlineExceeded.waited(now - r.deadline_s, where),
                        task=self._task_name(r.model),
                        links=cast("RequestSlot", r.payload).get("links"),
                        inbox=cast("RequestSlot", r.payload).get("inbox"),
                    )
                    for r in plan.expired
                ]
            )
        if plan.batches:
            self._publish(plan.batches, now)
        return plan.wake_at_s

    def _publish(self, batches: list[Batch], now: float) -> None:
        """Hand ``batches`` on (:mod:`carpool.coordinator.publish`); a group Redis did not take goes
        back into the policy, still held and leased by us, to leave with a later plan."""
        wall_now = self.wall()
        for queue, group in self.publisher.by_queue(batches).items():
            try:
                batch_ids = self.publisher.publish(queue, group, wall_now, self.events.take())
            except Exception:
                for batch in group:
                    for req in batch.requests:
                        self.policy.add(req)
                self.pacer.changed()
                raise
            for batch_id, batch in zip(batch_ids, group, strict=True):
                self._dispatched(batch_id, batch, now)

    def _dispatched(self, batch_id: str, batch: Batch, now: float) -> None:
        ids = [r.id for r in batch.requests]
        predicted = self.latency.predict(batch.model, batch.padded_tokens)
        self.outstanding[batch_id] = _Outstanding(ids, batch.model, predicted, now)
        self._held.difference_update(ids)
        self.stats.batches += 1
        self.stats.dispatched += batch.size
        self.stats.padded_tokens += batch.padded_tokens
        self.stats.real_tokens += batch.real_tokens
        self.stats.flush[batch.flush_reason.value] += 1
        self.stats.sizes[batch.size] += 1
        self.metrics.batch_dispatched(
            batch.model,
            batch.bin_label,
            batch.size,
            batch.padded_tokens,
            batch.real_tokens,
            batch.flush_reason.value,
            [now - r.arrival_s for r in batch.requests],
        )

    # --- housekeeping --------------------------------------------------------------------
    def housekeeping(self, now: float) -> None:
        self._apply_reports(self.store.pop_reports(self.hostname))  # also of batches given up on
        self.pacer.changed()  # worker count, given-up batches and recovered requests change slots
        self.workers = self.store.live_workers()
        self.metrics.workers.set(self.workers)
        # A dispatched batch that no report closed within a lease died with its worker; the
        # reap below (here or in another coordinator) brings its requests back.
        horizon = self.settings.recovery_timeout_s
        for batch_id, out in list(self.outstanding.items()):
            if now - out.dispatched_s > horizon + 4 * out.predicted_s:
                log.warning(
                    "batch %s (%d requests) never reported; leaving it to recovery", batch_id, len(out.ids)
                )
                del self.outstanding[batch_id]
        renew = list(self._held) + self.stage.held_ids()
        for out in self.outstanding.values():
            renew.extend(out.ids)
        self.store.renew_held(renew)
        recovered = self.store.reap()
        if recovered:
            log.warning("recovered %d requests whose holder stopped renewing its lease", recovered)

    def _apply_reports(self, reports: list[dict[str, Any]]) -> None:
        for raw in reports:
            try:
                report = read_report(raw)
            except WireError as exc:
                self._refuse_report(raw, exc)
                continue
            self.pacer.changed()  # a slot freed, and the latency model learnt something
            out = self.outstanding.pop(report["batch_id"], None)
            if out is None:
                log.debug("report for batch %s dispatched by another coordinator", report["batch_id"])
            run_s = report["run_s"]
            if report["padded_tokens"] and run_s is not None:
                self.latency.observe(report["model"], report["padded_tokens"], run_s)
                self.metrics.batch_ran(report["model"], report["device"], run_s)
            # Failures decided on the worker count with the coordinator's own, in metrics and stats.
            for reason, n in (("model", report["failed_model"]), ("deadline", report["failed_deadline"])):
                if n:
                    self.stats.failed[reason] += n
                    self.metrics.failed(reason, n)

    def _refuse_report(self, raw: object, exc: WireError) -> None:
        """Log a report this release cannot read: loudly the first time, then quietly."""
        kind = (type(exc).__name__, repr(raw.get("version")) if isinstance(raw, dict) else "")
        if kind in self._refused_kinds:
            log.debug("batch report refused: %s", exc)
            return
        self._refused_kinds.add(kind)
        log.error("batch report refused (more like it are logged at debug level): %s", exc)

    def _write_stats(self) -> None:
        depths = self.policy.depth_by_bin()
        self.metrics.set_depths(depths)
        # Requests still in the intake stage wait too: taken, not yet in a bin.
        gauges = {"pending": len(self.policy) + len(self.stage), "outstanding": len(self.outstanding)}
        self._stats_writer.write(self.stats, depths, gauges, self._task_name)


def _inboxes(slots: Iterable[object]) -> dict[str, str]:
    """Request id -> result inbox, for the request slots whose producer named one."""
    out = {}
    for slot in cast("Iterable[RequestSlot]", slots):
        inbox = slot.get("inbox")
        if inbox is not None:
            out[slot["id"]] = inbox
    return out
