"""``carpool.run_batch``: the Celery task a GPU worker runs for each micro-batch.

Per batch: claim the requests this batch still owns (a recovered request may already be someone
else's) and learn which are answered already, in one script; fail those past their deadline; run the
rest padded to a multiple of 8; then, in one more script, store every request's result under its own
task id (write-once), acknowledge the batch's requests, report its timing to the coordinator's
latency model and publish the per-request task events. Two Redis round trips per batch when the
result backend is a database of the broker's server (the default), a few more otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import redis
from celery import signals

from carpool.batching.bins import padded_length
from carpool.batching.capacity import may_start
from carpool.celery_edge.app import app, settings_of
from carpool.celery_edge.events import TaskEvents
from carpool.celery_edge.results import FAILURE, SUCCESS
from carpool.errors import DeadlineExceeded, ModelError
from carpool.gpu_worker.runner import loaded_model, pick_device, run_isolating
from carpool.names import RUN_BATCH_TASK
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.store import RequestStore

log = logging.getLogger(__name__)

RUN_BATCH = RUN_BATCH_TASK
BATCH_REPR_LIMIT = 1024  # characters of a batch report in its task-succeeded event (Celery's default)
HEARTBEAT_S = 1.0
LIVE_STARTED_S = 0.5  # batches longer than this publish their STARTED events before running


class WorkerRuntime:
    """Per-process worker state: Redis edge, device, loaded models, heartbeat."""

    def __init__(self) -> None:
        self.settings = settings_of(app)
        self.client = redis.Redis.from_url(self.settings.broker_url)
        self.store = RequestStore(
            self.client, Keys(self.settings.request_queue), self.settings.recovery_timeout_s
        )
        self.backend = app.backend
        self.device = pick_device(self.settings.device)
        self.hostname = f"{socket.gethostname()}:{os.getpid()}"
        self.events = TaskEvents(
            app,
            f"carpool-gpu-{os.getpid()}@{socket.gethostname()}",
            enabled=self.settings.events,
            client=self.client,
        )
        # (broker db, results db) when both live on one server: two round trips per batch.
        self.dbs = self.settings.shared_server_dbs()
        self._running: list[str] = []
        self._last_run_s: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.settings.torch_threads:
            import torch

            torch.set_num_threads(self.settings.torch_threads)

    def start(self) -> None:
        """Load every served model, then start announcing this worker to coordinators."""
        for name in self.settings.served_models:
            t0 = time.perf_counter()
            loaded_model(name, self.device, self.settings.autocast_bf16)
            log.info("model %s loaded on %s in %.1fs", name, self.device, time.perf_counter() - t0)
        self._beat()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="carpool-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(redis.RedisError):
            self.store.leave(self.hostname)

    def _beat(self) -> None:
        self.store.heartbeat(self.hostname, 4 * HEARTBEAT_S)
        # Keep the running batch's leases alive: a batch longer than the lease is not a dead worker.
        self.store.renew_running(list(self._running))

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def run(self, batch: dict[str, Any], request: Any = None) -> dict[str, Any]:
        """Run one batch. ``request``: the Celery task request of ``carpool.run_batch`` (its own task
        events are sent from here, see :func:`run_batch`); None when called directly."""
        t0 = time.perf_counter()
        task_id = getattr(request, "id", None)
        if task_id:
            self.events.received(
                task_id,
                str(getattr(request, "argsrepr", None) or ""),
                str(getattr(request, "kwargsrepr", None) or "{}"),
                name=RUN_BATCH,
                root_id=getattr(request, "root_id", None),
                parent_id=getattr(request, "parent_id", None),
                retries=int(getattr(request, "retries", 0) or 0),
            )
            self.events.started([task_id])

        def done(report: dict[str, Any]) -> None:
            if task_id:  # the batch's own task-succeeded rides with its requests' events
                self.events.succeeded(task_id, report, time.perf_counter() - t0, limit=BATCH_REPR_LIMIT)

        try:
            return self._run(batch, done)
        except BaseException as exc:
            if task_id and not isinstance(exc, KeyboardInterrupt | SystemExit):
                self.events.failed(task_id, exc, time.perf_counter() - t0, traceback.format_exc())
                self.events.flush()
            raise
        finally:
            # Whatever happened, stop renewing this batch's leases: if it did not finish, its
            # requests must come back through recovery instead of being held forever.
            self._running = []

    def _run(self, batch: dict[str, Any], done: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        batch_id = batch["id"]
        requests = batch["requests"]
        ids = [r["id"] for r in requests]
        result_keys = [self.backend.get_key_for_task(i) for i in ids]
        if self.dbs is not None:
            flags = self.store.claim_fresh(batch_id, ids, result_keys, self.dbs[1])
        else:  # results on another server: claim, then look for stored results there
            owned = self.store.claim(batch_id, ids)
            answered = self.backend.existing([i for i, ok in zip(ids, owned, strict=True) if ok])
            flags = [(2 if i in answered else 1) if ok else 0 for i, ok in zip(ids, owned, strict=True)]
        mine = [r for r, f in zip(requests, flags, strict=True) if f]
        if len(mine) < len(requests):
            log.info(
                "batch %s: %d of %d requests now belong elsewhere; skipped",
                batch_id,
                len(requests) - len(mine),
                len(requests),
            )
        now = time.time()
        entries: list[tuple[str, str, Any]] = []
        live = []
        for r, flag in zip(requests, flags, strict=True):
            if flag != 1:  # another batch's now, or answered already (a rerun after recovery)
                continue
            if not may_start(r["deadline"], now):
                entries.append(
                    (
                        r["id"],
                        FAILURE,
                        DeadlineExceeded.waited(now - r["deadline"], "when its batch started"),
                    )
                )
            else:
                live.append(r)
        run_s = None
        padded_len = 0
        if live:
            self._running = [r["id"] for r in live]
            # Timestamped now; published now only when the batch is expected to run long enough
            # for someone to watch it as STARTED, otherwise together with the results (one publish
            # per batch instead of two; Flower still sees received -> started -> succeeded).
            self.events.started(self._running)
            if self._last_run_s.get(batch["model"], 0.0) > LIVE_STARTED_S:
                self.events.flush()
            try:
                model = loaded_model(batch["model"], self.device, self.settings.autocast_bf16)
                lengths = [r["len"] for r in live]
                t0 = time.perf_counter()
                outcomes = run_isolating(model, [r["ids"] for r in live], lengths)
                elapsed = time.perf_counter() - t0
                self._last_run_s[batch["model"]] = elapsed
                if all(ok for ok, _ in outcomes):
                    run_s = elapsed  # a split batch's time says nothing about the latency model
                padded_len = padded_length(max(lengths))
            except Exception as exc:  # model failed to load: every request fails with the reason
                log.exception("batch %s: model %s unavailable", batch_id, batch["model"])
                outcomes = [(False, exc)] * len(live)
            for r, (ok, out) in zip(live, outcomes, strict=True):
                if ok:
                    entries.append((r["id"], SUCCESS, out))
                else:
                    entries.append((r["id"], FAILURE, ModelError(f"{type(out).__name__}: {out}")))
        per_request_s = run_s or 0.0
        for task_id, state, value in entries:
            if state == SUCCESS:
                self.events.succeeded(task_id, value, per_request_s)
            else:
                self.events.failed(task_id, value, per_request_s)
        report = {
            "batch_id": batch_id,
            "model": batch["model"],
            "worker": self.hostname,
            "device": self.device,
            "bin": batch.get("bin"),
            "flush": batch.get("flush"),
            "size": len(live),
            "padded_len": padded_len,
            "padded_tokens": padded_len * len(live),
            "real_tokens": sum(r["len"] for r in live),
            "run_s": run_s,
            "failed_model": sum(1 for e in entries if isinstance(e[2], ModelError)),
            "failed_deadline": sum(1 for e in entries if isinstance(e[2], DeadlineExceeded)),
            "done_at": time.time(),
        }
        done(report)
        # Redis may be restarting: the results are computed, so keep trying to hand them over for a
        # while before giving the batch up to recovery.
        _retrying(
            lambda: self._finish(entries, [r["id"] for r in mine], report, batch.get("coordinator", ""))
        )
        return report

    def _finish(
        self,
        entries: list[tuple[str, str, Any]],
        ack_ids: list[str],
        report: dict[str, Any],
        coordinator: str,
    ) -> None:
        """Results (write-once), acks, the report and the task events: one round trip when the
        results live on the broker's server, else a store on the backend and one trip for the rest.
        The events leave the buffer on the first attempt: a retry after a lost connection sends none
        (they are telemetry; the results, acks and report are what a retry must deliver)."""
        events = self.events.take()
        if self.dbs is not None:
            self.store.finish(
                results_db=self.dbs[1],
                broker_db=self.dbs[0],
                writes=self.backend.store_args(entries),
                ack_ids=ack_ids,
                report=report,
                coordinator=coordinator,
                events=events,
            )
            return
        self.backend.store_many(entries)
        with self.client.pipeline(transaction=False) as pipe:
            self.store.ack_into(pipe, ack_ids, report, coordinator)
            if events is not None:
                pipe.publish(*events)
            pipe.execute()


def _retrying(call: Any, attempts: int = 8, first_pause_s: float = 0.1) -> Any:
    """``call()``, retried with backoff (about 25 s in all) while Redis is unreachable."""
    pause = first_pause_s
    for attempt in range(attempts):
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if attempt == attempts - 1:
                raise
            log.warning("redis unavailable (%s); retrying in %.1fs", exc, pause)
            time.sleep(pause)
            pause = min(5.0, pause * 2)
    return None


_runtime: WorkerRuntime | None = None


def runtime() -> WorkerRuntime:
    global _runtime
    if _runtime is None:
        _runtime = WorkerRuntime()
    return _runtime


@app.task(name=RUN_BATCH, bind=True, ignore_result=True, acks_late=False, send_events=False)
def run_batch(self: Any, batch: dict[str, Any]) -> str:
    # Celery's own task events for this task are off (send_events=False): its dispatcher published
    # them one PUBLISH at a time through a new Redis client each, about a quarter of the worker's
    # time per batch on the null model. The runtime sends the same received/started/succeeded (or
    # failed) events for the batch in the one publish that carries its requests' events, with the
    # report as the batch's result in Flower.
    # Returned for Celery's "succeeded" log line, already as text: Celery formats every return value
    # with its saferepr, 65 us for a report dict against 2 us for repr (about 2 us per request).
    return repr(runtime().run(batch, self.request))


@signals.worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    runtime().start()


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    if _runtime is not None:
        _runtime.stop()
