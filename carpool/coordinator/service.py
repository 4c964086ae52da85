"""The coordinator loop: Redis request list -> policy -> Celery batch tasks on the batch queue.

One iteration (``step``): take requests atomically into flight, decode and validate them, tokenize
each model's texts in one call, add them to the policy, ask the policy what leaves now, publish
those batches, fail what expired. Housekeeping (lease renewal, recovery of requests whose holder
died, worker count, batch reports feeding the latency model) runs every quarter lease.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

from carpool.batching import Batch, BatchPolicy, LatencyModel, Plan, PolicyConfig, Request
from carpool.batching.capacity import pool_capacity
from carpool.celery_edge import requests as protocol
from carpool.celery_edge.events import TaskEvents
from carpool.celery_edge.results import FAILURE
from carpool.config import Settings
from carpool.coordinator.metrics import CoordinatorMetrics
from carpool.errors import DeadlineExceeded, InputTooLong, InvalidInput, MalformedMessage, QueueFull
from carpool.models import get_model
from carpool.names import RUN_BATCH_TASK
from carpool.producer.client import TaskMessageBuilder
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.store import RequestStore
from carpool.validation import bind_infer_args, validate_infer

log = logging.getLogger(__name__)

RUN_BATCH = RUN_BATCH_TASK
STATS_INTERVAL_S = 0.25  # how often counters reach Redis for `carpool status` and the demo
BUSY_POLL_S = 0.002  # poll interval while requests are held for a partial batch (or Redis < 6.2)
# Redis ends blocking commands on timeout from its event loop, which an otherwise idle server runs
# every 1/hz = 0.1 s: a blocking wait may last that long past its timeout. Waits that must end on time
# (a deadline, a partial batch's wait) sleep here instead.
REDIS_TIMEOUT_GRAIN_S = 0.1
FORCED_POLL_S = 0.1  # the policy is asked at least this often, even when nothing seems to change


@dataclass(slots=True)
class _Outstanding:
    ids: list[str]
    model: str
    predicted_s: float
    dispatched_s: float


@dataclass(slots=True)
class CoordinatorStats:
    taken: int = 0
    batches: int = 0
    dispatched: int = 0
    padded_tokens: int = 0
    real_tokens: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    flush: Counter[str] = field(default_factory=Counter)
    sizes: Counter[int] = field(default_factory=Counter)


def policy_config(settings: Settings) -> PolicyConfig:
    return PolicyConfig(
        kind=settings.policy,
        max_batch=settings.max_batch,
        max_tokens=settings.max_tokens,
        max_wait_s=settings.max_wait_s,
        wait_factor=settings.wait_factor,
        bin_edges=settings.bin_edges,
        auto_bins=settings.auto_bins,
    )


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
        self.client = client or redis.Redis.from_url(settings.broker_url)
        self.keys = Keys(settings.request_queue)
        self.store = RequestStore(self.client, self.keys, settings.recovery_timeout_s)
        self.clock = clock
        self.wall = wall
        self.latency = LatencyModel()
        self.policy = BatchPolicy(policy_config(settings), self.latency)
        self.models = {name: get_model(name) for name in settings.served_models}
        self.outstanding: dict[str, _Outstanding] = {}
        self.workers = 0
        self.stats = CoordinatorStats()
        self._held: set[str] = set()
        self._next_housekeeping = 0.0
        self._next_stats = 0.0
        self._written: dict[str, int] = {}
        self._depth_keys: set[tuple[str, str]] = set()
        self._wake_at: float | None = None
        self._changed = True  # something the policy's last plan did not know of happened
        self._block_on: str | None = None  # the list whose next element ends the current wait
        self._can_block = True
        self._next_poll = 0.0
        self.stopping = threading.Event()
        self.hostname = f"carpool-coordinator-{os.getpid()}@{socket.gethostname()}"
        self.events = TaskEvents(app, self.hostname, enabled=settings.events, client=self.client)
        self.metrics = CoordinatorMetrics()
        # Kept for the process's life: after Celery has built two batch messages and the template
        # rendered the second exactly, every batch message is rendered (docs/PERFORMANCE.md, round 3).
        self._messages = TaskMessageBuilder(
            RUN_BATCH,
            app=app,
            queue=settings.batch_queue,
            sent_events=False,
            # The header overrides run_batch's own ignore_result on the worker: without it Celery
            # stored every batch's report in the result backend (1.3 ms per batch).
            ignore_result=True,
        )

    # --- main loop -------------------------------------------------------------------------
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
        backoff = 0.1
        while not self.stopping.is_set():
            try:
                pause = self.step()
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
            if pause > 0:
                self._wait(pause)
        self.shutdown()

    def warm_up(self) -> None:
        """Load each model's tokenizer now, not inside the first request's latency (MiniLM's takes
        about 0.1 s of CPU to load; the first burst paid for it while the worker waited)."""
        for name, model in self.models.items():
            try:
                model.encode(["warm up"])
            except Exception:
                log.exception("warming up the tokenizer of %s failed; requests will show the error", name)

    def install_signal_handlers(self) -> None:
        def _stop(signum: int, _frame: Any) -> None:
            log.info("signal %d: handing back held requests and stopping", signum)
            self.stopping.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def shutdown(self) -> None:
        """Hand every request not yet dispatched back to the front of the request queue."""
        held = self.policy.drain()
        try:
            returned = self.store.requeue([r.id for r in held])
        except redis.ConnectionError:
            log.warning("redis unavailable at shutdown; %d held requests return after their lease", len(held))
            return
        self._held.clear()
        log.info("handed back %d requests", returned)

    def step(self) -> float:
        """One iteration; returns how long to sleep before the next (0 = go again at once)."""
        now = self.clock()
        if now >= self._next_housekeeping:
            self.housekeeping(now)
            self._next_housekeeping = now + min(1.0, self.settings.recovery_timeout_s / 4)
        if now >= self._next_stats:
            self._write_stats()
            self._next_stats = now + STATS_INTERVAL_S
        # One round trip: new requests, and the reports of batches still out (none asked when none are).
        taken, reports = self.store.take(
            self.settings.take_max, reports_of=self.hostname if self.outstanding else None
        )
        if reports:
            self._apply_reports(reports)
        if taken:
            self._admit(taken, self.clock())
            self._changed = True
        now = self.clock()
        # The policy's answer changes only with new requests, freed slots, or time reaching the wake
        # time of its last plan: polling it otherwise costs CPU (it walks every queue) for nothing.
        if self._changed or (self._wake_at is not None and now >= self._wake_at) or now >= self._next_poll:
            self._changed = False
            self._next_poll = now + FORCED_POLL_S
            self._dispatch(now)
        self.events.flush()
        self._block_on = None
        if taken:
            return 0.0
        # Nothing came in. Wait for what can change the plan, in Redis where possible, so an idle or
        # saturated coordinator neither burns CPU polling nor reacts late:
        # - every worker busy: the next batch report (it frees a worker, or a slot). Arrivals are
        #   looked at when the wait times out (idle_poll_s): with no worker free, what they would
        #   change is at most which batch waits in the prefetch slot, and a report ends the wait at
        #   once. Polling every 2 ms here instead cost 7% of a MiniLM burst's CPU (round 3);
        # - nothing held: the next request at the default priority (the other priority lists and
        #   reports are looked at when the wait times out: after idle_poll_s, or up to 0.1 s on an
        #   otherwise idle Redis, see REDIS_TIMEOUT_GRAIN_S);
        # - otherwise (a worker is idle and requests wait for a partial batch to fill) poll briefly.
        pause = self.settings.idle_poll_s
        until_wake = None if self._wake_at is None else max(0.0, self._wake_at - now)
        free_workers = max(0, self.workers - len(self.outstanding))
        if until_wake is not None and until_wake < REDIS_TIMEOUT_GRAIN_S:
            pass  # a deadline or wait is due soon: Redis would time a blocking wait out too late
        elif self.outstanding and self.workers and not free_workers:
            self._block_on = self.keys.reports_for(self.hostname)
        elif not len(self.policy):
            self._block_on = self.keys.request_queue
        if self._block_on is None:
            pause = min(pause, BUSY_POLL_S)
        if until_wake is not None:
            pause = min(pause, until_wake)
        return pause

    def _wait(self, pause: float) -> None:
        """Sleep up to ``pause`` s, or until ``_block_on`` (a list) has an element: BLMOVE from the
        list to its own tail is an atomic no-op rotation, so waiting takes nothing out of Redis."""
        key = self._block_on
        if key is not None and self._can_block and pause >= 0.001:
            try:
                # Redis >= 6 takes a fractional timeout; redis-py's stub says int.
                self.client.blmove(key, key, round(pause, 3), "RIGHT", "RIGHT")  # type: ignore[arg-type]
                return
            except redis.ResponseError:  # Redis < 6.2: no BLMOVE; poll instead
                log.info("this Redis has no BLMOVE (6.2+); polling every %.3fs instead", BUSY_POLL_S)
                self._can_block = False
            except (redis.ConnectionError, redis.TimeoutError):
                pass  # the next step meets the same error and backs off; nothing was taken here
        self.stopping.wait(min(pause, BUSY_POLL_S) if key is not None else pause)

    # --- intake ----------------------------------------------------------------------------
    def _admit(self, taken: list[tuple[str, bytes]], now: float) -> None:
        self.stats.taken += len(taken)
        self.metrics.requests.inc(len(taken))
        wall_now = self.wall()
        failures: list[tuple[str, str, Any]] = []
        fail_reasons: list[str] = []
        by_model: dict[str, list[tuple[protocol.Incoming, str]]] = {}
        room = self.settings.max_pending - len(self.policy)
        for request_id, raw in taken:
            try:
                msg = protocol.decode(raw)
                if msg.id != request_id:  # in-flight bookkeeping is keyed by the id the take found
                    raise MalformedMessage(f"task id {msg.id!r} is not the message's only id key")
            except MalformedMessage as exc:
                log.warning("dead-lettering message %s: %s", request_id, exc)
                self.store.dead_letter(request_id, raw, str(exc))
                self.stats.failed["malformed"] += 1
                self.metrics.failed("malformed")
                continue
            try:
                text, model = bind_infer_args(msg.args, msg.kwargs)
                payload = validate_infer(text, model, self.settings)
            except InvalidInput as exc:
                failures.append((msg.id, FAILURE, exc))
                fail_reasons.append("invalid")
                continue
            if room <= 0:
                failures.append(
                    (
                        msg.id,
                        FAILURE,
                        QueueFull(
                            f"{self.settings.max_pending} requests already wait (CARPOOL_MAX_PENDING); "
                            "retry later"
                        ),
                    )
                )
                fail_reasons.append("queue_full")
                continue
            room -= 1
            by_model.setdefault(payload.model, []).append((msg, payload.text))

        for model_name, items in by_model.items():
            model = self.models[model_name]
            if not self.settings.truncate and hasattr(model, "count_tokens"):
                items = self._reject_too_long(model_name, items, failures, fail_reasons)
            token_ids = model.encode([text for _, text in items])
            keep_ids = model.needs_token_ids
            for (msg, _), ids in zip(items, token_ids, strict=True):
                sent_at = msg.sent_at if msg.sent_at is not None else wall_now
                # Wall-clock times from the producer become this process's monotonic clock.
                arrival = now - max(0.0, wall_now - sent_at)
                deadline_wall = (
                    msg.expires_at
                    if msg.expires_at is not None
                    else (sent_at + self.settings.default_deadline_s)
                )
                deadline = now + (deadline_wall - wall_now)
                self.policy.add(
                    Request(
                        id=msg.id,
                        model=model_name,
                        length=len(ids),
                        arrival_s=arrival,
                        deadline_s=deadline,
                        priority=msg.priority,
                        payload={
                            "id": msg.id,
                            "ids": ids if keep_ids else None,
                            "len": len(ids),
                            "sent_at": sent_at,
                            "deadline": deadline_wall,
                        },
                    )
                )
                self._held.add(msg.id)
                self.events.received(msg.id, msg.argsrepr, msg.kwargsrepr)
        if failures:
            self._fail(failures, fail_reasons)

    def _reject_too_long(
        self,
        model_name: str,
        items: list[tuple[protocol.Incoming, str]],
        failures: list[tuple[str, str, Any]],
        reasons: list[str],
    ) -> list[tuple[protocol.Incoming, str]]:
        model = self.models[model_name]
        counts = model.count_tokens([text for _, text in items])  # type: ignore[attr-defined]
        keep = []
        for item, count in zip(items, counts, strict=True):
            if count > model.max_length:
                failures.append(
                    (
                        item[0].id,
                        FAILURE,
                        InputTooLong(
                            f"text is {count} tokens, over the {model.max_length}-token window of "
                            f"{model_name}; "
                            "shorten it, or set CARPOOL_TRUNCATE=true to cut it as sentence-transformers does"
                        ),
                    )
                )
                reasons.append("too_long")
            else:
                keep.append(item)
        return keep

    def _fail(self, failures: list[tuple[str, str, Any]], reasons: list[str]) -> None:
        self.backend.store_many(failures)
        self.store.ack([f[0] for f in failures])
        for reason, failure in zip(reasons, failures, strict=True):
            self.stats.failed[reason] += 1
            self.metrics.failed(reason)
            self.events.failed(failure[0], failure[2])
            log.info("request %s failed (%s): %s", failure[0], reason, failure[2])

    # --- dispatch --------------------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        if self.workers == 0:
            # Nobody could run a batch: hold everything (a deadline flush would only expire in the
            # batch queue) and fail what expires here.
            plan = Plan(expired=self.policy.expire(now), wake_at_s=self.policy.next_deadline())
        else:
            cap = pool_capacity(
                self.workers,
                self.settings.prefetch_batches,
                (o.predicted_s for o in self.outstanding.values()),
            )
            plan = self.policy.poll(now, cap.free_workers, cap.free_slots, cap.ahead_s)
        self._wake_at = plan.wake_at_s
        if plan.expired:
            failures: list[tuple[str, str, Any]] = []
            for req in plan.expired:
                self._held.discard(req.id)
                failures.append(
                    (
                        req.id,
                        FAILURE,
                        DeadlineExceeded.waited(now - req.deadline_s, "in the coordinator's queue"),
                    )
                )
            self._fail(failures, ["deadline"] * len(failures))
        if plan.batches:
            self._publish(plan.batches, now)

    def _publish(self, batches: list[Batch], now: float) -> None:
        """Hand ``batches`` on: every batch's task message, ownership and lease renewal, and the events
        buffered so far (published first, so Flower sees requests received before started), in one
        script call. The messages are the ones ``app.send_task`` would send (built by
        :class:`carpool.producer.client.TaskMessageBuilder`), without kombu's per-publish overhead."""
        wall_now = self.wall()
        batch_ids = [str(uuid.uuid4()) for _ in batches]  # Celery-style task ids: Flower lists them
        calls: list[tuple[list[Any], dict[str, Any]]] = []
        summaries: list[str] = []
        for batch_id, batch in zip(batch_ids, batches, strict=True):
            padding = batch.padded_tokens / max(1, batch.real_tokens)
            message = {
                "id": batch_id,
                "model": batch.model,
                "bin": batch.bin_label,
                "flush": batch.flush_reason.value,
                "padded_len": batch.padded_len,
                "dispatched_at": wall_now,
                "coordinator": self.hostname,
                "requests": [r.payload for r in batch.requests],
            }
            calls.append(([message], {}))
            # Flower shows argsrepr; the token ids it would otherwise show help nobody.
            summaries.append(
                f"size={batch.size} bin={batch.bin_label} width={batch.padded_len} "
                f"padding={padding:.2f} flush={batch.flush_reason.value} model={batch.model}"
            )
        try:
            built = self._messages.build(calls, task_ids=batch_ids, argsreprs=summaries)
            (queue_list, raws), *others = built.pushes.items()
            if others:
                raise RuntimeError("batch messages must all go to one list (no priorities on batches)")
            self.store.dispatch(
                queue_list,
                [
                    (bid, [r.id for r in b.requests], raw)
                    for bid, b, raw in zip(batch_ids, batches, raws, strict=True)
                ],
                self.events.take(),
            )
        except Exception:
            # The broker went away: nothing of the script ran, so the batches go back into the policy
            # (still held and leased by us), to leave with the next plan once Redis answers again.
            for batch in batches:
                for req in batch.requests:
                    self.policy.add(req)
            self._changed = True
            raise
        built.published()
        for batch_id, batch in zip(batch_ids, batches, strict=True):
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

    # --- housekeeping ----------------------------------------------------------------------
    def housekeeping(self, now: float) -> None:
        self._read_reports()  # also those of batches already given up on, for the latency model
        self._changed = True  # worker count, given-up batches and recovered requests change slots
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
        renew = list(self._held)
        for out in self.outstanding.values():
            renew.extend(out.ids)
        self.store.renew_held(renew)
        recovered = self.store.reap()
        if recovered:
            log.warning("recovered %d requests whose holder stopped renewing its lease", recovered)

    def _read_reports(self) -> None:
        self._apply_reports(self.store.pop_reports(self.hostname))

    def _apply_reports(self, reports: list[dict[str, Any]]) -> None:
        for report in reports:
            self._changed = True  # a slot freed, and the latency model learnt something
            out = self.outstanding.pop(report.get("batch_id", ""), None)
            if report.get("padded_tokens") and report.get("run_s") is not None:
                self.latency.observe(report["model"], int(report["padded_tokens"]), float(report["run_s"]))
                self.metrics.batch_ran(report["model"], str(report.get("device")), float(report["run_s"]))
            if out is None and report.get("batch_id"):
                log.debug("report for batch %s dispatched by another coordinator", report["batch_id"])
            # Failures decided on the worker count with the coordinator's own, in metrics and stats.
            for reason in ("model", "deadline"):
                n = int(report.get(f"failed_{reason}") or 0)
                if n:
                    self.stats.failed[reason] += n
                    self.metrics.failed(reason, n)

    def _write_stats(self) -> None:
        """Counters are added (HINCRBY of what changed), so several coordinators sum up; gauges are
        the writer's own view."""
        depths = self.policy.depth_by_bin()
        self.metrics.set_depths(depths)
        s = self.stats
        counters: dict[str, int] = {
            "taken": s.taken,
            "batches": s.batches,
            "dispatched": s.dispatched,
            "padded_tokens": s.padded_tokens,
            "real_tokens": s.real_tokens,
        }
        counters.update({f"flush:{k}": v for k, v in s.flush.items()})
        counters.update({f"failed:{k}": v for k, v in s.failed.items()})
        counters.update({f"size:{k}": v for k, v in s.sizes.items()})
        gauges: dict[str, int] = {
            "pending": len(self.policy),
            "outstanding": len(self.outstanding),
            "workers": self.workers,
        }
        for key in self._depth_keys - set(depths):
            gauges[f"depth:{key[0]}:{key[1]}"] = 0
        self._depth_keys |= set(depths)
        gauges.update({f"depth:{m}:{b}": n for (m, b), n in depths.items()})
        with self.client.pipeline(transaction=False) as pipe:
            for name, value in counters.items():
                delta = value - self._written.get(name, 0)
                if delta:
                    pipe.hincrby(self.keys.stats, name, delta)
            pipe.hset(self.keys.stats, mapping=gauges)  # type: ignore[arg-type]
            pipe.execute()
        self._written = counters
