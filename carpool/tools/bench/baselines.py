"""Celery app module for the two Celery baselines of ``carpool bench``.

    celery -A carpool.tools.bench.baselines worker -Q carpool.requests --pool solo          # plain Celery
    celery -A carpool.tools.bench.baselines worker -Q carpool.bench.batched --pool solo \\
        --prefetch-multiplier 10000                                                # celery-batches

It is carpool's own Celery app (same broker, backend, serializer, settings from ``CARPOOL_*``) with:

- ``carpool.infer`` registered (importing ``carpool.tasks``): a plain worker on the request queue runs
  its body, ``run_single``, one task per request -- what serving the model with Celery alone means;
- ``carpool.bench.batched_infer``, a ``celery_batches.Batches`` task: the worker buffers requests and
  flushes every ``CARPOOL_MAX_BATCH`` requests or ``CARPOOL_MAX_WAIT_S`` seconds; each flush tokenizes
  the buffered texts and runs them as one batch in arrival order (FIFO), padded to the longest (rounded
  up to 8, as carpool pads), then stores every request's result under its own id with carpool's
  ``store_many`` (one script call per batch, so the baseline does not lose on result writes);
- with ``CARPOOL_BENCH_TASK`` naming a ``@batched`` task (``carpool bench --task``), its module imported
  from ``CARPOOL_IMPORTS``: a plain worker runs that task's own Celery body, ``fn([item])`` per request,
  and ``carpool.bench.batched_task``, a ``Batches`` task, runs ``fn`` on each flush's items in arrival
  order and stores each output, as carpool's worker does (failing items isolated, outputs checked).

celery-batches needs a prefetch limit above ``flush_every`` or the worker never holds a full batch;
its docs say multiplier 0 (unlimited), but ``celery worker --prefetch-multiplier 0`` reads 0 as "not
given" and falls back to the app's 1 (a prefetch of 2: every flush held 2 requests), so the bench passes
10000, which is unlimited in practice.

Both baselines run with per-task events off: that only makes them faster, so carpool is compared
with the strongest version of each that keeps Celery's delivery guarantee (kombu's ack emulation
stays on; see below).
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

from celery import signals

from carpool import tasks as _tasks  # noqa: F401  (registers carpool.infer)
from carpool.celery_edge.app import app, settings_of

if TYPE_CHECKING:
    from carpool.registry import BatchedSpec

log = logging.getLogger(__name__)

BATCHED_TASK = "carpool.bench.batched_infer"
BATCHED_QUEUE = "carpool.bench.batched"
STATS_KEY = "carpool:bench:batched:stats"
TASK_ENV = "CARPOOL_BENCH_TASK"  # the @batched task the baselines serve with ``carpool bench --task``
BATCHED_TASK_ITEMS = "carpool.bench.batched_task"
# One JSON list of request ids per flush of BATCHED_TASK_ITEMS: the bench knows each request's
# length, so the worker need not compute lengths that celery-batches itself never uses.
BATCH_IDS_KEY = "carpool:bench:batched:ids"

settings = settings_of(app)
# The worker imports the user's task modules at start, as Celery's ``imports`` setting does.
app.conf.imports = tuple(settings.imports)
app.conf.worker_send_task_events = False
# Plain Celery as people run it on Redis: kombu's ack emulation on, so a message fetched by a worker
# that dies before acking it is delivered again. carpool's app turns it off (carpool.celery_edge.app)
# because carpool's per-request leases give that guarantee instead; a baseline without it would
# lose requests on a crash, which is not the system carpool claims to beat.
app.conf.broker_transport_options = {}


@signals.worker_ready.connect  # type: ignore[untyped-decorator]
def _set_torch_threads(**_: Any) -> None:
    """``CARPOOL_TORCH_THREADS``, as carpool's own worker applies it, so every system runs the same torch."""
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)


@signals.worker_ready.connect  # type: ignore[untyped-decorator]
def _load_task(**_: Any) -> None:
    """Build the benchmarked task's heavy state before the first request, as carpool's worker does."""
    spec = _bench_spec()
    if spec is not None:
        from carpool.gpu_worker.runner import pick_device

        spec.load(pick_device(settings.device), settings)


