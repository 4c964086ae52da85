"""The policy's plan carried out: expired requests failed, batches published and recorded as outstanding."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from carpool.batching import Batch, Plan, Request
from carpool.batching.capacity import Capacity, pool_capacity
from carpool.codec import kombu_json
from carpool.coordinator.answers import answer_expired, fail_held
from carpool.errors import ModelError, described

if TYPE_CHECKING:
    from carpool.coordinator.loop import Coordinator

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OutstandingBatch:
    """A batch dispatched and not yet reported: its requests, predicted run time and dispatch time."""

    ids: list[str]
    model: str
    predicted_s: float
    dispatched_s: float


def dispatch(c: Coordinator, now: float) -> float | None:
    """Carry out the policy's plan for ``now``; returns when the plan wants asking again."""
    if c.workers == 0:
        # Nobody could run a batch: hold everything (a deadline flush would only expire in the
        # batch queue) and fail what expires here.
        plan = Plan(expired=c.policy.expire(now), wake_at_s=c.policy.next_deadline())
    else:
        cap = _capacity(c)
        quiet = c.policy.quiet_until(now, cap.free_slots, cap.ahead_s, cap.queue_room)
        if quiet is not None:  # nothing could leave: the same empty plan, without selecting batches
            plan = Plan(wake_at_s=quiet)
        else:
            plan = c.policy.poll(
                now,
                cap.free_workers,
                cap.free_slots,
                cap.ahead_s,
                cap.queue_room,
                incoming=c.incoming,
                workers=c.workers,
            )
    if plan.expired:
        answer_expired(c, plan.expired, now)
    if plan.batches:
        _publish(c, plan.batches, now)
    return plan.wake_at_s


def _capacity(c: Coordinator) -> Capacity:
    return pool_capacity(
        c.workers, c.settings.prefetch_batches, (o.predicted_s for o in c.outstanding.values())
    )


def _publish(c: Coordinator, batches: list[Batch], now: float) -> None:
    """Hand ``batches`` on (:mod:`carpool.coordinator.publish`), a batch queue's group at a time; a
    group Redis did not take, and the groups after it, go back into the policy, still held and
    leased by us, to leave with a later plan."""
    wall_now = c.wall()
    groups = list(c.publisher.by_queue(batches).items())
    for index, (queue, group) in enumerate(groups):
        try:
            batch_ids, assigned = c.publisher.publish(queue, group, wall_now, c.events.take())
        except Exception as exc:
            # This group and those after it, already cut from the policy, go back into it: left out,
            # their requests would stay held, their leases renewed, and never run.
            unsent = [req for _, later in groups[index:] for batch in later for req in batch.requests]
            # ...but for a request whose message cannot be written (a custom model's encode() that
            # returned numpy ids, say): it would fail every plan it rode in, and the rest with it.
            unwritable = [r for r in unsent if not kombu_json(r.payload)] if _encoding(exc) else []
            if unwritable:
                _fail_unwritable(c, unwritable, exc)
            failed = {r.id for r in unwritable}
            for req in unsent:
                if req.id not in failed:
                    c.policy.add(req)
            c.pacer.changed()
            if unwritable:
                return
            raise
        for batch_id, batch in zip(batch_ids, group, strict=True):
            _dispatched(c, batch_id, batch, now)
        # Requests reaped while this coordinator stalled past their leases were taken again, and
        # are dispatched by whoever took them: counted there, not twice.
        stale = sum(batch.size for batch in group) - assigned
        if stale > 0:
            c.stats.dispatched -= stale
            log.info("%d requests of these batches had been reaped meanwhile; the worker skips them", stale)


def _encoding(exc: BaseException) -> bool:
    """Whether ``exc`` is a message that could not be written as JSON, not a Redis failure."""
    from kombu.exceptions import EncodeError

    return isinstance(exc, EncodeError | TypeError | ValueError)


def _fail_unwritable(c: Coordinator, requests: list[Request], exc: BaseException) -> None:
    error = ModelError(
        f"this request's part of its batch message could not be written as JSON ({described(exc)}):"
        " its model's encode() must give each text's token ids as a list of ints"
    )
    fail_held(c, [(r, error) for r in requests], "unwritable")


def _dispatched(c: Coordinator, batch_id: str, batch: Batch, now: float) -> None:
    ids = [r.id for r in batch.requests]
    predicted = c.latency.predict(batch.model, batch.padded_tokens)
    c.outstanding[batch_id] = OutstandingBatch(ids, batch.model, predicted, now)
    c.held.difference_update(ids)
    c.stats.batches += 1
    c.stats.dispatched += batch.size
    c.stats.padded_tokens += batch.padded_tokens
    c.stats.real_tokens += batch.real_tokens
    c.stats.flush[batch.flush_reason.value] += 1
    c.stats.sizes[batch.size] += 1
    c.metrics.batch_dispatched(
        batch.model,
        batch.bin_label,
        batch.size,
        batch.padded_tokens,
        batch.real_tokens,
        batch.flush_reason.value,
        [now - r.arrival_s for r in batch.requests],
    )
