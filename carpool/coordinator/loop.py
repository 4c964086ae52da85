"""The coordinator process: Redis request list -> policy -> Celery batch tasks on the batch queue.

One ``step``: take requests atomically into flight together with the reports of batches still out
(one round trip; ``reports`` closes those batches), turn the requests into the policy's and hold
them (``admission``; ``intake``: a small take at once, a large one chunk by chunk on the intake
stage's threads, ``stage``, admitting the chunks finished by each step), ask the policy what leaves
now when something changed (``waiting``), publish those batches in one script call and fail what
expired (``dispatch``, ``publish``).
Housekeeping (recovery of requests whose holder died, worker count, batches never reported) runs
every second (every quarter lease below 4 s); the leases of what the coordinator holds are renewed
from it once per quarter lease.

Celery's semantics on the way: a request with an eta (``countdown=`` / ``eta=``) is held, leased,
until then (``deferred``); one revoked while held here, or before it is taken, is answered REVOKED
(``revokes``); a refused request's failure goes on to its chain and error callbacks (``answers``,
``links``).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from celery import Celery

from carpool import collector
from carpool.batching import BatchPolicy, LatencyModel
from carpool.batching.capacity import free_workers
from carpool.celery_edge.events import TaskEvents
from carpool.celery_edge.options import check_app_conf
from carpool.config import Settings
from carpool.coordinator import policy_config, revokes, task_policy_config
from carpool.coordinator.admission import admit_finished, admit_taken, count_requeued, release_due
from carpool.coordinator.answers import revoke
from carpool.coordinator.deferred import Deferred
from carpool.coordinator.dispatch import OutstandingBatch, dispatch
from carpool.coordinator.intake import Intake, take_in
from carpool.coordinator.metrics import CoordinatorMetrics
from carpool.coordinator.outbox import LinkSender, send_due_links
from carpool.coordinator.publish import BatchPublisher
from carpool.coordinator.reports import apply_reports, give_up_unreported
from carpool.coordinator.signals import set_on_signals
from carpool.coordinator.stage import IntakeStage, auto_threads
from carpool.coordinator.stats import CoordinatorStats, StatsWriter, serving
from carpool.coordinator.waiting import Pacer, Wait, WaitFor
from carpool.errors import ConfigError, UnknownModel
from carpool.names import coordinator_hostname
from carpool.redis_edge.connect import (
    UNREACHABLE,
    EvictionWatch,
    check_server,
    client_for,
    deployment_hint,
    missing_database,
)
from carpool.redis_edge.keys import OUTSTANDING_ON, Keys
from carpool.redis_edge.socket_options import client_options
from carpool.redis_edge.store import RequestStore, Taken, acl_refusal, refused_by_acl
from carpool.registry import batch_queue_of, import_task_modules, registered, routing_keys

log = logging.getLogger(__name__)
T = TypeVar("T")

STATS_INTERVAL_S = 0.25  # how often counters reach Redis for `carpool status` and the demo
# How often a coordinator compares what it serves with its live peers, and its batch queues with
# those the live workers consume.
PEER_CHECK_S = 10.0


# A take made ahead of the step that uses it: how many requests it asked for, and what it got.
_Take = tuple[int, Taken]


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
        self.dbs = settings.shared_server_dbs()  # results on the broker's server: answered in one script
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
        binning = sorted({"bin_edges", "auto_bins"} & settings.model_fields_set)
        if base.kind != "binned" and binning:
            log.warning(
                "%s set, which CARPOOL_POLICY=%s leaves unused (only binned bins)",
                " and ".join(f"CARPOOL_{name.upper()}" for name in binning),
                base.kind,
            )
        if base.kind != "binned":
            for spec in self.specs.values():
                if spec.bin_edges is not None:
                    log.warning(
                        "task %s names bins=%r, which CARPOOL_POLICY=%s leaves unused (only binned bins)",
                        spec.name,
                        spec.bin_edges,
                        base.kind,
                    )
        self.policy = BatchPolicy(
            base, self.latency, per_key={k: task_policy_config(base, s) for k, s in self.task_of_key.items()}
        )
        self.outstanding: dict[str, OutstandingBatch] = {}
        self.workers = 0
        self.stats = CoordinatorStats()
        self.pacer = Pacer(settings.idle_poll_s)
        self.deferred = Deferred()  # requests waiting for their eta, leased like those in the policy
        self.stage = IntakeStage(self.take_chunk, auto_threads(settings.tokenizer_threads))
        self.revokes: revokes.RevokeListener | None = None  # started by run()
        # A request revoked before it is taken is never batched; revokes are also recorded in Redis.
        self.revoked_ids = revokes.Revoked(self.store, wall)
        self.stopping = threading.Event()
        self.hostname = coordinator_hostname(os.getpid(), socket.gethostname())
        self.events = TaskEvents(app, self.hostname, mode=settings.events, client=self.client)
        self.metrics = CoordinatorMetrics(task_of=self.task_name)
        self.held: set[str] = set()  # taken, not yet dispatched or answered: leased by us
        self.link_sender = LinkSender()  # refusals' error callbacks and the outbox's due links
        # Taken, not yet admitted: by the last wait on its way out, or by a step that failed after it.
        self._ahead: _Take | None = None
        self.incoming = False  # requests on their way into the policy, as of the last step
        self._next_housekeeping = 0.0
        self._next_renewal = 0.0
        self._next_stats = 0.0
        # The batch queues this coordinator dispatches to: each task's own, else the deployment's.
        self.batch_queues = sorted({batch_queue_of(s, settings) for s in self.task_of_key.values()})
        self._stats_writer = StatsWriter(
            self.client,
            self.keys,
            self.hostname,
            self.wall,
            serving(settings.model, settings.served_models, self.specs),
        )
        self._next_peer_check = 0.0
        self._peers_told: set[tuple[str, str]] = set()
        self._evictions = EvictionWatch("coordinator", "CARPOOL_BROKER_URL")
        self._unserved_told: set[str] = set()  # batch queues said to have no worker, until one comes
        self._wait_lists = {
            WaitFor.REPORTS: self.keys.reports_for(self.hostname),
            WaitFor.REQUESTS: self.keys.request_queue,
        }
        self.refused_report_kinds: set[tuple[str, str]] = set()  # unreadable reports logged at error level
        # Kept for the process's life: the builder renders batch messages from a template it learns
        # from Celery's own first messages.
        self.publisher = BatchPublisher(app, self.store, settings, self.task_of_key, self.hostname)

    def task_name(self, key: str) -> str:
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
        check_app_conf(self.app, self.specs)
        check_server(self.client, getattr(self.backend, "client", None), "coordinator")
        self.warm_up()
        self.events.start()
        # No request is taken before the revokes are heard: a revoke broadcast while nobody listens
        # reaches nobody. So a coordinator started before its Redis waits for it here.
        self.revokes = self._until_redis(lambda: revokes.listen(self.app, self.settings))
        self._until_redis(self.revoked_ids.load)  # after subscribing: a revoke is recorded or heard
        collector.freeze_startup()  # full collections mid-burst walked the tokenizers and Celery
        try:
            self._loop()
        finally:
            # Also when a ConfigError ends the loop: what this process holds goes back at once.
            if self.revokes is not None:
                self.revokes.stop()
            self.shutdown()

    def _until_redis(self, call: Callable[[], T]) -> T | None:
        """``call()``, asked again while Redis cannot be reached; None if the process stops first."""
        backoff = 0.1
        while True:
            try:
                return call()
            except UNREACHABLE as exc:
                missing = missing_database(exc, "CARPOOL_BROKER_URL", "CARPOOL_RESULT_BACKEND")
                if missing is not None:
                    raise missing from None
                if self.stopping.is_set():
                    return None
                log.warning(
                    "redis unavailable (%s); taking no request until it answers, retrying in %.1fs",
                    deployment_hint(exc, "CARPOOL_BROKER_URL", "CARPOOL_RESULT_BACKEND") or exc,
                    backoff,
                )
                self.stopping.wait(backoff)
                backoff = min(5.0, backoff * 2)

    def _loop(self) -> None:
        backoff = 0.1
        while not self.stopping.is_set():
            try:
                wait = self.step()
                if wait.seconds > 0 and not self.stopping.is_set():
                    # A stop signal may come while it takes: shutdown hands back what no step admitted.
                    self._ahead = self._wait(wait)
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Redis restarts: keep what we hold in memory; leases we miss are recovered by reap.
                # Refused credentials are retried too, as Celery's workers retry theirs: mending
                # the user in Redis heals every process without a restart.
                hint = deployment_hint(exc, "CARPOOL_BROKER_URL", "CARPOOL_RESULT_BACKEND")
                if hint is not None:
                    log.error("%s; retrying in %.1fs", hint, backoff)
                else:
                    log.warning("redis unavailable (%s); retrying in %.1fs", exc, backoff)
                self.stopping.wait(backoff)
                backoff = min(5.0, backoff * 2)
                continue
            except ConfigError:
                raise  # a deployment error: retrying cannot mend it, and run() hands back what we hold
            except Exception as exc:
                if refused_by_acl(exc):  # a deployment error too, whichever step met it
                    raise acl_refusal("coordinator", self.client, exc) from exc
                missing = missing_database(exc, "CARPOOL_BROKER_URL", "CARPOOL_RESULT_BACKEND")
                if missing is not None:
                    raise missing from exc
                # A bug or a surprise must not take the queue down with it: what we hold stays
                # leased (and is recovered if this repeats until the process is replaced).
                log.exception("coordinator step failed; retrying in %.1fs", backoff)
                self.stopping.wait(backoff)
                backoff = min(5.0, backoff * 2)

    def warm_up(self) -> None:
        """Build what each task measures requests with (infer: the tokenizers) before taking any."""
        # The intake stage's threads are the tokenizers' parallelism: a pool inside each call would
        # only compete with them (and with the loop) for the same cores.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        for spec in self.specs.values():
            try:
                spec.warm_up(self.settings)
            except UnknownModel as exc:  # a model setting no process could serve: stop, saying so
                raise ConfigError(f"{spec.name}: {exc} (CARPOOL_MODEL/CARPOOL_MODELS)") from None
            except ConfigError as exc:  # one task's model missing here: the other tasks are served
                log.error(
                    "%s cannot measure its requests on this host (%s); they are answered with this error",
                    spec.name,
                    exc,
                )

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop, which then hands back what it holds."""

        def stopping(signum: int) -> None:
            log.info("signal %d: handing back held requests and stopping", signum)

        set_on_signals(self.stopping, on_signal=stopping)

    def shutdown(self) -> None:
        """Hand every request not yet dispatched back to the front of the request queue."""
        # Oldest first, as they are taken again: admitted ones by arrival, then those taken later.
        admitted = sorted(self.policy.drain() + self.deferred.drain(), key=lambda r: r.arrival_s)
        held = [r.id for r in admitted] + self.stage.drain()
        ahead = self._ahead_ids()  # taken by the last wait or a failed step, never admitted
        held += ahead
        if ahead:  # taken from the lists all the same: counted taken, as they are counted requeued
            self.stats.taken += len(ahead)
            self.metrics.requests.inc(len(ahead))
        self._ahead = None
        self.stage.close()
        self.link_sender.close()
        self.events.close()
        try:  # what this run counted since its last write would end with it
            self._write_stats()
        except redis.RedisError as exc:
            log.warning("could not write this coordinator's last counts (%s)", exc)
        try:
            returned = self.store.requeue(held)
        except redis.RedisError as exc:
            # Unreachable, or refused (a user missing a command: the error that stops us is the one
            # to see, not this one): what we held returns when its lease runs out.
            log.warning(
                "could not hand back %d held requests (%s); they return after their lease", len(held), exc
            )
            return
        self.held.clear()
        count_requeued(self, "shutdown", returned)
        self._stats_writer.leave()
        log.info("handed back %d requests", returned)

    # --- one step ------------------------------------------------------------------------
    def step(self) -> Wait:
        """One iteration; returns how to wait before the next. A take not yet admitted (``_ahead``:
        the wait before took it on its way out, or a step failed after taking it) is admitted
        instead of taking again; until it is admitted it stays there, for the next step if this one
        fails, and for shutdown to hand back."""
        if self.workers == 0:
            self._bookkeeping(self.clock())  # nothing could leave before the worker count is known
        if self.revokes is not None:
            heard = self.revokes.take()
            if heard:
                revoke(self, heard)
        # One round trip: new requests, and the reports of batches still out (none asked when none are).
        taken: list[tuple[str, bytes]] = []
        reports: list[dict[str, Any]] = []
        if self._ahead is not None:
            take_n, (taken, reports) = self._ahead
        else:
            take_n = self._take_count()
            if take_n or self.outstanding:
                taken, reports = self.store.take(take_n, reports_of=self._reports_of())
        # The reports are applied once, whatever follows; the take is kept until it is admitted.
        self._ahead = (take_n, (taken, [])) if taken else None
        if reports:
            apply_reports(self, reports)
        if taken:
            # In flight on the replicas too before any of it is batched.
            if self.settings.wait_replicas:
                self.store.replicated("requests taken into flight")
            self._ahead = None  # from here on the policy, the stage or an answer holds each request
            admit_taken(self, taken, self.clock())
        if self.stage.busy:
            admit_finished(self)
        now = self.clock()
        next_eta_s = None
        if len(self.deferred):
            next_eta_s = release_due(self, now)
        # Requests on their way in may still join a partial batch: being prepared, or a full take
        # says more wait in Redis.
        self.incoming = self.stage.busy or (take_n > 0 and len(taken) >= take_n)
        if self.pacer.poll_due(now):
            self.pacer.polled(now, dispatch(self, now))
        self.events.flush()
        # After the dispatch: a request that woke this step does not wait behind the bookkeeping.
        self._bookkeeping(now)
        # With no worker alive none is free either: one comes with housekeeping, not with a poll.
        none_free = self.workers == 0 or free_workers(self.workers, len(self.outstanding)) == 0
        queued_s = 0.0
        if none_free and self.workers:
            # Work not started yet: each worker runs one of the oldest batches out (or stores its
            # results), and what runs may end any moment.
            waiting = itertools.islice(self.outstanding.values(), self.workers, None)
            queued_s = sum(o.predicted_s for o in waiting) / self.workers
        return self.pacer.next_wait(
            now,
            full_take=take_n > 0 and len(taken) >= take_n,
            held=len(self.policy),
            all_workers_busy=none_free,
            next_eta_s=next_eta_s,
            intake_busy=self.stage.busy,
            queued_s=queued_s,
        )

    def _ahead_ids(self) -> list[str]:
        """Ids of the take not yet admitted (leased by this coordinator all the same)."""
        return [] if self._ahead is None else [request_id for request_id, _ in self._ahead[1][0]]

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
        if now >= self._next_peer_check:
            self._next_peer_check = now + PEER_CHECK_S
            self._check_peers()
            self._check_batch_queues()
            self._evictions.check(self.client)

    def _check_peers(self) -> None:
        """Log an error, once per peer and setting, for a live coordinator of this request queue
        that serves otherwise: coordinators given different CARPOOL_MODEL answered the same text
        with different models, without a word."""
        try:
            differing = self._stats_writer.peers_serving_otherwise()
        except redis.RedisError:
            return  # the next check, once Redis answers
        for peer, serves in differing.items():
            if (peer, serves) not in self._peers_told:
                self._peers_told.add((peer, serves))
                log.error(
                    "coordinator %s serves %s, this one %s: coordinators sharing %s answer the same"
                    " request with another default model, or refuse what only some serve; give them"
                    " all the same CARPOOL_MODEL, CARPOOL_MODELS and CARPOOL_IMPORTS",
                    peer,
                    serves,
                    self._stats_writer.serves,
                    self.settings.request_queue,
                )

    def _check_batch_queues(self) -> None:
        """Log an error, once until a worker comes, for a batch queue that this coordinator's
        outstanding batches wait on and no live worker consumes (a dedicated worker down, a
        ``@batched(batch_queue=...)`` nobody serves): its requests would wait there, unanswered,
        with nothing said. Also sets each batch queue's worker count in the metrics."""
        try:
            found = self.store.batch_queue_workers()
        except redis.RedisError as exc:
            if refused_by_acl(exc):
                raise  # rules older than this release: the step stops the coordinator, saying so
            return  # the next check, once Redis answers
        for queue in self.batch_queues:
            self.metrics.batch_queue_workers.labels(queue).set(len(found.by_queue.get(queue, ())))
        if found.unknown:
            return  # a live worker of an earlier release may consume any queue: nothing to say
        unserved = set(found.unserved(self.batch_queues))
        for queue in sorted(self._unserved_told - unserved):
            self._unserved_told.discard(queue)
            log.info("batch queue %s has a worker again", queue)
        consumed = ", ".join(sorted(found.by_queue)) or "no batch queue"
        for queue, models in self._outstanding_by_queue().items():
            if not models or queue not in unserved or queue in self._unserved_told:
                continue
            self._unserved_told.add(queue)
            tasks = {self.task_name(model) for model in models}
            log.error(
                "batches of %s wait on batch queue %s, which no live worker consumes (%s): start a"
                " worker that serves %s, or route its batches to a queue one consumes"
                " (@batched(batch_queue=...))",
                ", ".join(sorted(tasks)),
                queue,
                f"the live ones consume {consumed}" if self.workers else "no worker is live",
                " and ".join(sorted(tasks)),
            )

    def _outstanding_by_queue(self) -> dict[str, list[str]]:
        """The routing keys of the batches out, per batch queue they wait on (every queue this
        coordinator sends to, those with none too)."""
        by_queue: dict[str, list[str]] = {queue: [] for queue in self.batch_queues}
        for out in self.outstanding.values():
            by_queue[self.publisher.queue_of(out.model)].append(out.model)
        return by_queue

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
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # A take that ran unanswered holds its requests under a lease that runs out.
            log.warning(
                "waiting for requests in Redis failed (%s); what a take sent with it moved into flight"
                " goes back to the queue when its leases run out",
                exc,
            )
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
        if error is not None:
            if "unknown command" in str(error).lower():  # Redis < 6.2: no BLMOVE
                log.info("this Redis has no BLMOVE (6.2+); polling instead")
                self.pacer.cannot_block()
            else:  # NOREPLICAS, OOM, MISCONF, READONLY...: passing; the next wait blocks again
                log.warning("waiting in Redis failed (%s); waiting here instead, this once", error)
            self.stopping.wait(wait.fallback_s)
        return ahead

    def take_chunk(self, taken: Sequence[tuple[str, bytes]], room: int) -> Intake:
        """``taken`` as requests for the policy and refusals, at most ``room`` admitted (any thread)."""
        return take_in(
            taken, settings=self.settings, specs=self.specs, room=room, now=self.clock(), wall_now=self.wall()
        )

    # --- housekeeping --------------------------------------------------------------------
    def housekeeping(self, now: float) -> None:
        apply_reports(self, self.store.pop_reports(self.hostname))  # also of batches given up on
        self.pacer.changed()  # worker count, given-up batches and recovered requests change slots
        self.workers = self.store.live_workers()
        self.metrics.workers.set(self.workers)
        give_up_unreported(self, now)
        if now >= self._next_renewal:
            renew = list(self.held) + self.stage.held_ids() + self._ahead_ids()
            for out in self.outstanding.values():
                renew.extend(out.ids)
            self.store.renew_held(renew)
            self.store.links_renew(self.link_sender.held())  # their links are being sent here
            # Four renewals per lease: one late step cannot let a lease run out, and a deep
            # backlog (all of it leased by us) costs Redis one pass over it per quarter lease.
            self._next_renewal = now + self.settings.recovery_timeout_s / 4
        recovered = self.store.reap()
        if recovered:
            count_requeued(self, "lease_expired", recovered)
            log.warning("recovered %d requests whose holder stopped renewing its lease", recovered)
        if self.link_sender.refused is not None:
            raise self.link_sender.refused  # the step stops the coordinator, saying what to grant
        if not self.link_sender.busy:  # one round at a time, behind the links the loop queued
            self.link_sender.submit(lambda: send_due_links(self))
        running = self.link_sender.overdue(self.settings.recovery_timeout_s)
        if running is not None:
            log.warning(
                "an error callback has run for %.0f s on this coordinator's link thread: the links of %d"
                " requests wait behind it (kept in the links outbox while this coordinator lives); one"
                " that never returns holds them for good: bound it, or make it a task",
                running,
                len(self.link_sender.held()),
            )
        self.metrics.housekept.set(self.wall())

    def _write_stats(self) -> None:
        depths = self.policy.depth_by_bin()
        self.metrics.set_depths(depths)
        # Requests still in the intake stage wait too: taken, not yet in a bin.
        gauges = {
            "pending": len(self.policy) + len(self.stage),
            "outstanding": len(self.outstanding),
            "deferred": len(self.deferred),  # held for their countdown or eta, counted by max_pending
        }
        gauges.update(
            {OUTSTANDING_ON + queue: len(models) for queue, models in self._outstanding_by_queue().items()}
        )
        self._stats_writer.write(self.stats, depths, gauges, self.task_name, self.policy.bin_spans())
