"""Batches out of the coordinator: each as the ``carpool.run_batch`` message ``app.send_task`` would
send, pushed with its requests' ownership and the buffered task events in one script call per batch
queue (one call unless a task has a batch queue of its own)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, cast

from celery import Celery

from carpool.batching import Batch
from carpool.celery_edge.task_messages import TaskMessageBuilder
from carpool.codec import finite
from carpool.config import Settings
from carpool.names import RUN_BATCH_TASK
from carpool.redis_edge.store import RequestStore
from carpool.registry import TaskSpec, batch_queue_of
from carpool.wire import RequestSlot, batch_message


class BatchPublisher:
    """Renders and pushes batch messages; kept for the process's life, with one message builder per
    batch queue (a builder renders from a template it learns from Celery's own first messages)."""

    def __init__(
        self,
        app: Celery,
        store: RequestStore,
        settings: Settings,
        task_of_key: Mapping[str, TaskSpec],
        hostname: str,
    ) -> None:
        self.app = app
        self.store = store
        self.settings = settings
        self.task_of_key = task_of_key
        self.hostname = hostname
        self._builders: dict[str, TaskMessageBuilder] = {}

    def queue_of(self, key: str) -> str:
        """The batch queue of a routing key: its task's own, else the deployment's."""
        return batch_queue_of(self.task_of_key[key], self.settings)

    def by_queue(self, batches: list[Batch]) -> dict[str, list[Batch]]:
        groups: dict[str, list[Batch]] = {}
        for batch in batches:
            groups.setdefault(self.queue_of(batch.model), []).append(batch)
        return groups

    def publish(
        self, queue: str, batches: list[Batch], wall_now: float, events: tuple[str, bytes] | None
    ) -> tuple[list[str], int]:
        """Push ``batches`` to ``queue`` with ownership, lease renewal and ``events`` (published
        first, so Flower sees requests received before started); returns the batch ids and how many
        of their requests were still in flight, and so assigned (a coordinator stalled past its
        lease may hold requests another has reaped). Raises if Redis did not take the call, and
        then nothing of it was applied."""
        batch_ids = [str(uuid.uuid4()) for _ in batches]  # Celery-style task ids: Flower lists them
        calls: list[tuple[list[Any], dict[str, Any]]] = []
        summaries: list[str] = []
        # Everything in a batch message is JSON the coordinator decoded (items validated finite) or
        # computed; only a request's links (signatures, as a client sent them) may hold a nan, which
        # orjson would write as null, so a batch with such links is written by kombu's encoder.
        plain = True
        for batch_id, batch in zip(batch_ids, batches, strict=True):
            task = self.task_of_key[batch.model].name
            message = batch_message(
                batch_id=batch_id,
                task=task,
                model=batch.model,
                bin_label=batch.bin_label,
                flush=batch.flush_reason.value,
                padded_len=batch.padded_len,
                dispatched_at=wall_now,
                coordinator=self.hostname,
                requests=cast("list[RequestSlot]", [r.payload for r in batch.requests]),
            )
            calls.append(([message], {}))
            plain = plain and all(finite(slot.get("links")) for slot in message["requests"])
            # Flower shows argsrepr; the token ids or items it would otherwise show help nobody.
            padding = batch.padded_tokens / max(1, batch.real_tokens)
            what = f"task={task}" if task == batch.model else f"model={batch.model}"
            summaries.append(
                f"size={batch.size} bin={batch.bin_label} width={batch.padded_len} "
                f"padding={padding:.2f} flush={batch.flush_reason.value} {what}"
            )
        built = self._builder(queue).build(calls, task_ids=batch_ids, argsreprs=summaries, plain=plain)
        (queue_list, raws), *others = built.pushes.items()
        if others:
            raise RuntimeError("batch messages must all go to one list (no priorities on batches)")
        assigned = self.store.dispatch(
            queue_list,
            [
                (bid, [r.id for r in b.requests], raw)
                for bid, b, raw in zip(batch_ids, batches, raws, strict=True)
            ],
            events,
        )
        built.published()
        return batch_ids, assigned

    def _builder(self, queue: str) -> TaskMessageBuilder:
        builder = self._builders.get(queue)
        if builder is None:
            builder = self._builders[queue] = TaskMessageBuilder(
                RUN_BATCH_TASK,
                app=self.app,
                queue=queue,
                sent_events=False,
                # The header overrides run_batch's own ignore_result on the worker: nobody reads a
                # batch's result, so the backend must not store one.
                ignore_result=True,
            )
        return builder
