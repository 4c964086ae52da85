"""The batching policy: which requests ride together, and when a batch leaves.

Data flow: ``add(request)`` puts a request in its (model, bin) queue; ``poll(now_s, ...)`` returns a
:class:`Plan` with the batches to dispatch now, the requests whose deadline already passed, and the
time at which polling again could change the answer. Time is always an argument: the caller owns the
clock, so tests drive this with plain numbers.

Rules, in order of precedence for a (model, bin) queue:
1. expired: a request past its deadline is never dispatched; it comes back in ``Plan.expired``;
2. deadline: if waiting longer would miss the most urgent member's deadline, given the predicted run
   time of the batch and the work already ahead of it, the batch leaves now, even with no free slot
   (only while it can still make it: otherwise it waits for a slot like any batch, or expires);
3. full: ``max_batch`` requests, or one more would pass ``max_tokens``, leaves when a slot is free,
   or while the predicted work queued per worker is under ``prefetch_s`` (a fast device runs a
   batch in milliseconds: a count of queued batches alone leaves it waiting on the hand-off);
   a ``binned`` queue holding more than that cuts its oldest request and its nearest lengths
   (``PolicyConfig.tight_backlog``, see :mod:`carpool.batching.binqueue`);
4. wait: with a worker idle, a partial batch leaves once its oldest member waited
   ``min(max_wait_s, wait_factor * predicted run time)``, or at once when the recent arrival rate
   says fewer than one more request would arrive in that time (light traffic: waiting only adds
   latency); with no more requests on their way in (``incoming``), every partial batch ready by
   then leaves in the same poll, as far as the free slots go. With every worker busy it keeps
   filling, unless a full batch of another queue is about to take a free slot: then a partial
   batch that waited its window competes with it by priority, then by its oldest member's age
   (for an idle worker's slot, or the room beyond the slots, once it waited ``STARVING_AFTER_S``).
   Under overload no worker is ever idle, and full batches of busy bins would otherwise take every
   freed slot while a request alone in a quiet bin waited until its deadline.
Requests of different models never share a batch.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from carpool.batching.binqueue import BinQueue, Head, QueueOrder
from carpool.batching.bins import PAD_MULTIPLE, AutoBins, LengthBins, padded_width
from carpool.batching.latency import LatencyModel
from carpool.batching.types import Batch, FlushReason, Plan, Request
from carpool.names import DEFAULT_BIN_EDGES, POLICY_NAMES, PolicyName

PolicyKind = PolicyName

# Seconds of margin kept between a deadline flush and the deadline itself, for the hand-off.
DEADLINE_GUARD_S = 0.01
# A partial batch whose oldest request waited this long competes with full batches for any slot
# (see BatchPolicy._evaluate): about twenty windows at the default CARPOOL_MAX_WAIT_S.
STARVING_AFTER_S = 1.0
# Arrivals remembered per model to estimate the arrival rate.
ARRIVAL_WINDOW = 64


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    kind: PolicyKind = "binned"
    max_batch: int = 32
    max_tokens: int = 8192
    max_wait_s: float = 0.05
    wait_factor: float = 0.3
    bin_edges: tuple[int, ...] = DEFAULT_BIN_EDGES
    auto_bins: int = 0  # > 0: that many bins fitted to recent lengths, per model; edges then seed them
    pad_multiple: int = PAD_MULTIPLE
    # binned: a bin holding more than one batch cuts its oldest request's nearest widths, not the
    # oldest few, so a backlog pads about as little as a length-sorted pass
    tight_backlog: bool = True
    # full batches also leave, beyond the prefetch slots, while the predicted work queued per
    # worker is under this (0: slots only)
    prefetch_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError("max_batch must be an integer >= 1")
        if self.max_tokens < self.pad_multiple:
            raise ValueError(f"max_tokens must be >= {self.pad_multiple}")
        if self.max_wait_s < 0 or self.wait_factor < 0 or self.prefetch_s < 0:
            raise ValueError("max_wait_s, wait_factor and prefetch_s must be >= 0")
        if self.kind not in POLICY_NAMES:
            raise ValueError(f"kind must be one of {', '.join(POLICY_NAMES)}")


@dataclass(slots=True)
class _Candidate:
    key: tuple[str, str]
    requests: list[Request]
    reason: FlushReason
    rank: tuple[int, float, int, float]
    # A ready partial batch's rank against a full batch of another queue, which it may replace.
    as_full: tuple[int, float, int, float] | None = None
    # With no worker idle, it leaves only in place of a full batch it outranks.
    contender: bool = False


class BatchPolicy:
    """Forms batches from queued requests; see the module docstring for the rules."""

    def __init__(
        self,
        config: PolicyConfig,
        latency: LatencyModel | None = None,
        per_key: Mapping[str, PolicyConfig] | None = None,
    ) -> None:
        """``config`` applies to every key (a model, or a batched task) without its own in ``per_key``."""
        self.config = config
        self.per_key = dict(per_key or {})
        self.latency = latency or LatencyModel()
        self._fixed_bins: dict[str, LengthBins] = {}
        self._model_bins: dict[str, LengthBins] = {}
        # Recent arrival times per model: the arrival rate says whether waiting can gain company.
        self._arrivals: dict[str, deque[float]] = {}
        # Queues by (model, span of lengths), each with the label of the bin it stands for.
        self._queues: dict[tuple[str, str], BinQueue] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def depth_by_bin(self) -> dict[tuple[str, str], int]:
        """Requests waiting per (model, bin label)."""
        out: dict[tuple[str, str], int] = {}
        for key, queue in self._queues.items():
            labelled = (key[0], queue.label)
            out[labelled] = out.get(labelled, 0) + len(queue)
        return out

    def bin_spans(self) -> dict[tuple[str, str], str]:
        """The token lengths each automatic bin holds now, per (model, bin label); fixed edges'
        labels are their spans already."""
        return {
            (model, label): span
            for model, bins in self._model_bins.items()
            for label, span in bins.spans().items()
        }

    def config_for(self, key: str) -> PolicyConfig:
        """The limits and bins of ``key``: its own, else the policy's."""
        return self.per_key.get(key, self.config)

    def bins_for(self, model: str) -> LengthBins:
        cfg = self.config_for(model)
        if cfg.kind != "binned" or not cfg.auto_bins:
            bins = self._fixed_bins.get(model)
            if bins is None:
                bins = self._fixed_bins[model] = LengthBins(cfg.bin_edges if cfg.kind == "binned" else ())
            return bins
        bins = self._model_bins.get(model)
        if bins is None:
            bins = self._model_bins[model] = AutoBins(cfg.auto_bins, initial=cfg.bin_edges, name=model)
        return bins

    def add(self, req: Request) -> None:
        recent = self._arrivals.get(req.model)
        if recent is None:
            recent = self._arrivals[req.model] = deque(maxlen=ARRIVAL_WINDOW)
        recent.append(req.arrival_s)
        bins = self.bins_for(req.model)
        bins.observe(req.length)
        # Keyed by span, not label: after a refit, queues under old edges drain under their old key
        # (shown under the label their bin had last), never mixed with the new bin of that label.
        index = bins.index(req.length)
        key = (req.model, bins.span(index))
        queue = self._queues.get(key)
        if queue is None:
            cfg = self.config_for(req.model)
            queue = self._queues[key] = BinQueue(_queue_order(cfg), cfg.pad_multiple, bins.label(index))
        elif isinstance(bins, AutoBins):  # a refit may have given this span another index
            queue.label = bins.label(index)
        queue.add(req)

    def expected_arrivals(self, model: str, now_s: float, within_s: float) -> float:
        """How many more requests for ``model`` to expect in the next ``within_s`` seconds."""
        recent = self._arrivals.get(model)
        if not recent:
            return 0.0
        # The long-window rate remembers a burst for a while; arrivals in the last `within_s` catch
        # the start of one at once (the newest arrival is the one asking, so it does not count).
        span = max(now_s - recent[0], 1e-6)
        just_now = sum(1 for t in itertools.takewhile(lambda t: t >= now_s - within_s, reversed(recent)))
        return max(len(recent) / span * within_s, just_now - 1.0)

    def predict_s(self, model: str, requests: list[Request]) -> float:
        width = padded_width((r.length for r in requests), self.config_for(model).pad_multiple)
        return self.latency.predict(model, len(requests) * width)

    def poll(
        self,
        now_s: float,
        free_workers: int,
        free_slots: int,
        ahead_s: float = 0.0,
        queue_room: int = 0,
        incoming: bool = False,
        workers: int = 1,
    ) -> Plan:
        """Decide what leaves now.

        ``free_workers``: workers with nothing to run; ``free_slots``: batches that may still be
        handed on (free workers plus prefetch room); ``ahead_s``: predicted seconds until a worker
        frees up for a newly dispatched batch (0 when one is idle): the work queued per worker;
        ``queue_room``: batches that may still be queued beyond the slots while ``ahead_s`` is
        under ``prefetch_s``; ``incoming``: requests are already on their way in (taken and being
        prepared, or more waiting in the broker), so a partial batch may still find company among
        them; ``workers``: how many share the work queued (each batch dispatched here adds its
        predicted run time over them to ``ahead_s``).
        """
        # Queues left empty (a refit moved their bin, or they drained) are dropped.
        self._drop_empty()
        # With nothing on its way in, the partial batches that waited their share leave together
        # while a worker was idle at the start: one at a time, each would wait for the next idle
        # moment, a hand-off each time (the tail of a burst). Else one leaves per idle worker.
        idle_at_start = free_workers > 0
        plan = Plan(expired=self.expire(now_s))
        wake: float | None = None
        # A queue's head batch changes only when its membership does, so each queue remembers its head
        # and a poll re-selects only the queues that changed, not every queue after every batch.
        while True:
            best: _Candidate | None = None
            contender: _Candidate | None = None  # the ready partial batch that ranks first as a full one
            contender_rank = (0, 0.0, 0, 0.0)
            worker_idle = free_workers > 0 or (idle_at_start and not incoming)
            for key, queue in self._queues.items():
                if not queue:
                    continue
                head = queue.head(self.config_for(key[0]))
                cand, wake_at = self._evaluate(
                    key,
                    queue,
                    head,
                    now_s,
                    worker_idle,
                    free_slots,
                    ahead_s,
                    queue_room,
                )
                if wake_at is not None and (wake is None or wake_at < wake):
                    wake = wake_at
                if cand is None:
                    continue
                if cand.as_full is not None and (contender is None or cand.as_full < contender_rank):
                    contender, contender_rank = cand, cand.as_full
                if not cand.contender and (best is None or cand.rank < best.rank):
                    best = cand
            if best is None:
                break
            if contender is not None and best.reason is FlushReason.FULL and contender_rank < best.rank:
                best = contender
            wake = None  # recomputed on the next pass over the queues
            queue = self._queues[best.key]
            queue.remove(best.requests)
            plan.batches.append(
                Batch(
                    model=best.key[0],
                    bin_label=queue.label,
                    requests=tuple(best.requests),
                    padded_len=padded_width(
                        (r.length for r in best.requests), self.config_for(best.key[0]).pad_multiple
                    ),
                    flush_reason=FlushReason.ALONE if best.requests[0].alone else best.reason,
                )
            )
            free_slots -= 1
            free_workers -= 1
            queue_room -= 1
            if free_workers < 0:
                # The new batch queues behind running ones: later deadline checks must count it,
                # as the work queued per worker that ``ahead_s`` is.
                ahead_s += self.predict_s(best.key[0], best.requests) / max(1, workers)
        plan.wake_at_s = wake
        return plan

    def quiet_until(
        self, now_s: float, free_slots: int, ahead_s: float = 0.0, queue_room: int = 0
    ) -> float | None:
        """Whether a :meth:`poll` with these capacities could let nothing leave, told without
        selecting any queue's next batch: no slot a batch may take (``free_slots``, or
        ``queue_room`` while ``ahead_s`` is under a key's ``prefetch_s``), and no queue whose
        deadline flush or expiry could be due, with its next batch's run time bounded from above
        (:meth:`BinQueue.head_tokens_bound`). Then returns a time at or before the wake time that
        poll would answer, to ask again then; else None: poll. A saturated coordinator asks after
        each chunk of requests it admits, when every slot is taken."""
        if free_slots > 0:
            return None
        quiet: float | None = None
        for (model, _), queue in self._queues.items():
            if not queue:
                continue
            cfg = self.config_for(model)
            if queue_room > 0 and ahead_s < cfg.prefetch_s and self.latency.observed(model):
                return None
            longest_s = self.latency.predict(model, queue.head_tokens_bound(cfg))
            urgent_from = queue.earliest_deadline() - ahead_s - longest_s - DEADLINE_GUARD_S
            if urgent_from <= now_s:
                return None
            if quiet is None or urgent_from < quiet:
                quiet = urgent_from
        return quiet

    def discard(self, ids: Collection[str]) -> list[Request]:
        """Remove and return the queued requests whose id is in ``ids`` (they were revoked)."""
        out: list[Request] = []
        for queue in self._queues.values():
            gone = [queue.live[i] for i in ids if i in queue.live]
            if gone:
                queue.remove(gone)
                out += gone
        return out

    def expire(self, now_s: float) -> list[Request]:
        """Remove and return the requests whose deadline has passed."""
        out: list[Request] = []
        for queue in self._queues.values():
            if queue:
                out.extend(queue.pop_expired(now_s))
        return out

    def next_deadline(self) -> float | None:
        deadlines = [q.earliest_deadline() for q in self._queues.values() if q]
        return min(deadlines) if deadlines else None

    def _evaluate(
        self,
        key: tuple[str, str],
        queue: BinQueue,
        head: Head,
        now_s: float,
        worker_idle: bool,
        free_slots: int,
        ahead_s: float,
        queue_room: int = 0,
    ) -> tuple[_Candidate | None, float | None]:
        model = key[0]
        cfg = self.config_for(model)
        members, limited, padded_tokens = head
        predicted = self.latency.predict(model, padded_tokens)
        deadline = queue.earliest_deadline()
        urgent_at = deadline - ahead_s - predicted - DEADLINE_GUARD_S
        oldest = queue.oldest_arrival()
        priority = members[0].priority  # served order puts the highest priority first
        # A deadline flush bypasses the slot limit, so only while it can plausibly make it: a batch
        # that would finish late anyway is not worth pushing into a queue of busy workers (under
        # overload that floods the batch queue with doomed work); it waits for a slot or expires here.
        # "Plausibly": work ahead is an estimate, so half of it is allowed to melt away.
        if urgent_at <= now_s < deadline - predicted - ahead_s / 2:
            # Put the members about to miss their deadline in first, then fill up.
            first = list(queue.urgent(now_s + ahead_s + predicted + DEADLINE_GUARD_S))
            reqs, _ = queue.select(cfg, first=first)
            return _Candidate(key, reqs, FlushReason.DEADLINE, (0, urgent_at, -priority, oldest)), None
        # Past the point where a deadline flush helps, the next event for this queue is its expiry.
        next_deadline_event = urgent_at if now_s < urgent_at else deadline
        # The room beyond the slots is measured in predicted time, so only once this key's run time
        # was observed: the prior's guess could commit a whole backlog to the batch queue, where no
        # deadline flush or expiry reaches it.
        may_take = free_slots > 0 or (
            queue_room > 0 and ahead_s < cfg.prefetch_s and self.latency.observed(model)
        )
        if limited:
            if may_take:
                return _Candidate(key, members, FlushReason.FULL, (1, 0.0, -priority, oldest)), None
            return None, next_deadline_event
        # Against a full batch of another queue, a partial batch ranks as a full one does: under
        # overload full batches would otherwise take every slot. A free prefetch slot with no worker
        # idle it may take so once it waited its window; a slot that is an idle worker, or the room
        # beyond the slots, only once it waited STARVING_AFTER_S: those are what a burst's full
        # batches fill, and partial batches taking them earlier cut a burst into more, smaller
        # batches (docs/PERFORMANCE.md, "2026-12-05, later").
        as_full = (1, 0.0, -priority, oldest)
        starving = now_s - oldest >= STARVING_AFTER_S
        if worker_idle and free_slots > 0:
            wait_s = min(cfg.max_wait_s, cfg.wait_factor * predicted)
            if self.expected_arrivals(model, now_s, wait_s) < 1.0:
                wait_s = 0.0  # light traffic: no company is coming, waiting would only add latency
            ready_at = oldest + wait_s
            if now_s >= ready_at:
                rank = (2, 0.0, -priority, oldest)
                return _Candidate(key, members, FlushReason.WAIT, rank, as_full if starving else None), None
            return None, min(ready_at, next_deadline_event)
        # With no worker idle it leaves only in place of a full batch it outranks (traffic is heavy
        # then: the full window, without the arrival rate's shortcut).
        ready = now_s >= oldest + min(cfg.max_wait_s, cfg.wait_factor * predicted)
        if ready and (free_slots > 0 or (may_take and starving)):
            return _Candidate(
                key, members, FlushReason.WAIT, as_full, as_full, contender=True
            ), next_deadline_event
        return None, next_deadline_event

    def drain(self) -> list[Request]:
        """Remove and return every queued request (shutdown hands them back to the broker)."""
        out: list[Request] = []
        for queue in self._queues.values():
            out.extend(queue.drain())
        self._drop_empty()
        return out

    def _drop_empty(self) -> None:
        self._queues = {k: q for k, q in self._queues.items() if q}


def _queue_order(cfg: PolicyConfig) -> QueueOrder:
    if cfg.kind == "shortest":
        return "length"
    return "tight" if cfg.kind == "binned" and cfg.tight_backlog else "arrival"
