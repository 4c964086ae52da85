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
  ``store_many`` (one script call per batch, so the baseline does not lose on result writes).

celery-batches needs a prefetch limit above ``flush_every`` or the worker never holds a full batch;
its docs say multiplier 0 (unlimited), but ``celery worker --prefetch-multiplier 0`` reads 0 as "not
given" and falls back to the app's 1 (a prefetch of 2: every flush held 2 requests), so the bench passes
10000, which is unlimited in practice.

Both baselines run with per-task events off: that only makes them faster, so carpool is compared
with the strongest version of each that keeps Celery's delivery guarantee (kombu's ack emulation
stays on; see below).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from carpool import tasks as _tasks  # noqa: F401  (registers carpool.infer)
from carpool.celery_edge.app import app, settings_of

log = logging.getLogger(__name__)

BATCHED_TASK = "carpool.bench.batched_infer"
BATCHED_QUEUE = "carpool.bench.batched"
STATS_KEY = "carpool:bench:batched:stats"

settings = settings_of(app)
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


def run_fifo_batch(requests: list[Any]) -> None:
    """Run buffered celery-batches requests as one FIFO batch and store each result."""
    from carpool.batching.bins import padded_length
    from carpool.celery_edge.results import FAILURE, SUCCESS
    from carpool.errors import ModelError
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
        (r.id, SUCCESS, out) if ok else (r.id, FAILURE, ModelError(f"{type(out).__name__}: {out}"))
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
