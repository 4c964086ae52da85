"""A GPU worker's state and its work per batch: claim, run, store; and its heartbeat.

Per batch: claim the requests this batch still owns (a recovered request may already be someone
else's) and learn which are answered already, in one script (:mod:`carpool.gpu_worker.claimed` sorts
its answer); answer REVOKED those this worker heard revoked (Celery's remote control), fail those
past their deadline; run the rest padded to a multiple of 8; then, in one more script, store every
request's result under its own task id (write-once; a failure also under the rest of its chain),
acknowledge the batch's requests, report its timing to the coordinator's latency model and publish
the per-request task events. Two Redis round trips per batch when the result backend is a database
of the broker's server (the default), a few more otherwise. What surrounds that finish (its retries,
the results it refused, the links applied after it) is :mod:`carpool.gpu_worker.finish`'s; which
tasks and batch queues a worker serves, :mod:`carpool.gpu_worker.serving`'s.

Under load the work overlaps the device (:mod:`carpool.gpu_worker.stage`): the Celery thread claims
and sorts a batch and hands it to the device thread, which checks deadlines and runs it, and hands
the rest to the finisher thread; a lone batch (none queued behind it, the device thread idle) runs
start to end on the Celery thread, with no hand-off. Where the task's device runs asynchronously
(a model with ``launch``), the device thread launches the next batch before it collects this one's
outputs, so the device has the next batch queued while the thread hands this one over; a batch
claimed while that thread waits to collect the one before, with nothing else waiting, is launched
by the Celery thread itself, so it does not wait for that collection to start. And under load a
batch's claim also takes the next batch message off the batch queue, which the same Celery task
then runs (:meth:`WorkerRuntime._run_taken`): the Celery thread does not go back to Celery's
consumer, and its round trip, for every batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import redis
from celery import Celery
from celery.exceptions import TaskRevokedError
from celery.platforms import EX_FAILURE
from celery.worker import state as worker_state

from carpool import collector
from carpool.batching.bins import padded_length
from carpool.batching.capacity import may_start
from carpool.batching.types import FlushReason
from carpool.celery_edge import compat
from carpool.celery_edge.app import settings_of
from carpool.celery_edge.events import TaskEvents, answered_elsewhere
from carpool.celery_edge.options import check_app_conf
from carpool.celery_edge.received import accepted, marker, read_task
from carpool.celery_edge.results import FAILURE, REVOKED, SUCCESS
from carpool.codec import storable
from carpool.errors import (
    CONFIG_ERROR_EXIT,
    ConfigError,
    DeadlineExceeded,
    DeviceLost,
    ModelError,
    UnknownModel,
    WireError,
    described,
    stops_the_process,
)
from carpool.gpu_worker.claimed import ClaimedBatch, claimed_batch
from carpool.gpu_worker.finish import (
    apply_links,
    batch_chain_failures,
    count_rejected,
    filed_links,
    log_failures,
)
from carpool.gpu_worker.runner import (
    OutputCountMismatch,
    one_per_item,
    pick_device,
    pristine_items,
    release_frames,
    run_call_isolating,
)
from carpool.gpu_worker.serving import batch_queues, served_spec, served_tasks, unserved_neighbours
from carpool.gpu_worker.stage import DeviceStage, Finisher
from carpool.names import RUN_BATCH_TASK
from carpool.redis_edge.connect import check_server, client_for
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.marks import DeviceMarks
from carpool.redis_edge.retry import retrying
from carpool.redis_edge.socket_options import client_options
from carpool.redis_edge.store import Claimed, RequestStore, ResultWrites, acl_refusal, refused_by_acl
from carpool.registry import LaunchCall, import_task_modules, registered
from carpool.wire import BatchMessage, BatchReport, RequestSlot, batch_report, read_batch

log = logging.getLogger(__name__)

T = TypeVar("T")

BATCH_REPR_LIMIT = 1024  # characters of a batch report in its task-succeeded event (Celery's default)
HEARTBEAT_S = 1.0
LIVE_STARTED_S = 0.5  # batches longer than this publish their STARTED events before running
DEVICE_SWITCH_INTERVAL_S = 0.0005  # the GIL's switch interval in a worker with a device stage
# A Celery task that runs the batches its claims take keeps the worker's Celery thread from Celery's
# event loop (remote control, revokes, heartbeats) for at most about this long, plus one batch.
TAKE_FOR_S = 0.25
SHUTDOWN_REPORT_S = 30.0  # a warm shutdown waiting for its batches says so this often


class WorkerRuntime:
    """Per-process worker state: Redis edge, device, loaded models, heartbeat."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.settings = settings_of(app)
        self.client = client_for(self.settings.broker_url, self.settings, **client_options(self.settings))
        self.store = RequestStore(
            self.client,
            Keys(self.settings.request_queue),
            self.settings.recovery_timeout_s,
            self.settings.wait_replicas,
            self.settings.wait_timeout_s,
        )
        # Which batches the device is running, so that a death is counted against those alone.
        self.marks = DeviceMarks(self.client, self.store.keys.inflight_running)
        self.backend = app.backend
        self.device = pick_device(self.settings.device)
        self.hostname = f"{socket.gethostname()}:{os.getpid()}"
        # Its name in task events (Flower) and in the requests its error callbacks get.
        self.nodename = f"carpool-gpu-{os.getpid()}@{socket.gethostname()}"
        self.events = TaskEvents(
            app,
            self.nodename,
            mode=self.settings.events,
            client=self.client,
        )
        # (broker db, results db) when both live on one server: then a batch finishes in one script.
        self.dbs = self.settings.shared_server_dbs()
        import_task_modules(self.settings.imports)
        self.served = served_tasks(self.settings.serve_tasks, registered())
        for warning in unserved_neighbours(self.settings, registered(), self.served):
            log.warning(warning)
        self.specs = {name: spec for name, spec in registered().items() if name in self.served}
        # Batches carry no priority, so each batch queue is one list under its own name. These are
        # the queues it starts consuming; Celery's consumer says which it consumes later on.
        self.batch_lists = batch_queues(self.settings)
        self._consumer: Any = None  # Celery's consumer, once the worker is ready
        self._inline_ids: list[str] = []  # the batch running on the Celery thread, if any
        self._stage: DeviceStage | None = None  # set by start(): batches run beside the next claim
        self._finisher: Finisher | None = None  # set by start(): results stored beside the next batch
        self._last_run_s: dict[str, float] = {}
        self._collected_at = 0.0  # perf_counter time the last launched batch's outputs came back
        self._take = self.settings.claim_takes_next  # off once the worker is shutting down
        self.batches_taken = 0  # batch messages that claims took and this process ran
        self._take_marker = marker(RUN_BATCH_TASK)
        self._accept = accepted(app.conf.accept_content)  # what a taken message's body may be
        self._take_first = 0  # the batch list a claim takes from first: the one after the last taken from
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.settings.torch_threads:
            import torch

            torch.set_num_threads(self.settings.torch_threads)

    # --- life ----------------------------------------------------------------------------
    def start(self, consumer: Any = None) -> None:
        """Load every served task (``carpool.infer``: its models), then start announcing this worker.
        ``consumer``: Celery's consumer, whose queues the heartbeat announces and claims take from."""
        self._consumer = consumer
        check_app_conf(self.app, self.specs)
        check_server(self.client, getattr(self.backend, "client", None), "worker")
        for name, spec in self.specs.items():
            t0 = time.perf_counter()
            try:
                spec.load(self.device, self.settings)
            except UnknownModel as exc:  # a model setting this worker cannot serve, as a coordinator says
                raise ConfigError(f"{name}: {exc} (CARPOOL_MODEL/CARPOOL_MODELS)") from None
            log.info("task %s ready on %s in %.1fs", name, self.device, time.perf_counter() - t0)
        if self.settings.overlap_finish:
            self._finisher = Finisher()
        if self.settings.overlap_device:
            # A batch is launched behind another only within a quarter lease of the oldest one's
            # start: behind a slow or hung batch it would be held, leased, with it.
            self._stage = DeviceStage(
                launches=self._launches(), launch_ahead_for_s=self.settings.recovery_timeout_s / 4
            )
            # A device thread waking from its batch waits for the GIL at most this long (Python's
            # default interval is longer than a fast device's batch).
            sys.setswitchinterval(DEVICE_SWITCH_INTERVAL_S)
        self.events.start()
        self._learn_revokes()
        collector.freeze_startup()  # the models and Celery's worker, out of every later collection
        try:
            self._beat()
            self.marks.check()
        except redis.ResponseError as exc:
            if refused_by_acl(exc):  # rules older than this release's heartbeat: say what to run
                raise acl_refusal("worker", self.store.client, exc) from exc
            raise
        self._thread = threading.Thread(target=self._heartbeat_loop, name="carpool-heartbeat", daemon=True)
        self._thread.start()

    def _learn_revokes(self) -> None:
        """Add the revokes coordinators recorded in Redis to those remote control fills, as a Celery
        worker learns its peers' at start: a request revoked after its batch was dispatched, run by
        a worker that started later, is answered REVOKED. (As with Celery's own start, a revoke
        broadcast between this read and the consumer's subscription reaches this worker by
        neither.)"""
        compat.learn_revokes(self.store.revoked_since, compat.revoked_ids(), time.time())

    def _launches(self) -> bool:
        """Whether any batch this worker serves starts on an asynchronous device."""
        return any(
            spec.launch_function(key, self.device, self.settings) is not None
            for spec in self.specs.values()
            for key in spec.keys(self.settings)
        )

    def shutting_down(self) -> None:
        """Take no more batch messages in claims: Celery's consumer, which is stopping, fetches none."""
        self._take = False

    def stop(self) -> None:
        """Let the batches claimed run and their results be stored, then leave: Celery's warm
        shutdown, which waits for the task it runs however long, and leaves a limit to the
        supervisor (compose's ``stop_grace_period``, then SIGKILL and lease recovery). The heartbeat
        renews the running batches' leases meanwhile."""
        for stage, what in ((self._stage, "batches on the device"), (self._finisher, "batches' results")):
            while stage is not None and not stage.drain(SHUTDOWN_REPORT_S):
                log.info("stopping once %d %s are done", stage.held(), what)
        self._stop.set()
        self.events.close()
        self.marks.close()
        with contextlib.suppress(redis.RedisError):
            self.store.leave(self.hostname)

    def _consumed(self) -> list[str]:
        """The queues Celery's consumer reads now: remote control's ``cancel_consumer`` and
        ``add_consumer`` (Flower's buttons) change them."""
        task_consumer = getattr(self._consumer, "task_consumer", None)
        if task_consumer is None:  # not started yet, or no Celery worker around this runtime
            return self.batch_lists
        return [queue.name for queue in list(task_consumer.queues)]

    def _beat(self) -> None:
        # With the batch queues it consumes: coordinators and `carpool status` say when none does.
        # Claims take the next batch from those only.
        self.batch_lists = self._consumed()
        self.store.heartbeat(self.hostname, 4 * HEARTBEAT_S, self.batch_lists)
        # Keep the leases of every batch running or having its results stored alive: a batch longer
        # than the lease is not a dead worker. One waiting behind it is not renewed: it is claimed
        # again when it starts (:meth:`_claim_again_if_waited`).
        held = list(self._inline_ids)
        if self._stage is not None:
            held += self._stage.begun_ids()
        if self._finisher is not None:
            held += self._finisher.pending_ids()
        self.store.renew_running(held)
        self.marks.flush()  # the unmarks no mark has carried since

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    # --- one batch -----------------------------------------------------------------------
    def run(self, batch: object, request: Any = None) -> BatchReport | None:
        """Run one batch message; its report, or None when it was handed to the device stage to run
        while Celery delivers the next. ``request``: the Celery task request of ``carpool.run_batch``
        (the runtime sends that task's events itself); None when called directly.

        A message this release cannot read (another wire version, or malformed) is refused with a
        :class:`~carpool.errors.WireError` before anything is claimed: its requests stay owned by
        the batch and leased by their coordinator, and lease recovery returns them to the request
        queue, where a coordinator of this release can batch them again.

        The batch's claim may take the next batch message off the batch queue (see
        :meth:`_run_taken`); that batch, and any its own claim takes, run here before this returns.
        """
        t0 = time.perf_counter()
        report, taken = self._run_one(batch, request, t0, t0 + TAKE_FOR_S)
        if taken is not None:
            self._run_taken(taken, t0 + TAKE_FOR_S)
        return report

    def _run_taken(self, taken: tuple[str, bytes], until: float) -> None:
        """Run the batch messages that claims took off the batch queue, one after another, each as
        Celery would have delivered it (its task's events included): the Celery thread goes on to
        the next batch without returning to Celery's consumer, and the batch without the round trip
        that would fetch it. A message that is not a batch task to run now goes back to the front of
        its list for Celery's consumer; a batch that fails is logged and ends the run of them."""
        next_taken: tuple[str, bytes] | None = taken
        while next_taken is not None:
            queue_list, raw = next_taken
            task = read_task(raw, RUN_BATCH_TASK, self._accept)
            if task is None or len(task.args) != 1 or task.kwargs or task.request.id in compat.revoked_ids():
                self._give_back(next_taken)  # Celery's consumer runs it, or drops it as revoked
                return
            self.batches_taken += 1
            compat.count_task_run(RUN_BATCH_TASK)
            try:
                _, next_taken = self._run_one(
                    task.args[0], task.request, time.perf_counter(), until, own=next_taken
                )
            except WireError:  # logged where it was refused; its requests return through recovery
                return
            except Exception:
                log.exception("batch task %s (taken from %s by a claim) failed", task.request.id, queue_list)
                return

    def _give_back(self, taken: tuple[str, bytes]) -> None:
        """Put a taken batch message back where BRPOP takes the next one from."""
        queue_list, raw = taken
        try:
            self.client.rpush(queue_list, raw)
        except redis.RedisError as exc:
            log.warning(
                "a batch message taken from %s could not go back (%s); its requests return through "
                "lease recovery",
                queue_list,
                exc,
            )

    def _run_one(
        self,
        batch: object,
        request: Any,
        t0: float,
        take_until: float,
        own: tuple[str, bytes] | None = None,
    ) -> tuple[BatchReport | None, tuple[str, bytes] | None]:
        """:meth:`run` for one batch message: (its report, or None when handed to the device stage;
        the next batch message, where its claim took one). Its claim takes the next one while
        ``take_until`` (perf_counter) is ahead, the worker is not shutting down and a device stage
        runs batches beside the claims (without one, a taken batch would wait for this one to run
        while another worker could take it). ``own``: this batch's message, where a claim took it:
        it goes back to its list if this fails before its claim (a message this release cannot
        read excepted: its requests return through recovery)."""
        task_id = getattr(request, "id", None)
        events = self.events.fork()  # the batch may finish on another thread, with its own events
        if task_id:
            events.received(
                task_id,
                str(getattr(request, "argsrepr", None) or ""),
                str(getattr(request, "kwargsrepr", None) or "{}"),
                name=RUN_BATCH_TASK,
                root_id=getattr(request, "root_id", None),
                parent_id=getattr(request, "parent_id", None),
                retries=int(getattr(request, "retries", 0) or 0),
            )
            events.started([task_id])
        taken: tuple[str, bytes] | None = None
        claimed_yet = False
        try:
            try:
                message = read_batch(batch)
            except WireError as exc:
                log.error(
                    "refusing batch %s: %s Its requests return to the request queue through lease recovery.",
                    task_id,
                    exc,
                )
                raise
            stage = self._stage
            # A request a worker died running comes alone, and runs with nothing beside it: should
            # this worker die too, that request is the one it died running (requeue.lua counts a
            # death for every request a dead worker had claimed; from the second, the coordinator
            # names the request and holds it a while). Claimed only once the batches before it are done.
            alone = message["flush"] == FlushReason.ALONE
            if alone:
                for running in (stage, self._finisher):
                    if running is not None:
                        running.drain()
            elif stage is not None:  # claim only what the device can take soon: the leases stay short
                stage.wait_for_room()
            take = not alone and stage is not None and self._take and time.perf_counter() < take_until
            claimed_yet = True  # from here its requests may be claimed by this worker: never given back
            claimed, taken = self._claimed(message, events, task_id, t0, take)
            if alone or stage is None or (claimed.batches_queued == 0 and stage.idle()):
                # Nothing to overlap with: a hand-off would only add a thread wake-up to its latency.
                self._inline_ids = claimed.ack_ids
                report = self._complete(claimed)
                if alone and self._finisher is not None:
                    self._finisher.drain()  # stored before another batch is claimed beside it
                return report, taken
            launch = self._launch_function(message) if stage.may_start_here() else None
            if launch is not None:
                # The device thread would start it at once, but it may be waiting on the device to
                # complete the batch before: launched here, this one is queued on the device now.
                self._inline_ids = claimed.ack_ids
                complete, launched = self._start(claimed, launch)
                job = partial(self._reporting, claimed, complete)
                if launched:
                    stage.add_started(job, claimed.ack_ids)
                else:  # nothing launched: stored in its turn, after the batches before it
                    stage.submit(job, claimed.ack_ids)
                return None, taken
            stage.submit(partial(self._complete_or_report, claimed), claimed.ack_ids)
            return None, taken
        except BaseException as exc:
            if taken is not None:
                self._give_back(taken)
            if own is not None and not claimed_yet and not isinstance(exc, WireError):
                self._give_back(own)
            if task_id and not isinstance(exc, KeyboardInterrupt | SystemExit):
                _send_failure(events, task_id, exc, t0)
            raise
        finally:
            # Whatever happened, stop renewing this batch's leases: if it did not finish, its
            # requests must come back through recovery instead of being held forever.
            self._inline_ids = []

    def _claimed(
        self, batch: BatchMessage, events: TaskEvents, task_id: str | None, t0: float, take: bool
    ) -> tuple[ClaimedBatch, tuple[str, bytes] | None]:
        """Claim the batch's requests and sort them: not this batch's, answered already, revoked, to
        run; with ``take``, the claim also takes the next batch message, which comes back beside."""
        claim = self._claim(batch["id"], [r["id"] for r in batch["requests"]], take)
        try:
            claimed = claimed_batch(batch, claim.flags, claim.batches_queued, task_id, t0, events)
        except BaseException:
            if claim.taken is not None:
                self._give_back(claim.taken)
            raise
        claimed.claimed_at = time.perf_counter()
        if claimed.answered:
            self._announce_revoked(claimed)
        return claimed, claim.taken

    def _claim_again_if_waited(self, claimed: ClaimedBatch) -> None:
        """Claim a batch once more as it starts if it waited in the device stage for longer than a
        quarter lease: the heartbeat does not renew a waiting batch's leases, so requests stuck behind
        a long or hung batch go back to the coordinators and on to another worker (their expiry and
        revokes applied there). Those no longer this batch's are left out; those answered meanwhile
        are not run again. A claim leaves each lease with at least seven eighths of its length, so a
        batch that starts sooner still holds every request it claimed."""
        if time.perf_counter() - claimed.claimed_at <= self.settings.recovery_timeout_s / 4:
            return
        if not claimed.to_run:
            return
        claim = self._claim(claimed.batch["id"], [r["id"] for r in claimed.to_run], take=False)
        kept: list[RequestSlot] = []
        gone: set[str] = set()
        answered: list[str] = []
        for r, flag in zip(claimed.to_run, claim.flags, strict=True):
            if flag == 1:
                kept.append(r)
            elif flag == 0:  # recovered while it waited, and another batch's now
                gone.add(r["id"])
            else:  # answered meanwhile (revoked, expired): acknowledged, not run again
                answered.append(r["id"])
        if answered:
            claimed.answered += answered
            self._announce_revoked(claimed, answered)
        if len(kept) < len(claimed.to_run):
            log.info(
                "batch %s waited %.1f s behind the one before it: %d of its %d requests to run went"
                " back to the coordinators meanwhile, or were answered; running the rest",
                claimed.batch["id"],
                time.perf_counter() - claimed.claimed_at,
                len(claimed.to_run) - len(kept),
                len(claimed.to_run),
            )
            claimed.to_run = kept
            claimed.ack_ids[:] = [i for i in claimed.ack_ids if i not in gone]  # the stage holds this list

    def _announce_revoked(self, claimed: ClaimedBatch, answered: list[str] | None = None) -> None:
        """Send task-revoked for the requests of the batch answered REVOKED since it was batched
        (of ``answered``, where given: those a second claim found answered).

        Celery's revoke handler stores REVOKED in every worker that hears the broadcast, at once and
        without a task event (a Celery worker sends one when it meets the task's message); the
        claim then finds them answered, and without this Flower would show them received for ever.
        Read only for ids this worker heard revoked: a rerun's answered requests sent theirs."""
        revoked = compat.revoked_ids()
        among = claimed.answered if answered is None else answered
        ids = [i for i in among if i in revoked] if len(revoked) else []
        if not ids:
            return
        try:
            revoked = self._answered_revoked(ids)
        except redis.RedisError as exc:  # telemetry: the answers themselves are stored
            log.warning("could not read %d revoked answers for their task events: %s", len(ids), exc)
            return
        for request_id in ids:
            if request_id in revoked:
                claimed.events.revoked(request_id)

    def _answered_revoked(self, ids: list[str]) -> set[str]:
        """Those of ``ids`` whose stored answer is REVOKED, read in one MGET."""
        backend = self.backend
        stored = backend.client.mget([backend.get_key_for_task(i) for i in ids])
        return {
            request_id
            for request_id, raw in zip(ids, stored, strict=True)
            if raw is not None and backend.decode_result(raw).get("status") == REVOKED
        }

    def _complete_or_report(self, claimed: ClaimedBatch) -> Callable[[], object] | None:
        """:meth:`_start` on the device stage's thread, sending the batch task's failure if it fails;
        the batch's completion when it was launched on an asynchronous device (the stage calls it
        after starting the next batch), else None once the batch is complete."""
        complete, launched = self._reporting(claimed, partial(self._start, claimed))
        if not launched:
            self._reporting(claimed, complete)
            return None
        return partial(self._reporting, claimed, complete)

    @staticmethod
    def _reporting(claimed: ClaimedBatch, call: Callable[[], T]) -> T:
        """``call()``, sending the batch task's failure if it raises."""
        try:
            return call()
        except Exception as exc:
            if claimed.task_id:
                _send_failure(claimed.events, claimed.task_id, exc, claimed.t0)
            raise

    def _complete(self, claimed: ClaimedBatch) -> BatchReport | None:
        """Run a claimed batch's requests still within their deadline, then store every outcome:
        here, or on the finisher's thread while the device runs the next batch (then None)."""
        complete, _ = self._start(claimed)
        return complete()

    def _start(
        self, claimed: ClaimedBatch, launch: LaunchCall | None = None
    ) -> tuple[Callable[[], BatchReport | None], bool]:
        """Fail the batch's requests past their deadline and start the rest on the device: (what
        completes the batch, whether the rest were launched on an asynchronous device and are
        still running there). ``launch``: the batch's launch function, where the caller looked it
        up already."""
        batch, entries = claimed.batch, claimed.entries
        self._claim_again_if_waited(claimed)
        now = time.time()
        live: list[RequestSlot] = []
        for r in claimed.to_run:
            if may_start(r["deadline"], now):
                live.append(r)
            elif r.get("expires"):  # the caller's expires=: Celery answers it revoked
                entries.append((r["id"], REVOKED, TaskRevokedError("expired")))
            else:
                late = DeadlineExceeded.waited(
                    now - r["deadline"], "when its batch started", now - r["sent_at"]
                )
                entries.append((r["id"], FAILURE, late))
        if not live:
            return partial(self._hand_over, claimed, live, None, 0), False
        if launch is None:
            launch = self._launch_function(batch)
        started = False
        if launch is not None:
            self._started(batch, live, claimed.events)
            started = True
            try:
                launched_at = time.perf_counter()
                collect = launch([r["item"] for r in live], [r["len"] for r in live])
                return partial(self._collect, claimed, live, collect, launched_at), True
            except BaseException as exc:  # the model's own, which the synchronous run fails items for
                if stops_the_process(exc):
                    raise
                log.warning(
                    "batch %s: launch failed (%s: %s); running it synchronously",
                    batch["id"],
                    type(exc).__name__,
                    exc,
                )
        run_s, padded_len = self._forward(claimed, live, started=started)
        return partial(self._hand_over, claimed, live, run_s, padded_len), False

    def _hand_over(
        self, claimed: ClaimedBatch, live: list[RequestSlot], run_s: float | None, padded_len: int
    ) -> BatchReport | None:
        """The device is done with the batch (marked begun by :meth:`_started` if any request was
        live): store its outcomes here, or on the finisher's thread (then None), unmarked while it
        waits there: a batch waiting to be stored cannot kill its worker."""
        finisher, stage = self._finisher, self._stage
        if finisher is not None and stores_behind(
            claimed.batches_queued, stage.held() if stage is not None else 0, finisher.held()
        ):
            if live:
                self.marks.end(claimed.batch["id"])
            store = partial(self._store, claimed, live, run_s, padded_len, marked=False)
            finisher.submit(store, claimed.ack_ids)
            return None
        return self._store(claimed, live, run_s, padded_len)

    def _store(
        self,
        claimed: ClaimedBatch,
        live: list[RequestSlot],
        run_s: float | None,
        padded_len: int,
        marked: bool = True,
    ) -> BatchReport:
        """:meth:`_store_outcomes`, with the batch marked running meanwhile (``marked``: it still is,
        from its run): a worker that dies storing a batch's results (encoding one too large for its
        memory) dies running that batch. Unmarked after."""
        batch_id = claimed.batch["id"]
        if live and not marked:
            self.marks.begin(batch_id)
        try:
            return self._store_outcomes(claimed, live, run_s, padded_len)
        finally:
            if live:
                self.marks.end(batch_id)

    def _store_outcomes(
        self, claimed: ClaimedBatch, live: list[RequestSlot], run_s: float | None, padded_len: int
    ) -> BatchReport:
        """Send a batch's events, store its outcomes and acknowledge it, with its report."""
        batch, events = claimed.batch, claimed.events
        entries = claimed.entries = _revoked_meanwhile(claimed.entries)
        batch_id = batch["id"]
        linked, inboxes = claimed.linked, claimed.inboxes
        # Encoded first: a result the serializer cannot carry becomes its request's failure (in
        # entries too), so the events, the report and the links below say what is stored.
        encoded = self.backend.store_args(entries, inboxes)
        writes = entries
        chain = batch_chain_failures(entries, linked) if linked else []
        if chain:  # the steps after a failed request fail with it, in the same store (rare: encoded again)
            writes = entries + chain
            encoded = self.backend.store_args(writes, inboxes)
        log_failures(batch["task"], batch_id, entries)
        # Each request's runtime is its batch's, also when a failure split the batch (then run_s, for
        # the coordinator's latency model, is None): Flower leaves a runtime of 0 out of its figures.
        events.outcomes(entries, claimed.ran_s or 0.0)
        report = batch_report(
            batch_id=batch_id,
            model=batch["model"],
            worker=self.hostname,
            device=self.device,
            bin_label=batch["bin"],
            flush=batch["flush"],
            size=len(live),
            padded_len=padded_len,
            real_tokens=sum(r["len"] for r in live),
            run_s=run_s,
            failed_model=sum(
                1 for e in entries if e[1] == FAILURE and not isinstance(e[2], DeadlineExceeded)
            ),
            failed_deadline=sum(1 for e in entries if isinstance(e[2], DeadlineExceeded) or _expired(e)),
            done_at=time.time(),
        )
        if claimed.task_id:  # the batch's own task-succeeded rides with its requests' events
            elapsed = time.perf_counter() - claimed.t0
            events.succeeded(claimed.task_id, report, elapsed, limit=BATCH_REPR_LIMIT)
        ack_ids = claimed.ack_ids
        buffered = events.take_buffered()
        published = events.encoded(buffered)
        # Redis may be restarting: the results are computed, so keep trying to hand them over
        # for a while before giving the batch up to recovery.
        # Filed with the results, so that a worker dying before it sends their links leaves them
        # for a coordinator to send.
        outbox = filed_links(batch["task"], entries, linked) if linked else []
        stored = retrying(
            lambda: self._finish(encoded, ack_ids, report, batch["coordinator"], published, outbox)
        )
        if len(stored) < len(writes):
            self._answered_meanwhile(batch_id, writes, stored, buffered if published else None)
        if linked:
            apply_links(self.app, self.backend, batch["task"], entries, stored, linked, self.nodename)
            self._links_sent(outbox, stored)
        return report

    def _links_sent(self, outbox: Sequence[tuple[int, str, bytes]], stored: list[int]) -> None:
        """Empty the outbox entries of the links just applied (those of the results stored)."""
        done = set(stored)
        ids = [request_id for index, request_id, _ in outbox if index in done]
        try:
            retrying(lambda: self.store.links_sent(ids))
        except Exception as exc:
            log.warning(
                "the links of %d requests were sent, but their outbox entries could not be emptied (%s):"
                " a coordinator sends them again in a lease",
                len(ids),
                described(exc),
            )

    def _answered_meanwhile(
        self,
        batch_id: str,
        writes: list[tuple[str, str, Any]],
        stored: list[int],
        events: list[dict[str, Any]] | None,
    ) -> None:
        """Results write-once refused: their requests were answered while the batch ran. Those
        answered REVOKED (another worker's revoke handler, while this one's Celery thread ran the
        batch) are logged as such; the others had an earlier run (counted). ``events``, which the
        finish withheld, are published with those outcomes corrected."""
        stored_at = set(stored)
        kept = {writes[i - 1][0] for i in stored_at}
        refused = {w[0] for i, w in enumerate(writes, 1) if i not in stored_at} - kept
        try:
            revoked = self._answered_revoked(sorted(refused))
        except redis.RedisError as exc:  # telemetry: the answers themselves are stored
            log.warning("batch %s: could not read the answers its results met: %s", batch_id, exc)
            revoked = set()
        if revoked:
            log.info(
                "batch %s: %d request(s) revoked while it ran; their REVOKED answer stands: %s",
                batch_id,
                len(revoked),
                ", ".join(sorted(revoked)[:5]),
            )
        reran = [w for w in writes if w[0] in refused - revoked]
        if reran:
            count_rejected(self.client, self.store.keys.stats, batch_id, reran, [])
        if events is not None:
            corrected = self.events.encoded(answered_elsewhere(events, refused, revoked))
            if corrected is not None:
                try:
                    self.client.publish(*corrected)
                except redis.RedisError as exc:
                    log.warning("could not publish task events (Flower will miss them): %s", exc)

    def _claim(self, batch_id: str, ids: list[str], take: bool) -> Claimed:
        """Per id: 0 (no longer this batch's), 1 (claimed, to run) or 2 (claimed, answered already);
        the batch messages queued for this worker's queues (None: not counted); and, with ``take``,
        the next of them where it is a batch task's (only when the results live on the broker's
        server: the claim is then one script)."""
        with self._stopping_on_acl_refusal():
            return self._claim_in_redis(batch_id, ids, take)

    @contextlib.contextmanager
    def _stopping_on_acl_refusal(self) -> Iterator[None]:
        """A command the worker's Redis user may not run fails the batch with what to change, not
        Redis's bare words, and stops the worker (:meth:`_stop_for`)."""
        try:
            yield
        except redis.ResponseError as exc:
            if refused_by_acl(exc):
                error = acl_refusal("worker", self.store.client, exc)
                self._stop_for(error)
                raise error from exc
            raise

    def _stop_for(self, error: Exception, status: int = CONFIG_ERROR_EXIT) -> None:
        """Ask Celery for a warm shutdown ending in exit status ``status`` (2, as the coordinator
        stops on a ``ConfigError``): no batch gets past a deployment error or a lost device, and a
        worker that went on taking batches would fail each one, its requests coming back through
        lease recovery to fail again, for as long as nobody read its log. The requests of batches
        it has not claimed wait in Redis for a mended one."""
        log.critical("%s; this worker stops (exit status %d)", error, status)
        self.shutting_down()
        worker_state.should_stop = status

    def _claim_in_redis(self, batch_id: str, ids: list[str], take: bool) -> Claimed:
        if self.dbs is not None:
            result_keys = [self.backend.get_key_for_task(i) for i in ids]
            marked = self._take_marker if take else ""
            # Takes go round the batch queues, as kombu's consumer goes round them for its BRPOP.
            queues = self.batch_lists  # the heartbeat's thread replaces it when the consumer's change
            first = self._take_first % len(queues) if queues else 0
            lists = queues[first:] + queues[:first]
            claimed = self.store.claim_fresh(batch_id, ids, result_keys, self.dbs[1], lists, marked)
            if claimed.taken is not None:
                self._take_first = (queues.index(claimed.taken[0]) + 1) % len(queues)
            return claimed
        # Results on another server: claim, then look for stored results there.
        owned = self.store.claim(batch_id, ids)
        answered = self.backend.existing([i for i, ok in zip(ids, owned, strict=True) if ok])
        flags = [(2 if i in answered else 1) if ok else 0 for i, ok in zip(ids, owned, strict=True)]
        return Claimed(flags, None)

    def _started(self, batch: BatchMessage, live: list[RequestSlot], events: TaskEvents) -> None:
        """The batch is about to start on the device: mark it running (:meth:`_store` unmarks it
        once its results are stored), and send its requests' STARTED events where someone could
        watch them."""
        self.marks.begin(batch["id"])
        # Published before running only when someone could watch the batch as STARTED; otherwise
        # they leave with the results, in the batch's one publish.
        events.started([r["id"] for r in live])
        if self._last_run_s.get(batch["model"], 0.0) > LIVE_STARTED_S:
            events.flush()

    def _launch_function(self, batch: BatchMessage) -> LaunchCall | None:
        """How the batch's task starts a batch on an asynchronous device; None where its device
        computes synchronously or the task is unavailable (:meth:`_forward` reports why)."""
        try:
            spec = served_spec(self.specs, self.served, batch["task"])
            return spec.launch_function(batch["model"], self.device, self.settings)
        except Exception:
            return None

    def _collect(
        self,
        claimed: ClaimedBatch,
        live: list[RequestSlot],
        collect: Callable[[], Sequence[Any]],
        launched_at: float,
    ) -> BatchReport | None:
        """Wait for a launched batch's outputs, then hand the batch over to be stored. A batch that
        failed on the device runs again synchronously, split until its failures are alone."""
        batch, entries = claimed.batch, claimed.entries
        mismatch = None
        failed = False
        try:
            outputs = one_per_item(collect(), len(live))
        except OutputCountMismatch as exc:  # splitting cannot say which output is whose
            mismatch, outputs = exc, []
        except BaseException as exc:
            if stops_the_process(exc):
                raise
            log.warning(
                "batch %s failed on the device (%s: %s); running it again synchronously",
                batch["id"],
                type(exc).__name__,
                exc,
            )
            release_frames(exc)  # what the failed run held (its device memory) is not kept for the rerun
            failed = True
        if failed:  # outside the handler, which would keep the failure and its frames alive meanwhile
            rerun_s, padded_len = self._forward(claimed, live, started=True)
            return self._hand_over(claimed, live, rerun_s, padded_len)
        done = time.perf_counter()
        # The device ran this batch from when it was launched or the previous batch came back,
        # whichever is later: queued behind another batch is not this batch's run time.
        device_s = done - max(launched_at, self._collected_at)
        self._collected_at = done
        self._last_run_s[batch["model"]] = device_s
        claimed.ran_s = device_s
        run_s: float | None = device_s
        spec = served_spec(self.specs, self.served, batch["task"])
        if mismatch is not None:
            outcomes: list[tuple[bool, Any]] = [(False, ModelError(described(mismatch)))] * len(live)
            run_s = None
        else:
            outcomes = [(True, out) for out in outputs]
            if spec.checks_outputs:
                outcomes = _checked(spec.name, outcomes, self.settings.result_serializer)
                if not all(ok for ok, _ in outcomes):
                    run_s = None
        self._record(live, outcomes, entries, spec.raises_as_raised)
        return self._hand_over(claimed, live, run_s, _padded_len(live, spec.pad_multiple))

    @staticmethod
    def _record(
        live: list[RequestSlot],
        outcomes: list[tuple[bool, Any]],
        entries: list[tuple[str, str, Any]],
        as_raised: bool,
    ) -> None:
        """Each request's outcome into ``entries``. ``as_raised``: what the batch function raised is
        stored as it was raised (a ``@batched`` task's caller gets its own exception, as from a
        Celery task); else, and for what carpool found wrong (a :class:`ModelError` already, or
        outputs that do not match the items), a :class:`ModelError` naming it."""
        for r, (ok, out) in zip(live, outcomes, strict=True):
            if ok:
                entries.append((r["id"], SUCCESS, out))
            elif isinstance(out, ModelError) or (as_raised and not isinstance(out, OutputCountMismatch)):
                entries.append((r["id"], FAILURE, out))
            else:
                entries.append((r["id"], FAILURE, ModelError(described(out))))

    def _forward(
        self, claimed: ClaimedBatch, live: list[RequestSlot], started: bool = False
    ) -> tuple[float | None, int]:
        """Run ``live`` on the model, appending each request's outcome to the batch's entries;
        returns (model time, or None when a failure split the batch; padded length), and sets
        ``claimed.ran_s`` either way. ``started``: the requests' STARTED events were sent already
        (by a launch that failed)."""
        batch, entries, events = claimed.batch, claimed.entries, claimed.events
        if not started:
            self._started(batch, live, events)
        run_s = None
        padded_len = 0
        spec = None
        try:
            lengths = [r["len"] for r in live]
            spec = served_spec(self.specs, self.served, batch["task"])
            t0 = time.perf_counter()
            call = spec.batch_function(batch["model"], self.device, self.settings)
            items = [r["item"] for r in live]
            pristine = pristine_items(items) if spec.may_change_items else None
            outcomes = run_call_isolating(call, items, lengths, pristine, spec.inference_mode)
            if spec.checks_outputs:
                outcomes = _checked(spec.name, outcomes, self.settings.result_serializer)
            elapsed = time.perf_counter() - t0
            self._last_run_s[batch["model"]] = elapsed
            claimed.ran_s = elapsed
            if all(ok for ok, _ in outcomes):
                run_s = elapsed  # a split batch's time says nothing about the latency model
            padded_len = _padded_len(live, spec.pad_multiple)
        except DeviceLost as exc:
            outcomes = [(False, exc)] * len(live)
            self._stop_for(exc, EX_FAILURE)
        except Exception as exc:  # model or task failed to load: every request fails with the reason
            log.exception("batch %s: %s unavailable", batch["id"], batch["model"])
            outcomes = [(False, ModelError(described(exc)))] * len(live)
        self._record(live, outcomes, entries, spec is not None and spec.raises_as_raised)
        return run_s, padded_len

    def _finish(
        self,
        writes: ResultWrites,
        ack_ids: list[str],
        report: BatchReport,
        coordinator: str,
        events: tuple[str, bytes] | None,
        outbox: Sequence[tuple[int, str, bytes]] = (),
    ) -> list[int]:
        """Results (write-once, each published on its own channel and, for producers that named one,
        in their result inbox's one message), acks, the report, the task events and the links outbox's
        entries of the results stored: one round trip when the results live on the broker's server,
        else a store on the backend and one trip for the rest. Returns the 1-based indexes in
        ``writes`` of the results stored (the others had one)."""
        with self._stopping_on_acl_refusal():
            return self.store.answer(
                self.backend,
                self.dbs,
                writes,
                ack_ids,
                report=cast(dict[str, Any], report),
                coordinator=coordinator,
                events=events,
                outbox=outbox,
            )