def _bench_spec() -> BatchedSpec | None:
    """The BatchedSpec named by ``CARPOOL_BENCH_TASK``, or None when the variable is unset."""
    from carpool.errors import ConfigError
    from carpool.registry import BatchedSpec, spec_for

    name = os.environ.get(TASK_ENV)
    if not name:
        return None
    spec = spec_for(name)
    if not isinstance(spec, BatchedSpec):
        raise ConfigError(f"{TASK_ENV}={name!r} is no @batched task of CARPOOL_IMPORTS {settings.imports}")
    return spec


def run_fifo_batch(requests: list[Any]) -> None:
    """Run buffered celery-batches requests as one FIFO batch and store each result."""
    from carpool.batching.bins import padded_length
    from carpool.celery_edge.results import FAILURE, SUCCESS
    from carpool.errors import ModelError, described
    from carpool.gpu_worker.runner import loaded_model, pick_device, run_isolating

    if not requests:
        return
    model_name = settings.model
    model = loaded_model(model_name, pick_device(settings.device), settings.autocast_bf16)
    texts = []
    for r in requests:
        args = list(r.args or ())
        texts.append(str(args[0] if args else (r.kwargs or {}).get("text", "")))
    ids = model.encode(texts)
    lengths = [len(i) for i in ids]
    rows = ids if model.needs_token_ids else [None] * len(ids)
    outcomes = run_isolating(model, rows, lengths)
    entries = [
        (r.id, SUCCESS, out) if ok else (r.id, FAILURE, ModelError(described(out)))
        for r, (ok, out) in zip(requests, outcomes, strict=True)
    ]
    app.backend.store_many(entries)
    padded = padded_length(max(lengths)) * len(lengths)
    with app.backend.client.pipeline(transaction=False) as pipe:
        pipe.hincrby(STATS_KEY, "batches", 1)
        pipe.hincrby(STATS_KEY, f"size:{len(requests)}", 1)
        pipe.hincrby(STATS_KEY, "padded_tokens", padded)
        pipe.hincrby(STATS_KEY, "real_tokens", sum(lengths))
        pipe.execute()


def run_task_batch(requests: list[Any]) -> None:
    """Run buffered requests of the benchmarked task as one batch of its function; store each output."""
    from carpool.celery_edge.results import FAILURE, SUCCESS
    from carpool.codec import storable
    from carpool.errors import ConfigError, ModelError, described
    from carpool.gpu_worker.runner import run_items_isolating

    if not requests:
        return
    spec = _bench_spec()
    if spec is None:
        raise ConfigError(f"{BATCHED_TASK_ITEMS} runs the task named by {TASK_ENV}, which is not set")
    items = [(r.args or [None])[0] for r in requests]
    outcomes = storable(spec.name, run_items_isolating(spec.fn, items), settings.result_serializer)
    entries = [
        (r.id, SUCCESS, out) if ok else (r.id, FAILURE, ModelError(described(out)))
        for r, (ok, out) in zip(requests, outcomes, strict=True)
    ]
    app.backend.store_many(entries)
    app.backend.client.rpush(BATCH_IDS_KEY, json.dumps([r.id for r in requests]))


try:
    from celery_batches import Batches
except ImportError:  # pragma: no cover - celery-batches is a dev extra
    Batches = None

if Batches is not None:

    @app.task(  # type: ignore[untyped-decorator]
        base=Batches,
        name=BATCHED_TASK,
        flush_every=settings.max_batch,
        flush_interval=settings.max_wait_s,
        ignore_result=True,
    )
    def batched_infer(requests: list[Any]) -> None:
        run_fifo_batch(requests)

    @app.task(  # type: ignore[untyped-decorator]
        base=Batches,
        name=BATCHED_TASK_ITEMS,
        flush_every=settings.max_batch,
        flush_interval=settings.max_wait_s,
        ignore_result=True,
    )
    def batched_task(requests: list[Any]) -> None:
        run_task_batch(requests)