def stores_behind(batches_queued: int | None, device_held: int, finisher_held: int) -> bool:
    """Whether a batch's results go to the finisher rather than being stored on this thread: another
    batch is queued (``None``: not counted) or beside this one in the device stage, so the device can
    start it meanwhile; or the finisher still holds earlier batches, whose results must be stored
    first (results are stored in the order their batches ran)."""
    return batches_queued != 0 or device_held > 1 or finisher_held > 0


def _padded_len(live: list[RequestSlot], multiple: int) -> int:
    """The length a batch of ``live`` was padded to, counted as the coordinator counts it (each
    task's ``pad_multiple``): its latency model learns from these reports what it predicts from
    its own counts."""
    return padded_length(max(max(r["len"] for r in live), 1), multiple)


def _send_failure(events: TaskEvents, task_id: str, exc: BaseException, t0: float) -> None:
    """Publish the batch task's task-failed event now (nothing else will carry it)."""
    events.failed(task_id, exc, time.perf_counter() - t0, traceback.format_exc())
    events.flush()


def _checked(task: str, outcomes: list[tuple[bool, Any]], serializer: str) -> list[tuple[bool, Any]]:
    """``outcomes`` with each output JSON (or msgpack) cannot carry unchanged made a ModelError
    (failures stay as they are)."""
    checked = storable(task, outcomes, serializer)
    return [
        (ok, value if ok or not was_ok else ModelError(described(value)))
        for (was_ok, _), (ok, value) in zip(outcomes, checked, strict=True)
    ]


def _revoked_meanwhile(entries: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """``entries``, those revoked while their batch ran answered REVOKED instead.

    Celery's revoke handler adds the id to the revoked set, then stores REVOKED, write-once here:
    an outcome stored after that is refused, so its task events must say revoked, and its
    callbacks must not run. A revoke heard after this check finds the outcome stored and keeps it,
    events and all."""
    revoked = compat.revoked_ids()
    if not len(revoked):
        return entries
    out = []
    for entry in entries:
        if entry[1] != REVOKED and entry[0] in revoked:
            entry = (entry[0], REVOKED, TaskRevokedError("revoked"))
        out.append(entry)
    return out


def _expired(entry: tuple[str, str, Any]) -> bool:
    """Whether a request's outcome is its caller's expires= passing (Celery's revoke, 'expired')."""
    return entry[1] == REVOKED and isinstance(entry[2], TaskRevokedError) and entry[2].args == ("expired",)
