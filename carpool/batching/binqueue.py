"""The requests of one (model, bin), in the order the policy serves them, and how a batch is cut.

Three orders, one per policy behaviour:

- ``arrival``: highest priority first, then first come first served (``fifo``, and ``binned`` with
  ``tight_backlog`` off);
- ``length``: highest priority first, then shortest first (``shortest``);
- ``tight``: as ``arrival`` while the whole queue fits in one batch; once it holds more, a batch is
  its oldest request (or the members about to miss their deadline) plus the requests nearest to it
  in padded width, so a deep backlog comes out nearly as tight as a length-sorted pass while the
  oldest request still leaves with every batch (no request waits behind an endless stream of others).
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal, NamedTuple

from carpool.batching.bins import padded_length, padded_width
from carpool.batching.types import Request

if TYPE_CHECKING:
    from carpool.batching.policy import PolicyConfig

QueueOrder = Literal["arrival", "length", "tight"]

# A lane: the requests of one (priority, padded width), in arrival order.
_Lane = deque[Request]


class Head(NamedTuple):
    """A queue's next batch: its members, whether it is full (it holds ``max_batch``, or one more
    request would pass ``max_tokens``: it leaves as FULL), and its padded tokens (members x padded
    width), which the policy's run-time prediction reads."""

    members: list[Request]
    limited: bool
    padded_tokens: int


class BinQueue:
    """Requests of one (model, bin) and the next batch to cut from them.

    Removal is lazy: a request leaves ``live`` at once and its stale entries elsewhere are skipped
    later, so cutting a batch costs O(batch log n), not O(n).
    """

    def __init__(self, order: QueueOrder, pad_multiple: int, label: str = "") -> None:
        self.order = order
        self.label = label  # the bin it stands for, as batches, metrics and status name it
        self._tight = order == "tight"
        self.pad_multiple = pad_multiple
        self.live: dict[str, Request] = {}  # in arrival order: dicts keep insertion order
        # served order: (-priority, length, arrival, seq)
        self._by_length: list[tuple[int, int, float, int, Request]] = []
        self._fifo: dict[int, deque[Request]] = {}  # priority -> arrival order
        self._lanes: dict[int, dict[int, _Lane]] = {}  # priority -> padded width -> arrival order
        self._deadlines: list[tuple[float, int, Request]] = []
        self._arrivals: deque[Request] = deque()
        self._seq = itertools.count()
        # The head batch as select() last chose it, valid until the membership changes (add, remove,
        # expiry): a saturated coordinator polls once per freed slot and must not re-select each time.
        self._head: Head | None = None
        self._widest = 0  # the widest padded length added since the last drain: no batch is wider
        # Requests that run alone (Request.alone), in arrival order: each leaves next, in a batch of
        # its own, ahead of the queue's own order (it came back from a worker that died holding it:
        # it has waited already, and no order may leave it behind for ever).
        self._alone: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self.live)

    def add(self, req: Request) -> None:
        seq = next(self._seq)
        self.live[req.id] = req
        self._head = None
        width = -(-req.length // self.pad_multiple) * self.pad_multiple  # padded_length, inlined
        if width > self._widest:
            self._widest = width
        elif not self._widest:
            self._widest = self.pad_multiple  # padded_length's floor: one multiple, for length 0
        if self._tight:
            lanes = self._lanes.get(req.priority)
            if lanes is None:
                lanes = self._lanes[req.priority] = {}
            lane = lanes.get(width)
            if lane is None:
                lane = lanes[width] = deque()
            lane.append(req)
        elif self.order == "length":
            heapq.heappush(self._by_length, (-req.priority, req.length, req.arrival_s, seq, req))
        else:
            self._fifo.setdefault(req.priority, deque()).append(req)
        heapq.heappush(self._deadlines, (req.deadline_s, seq, req))
        self._arrivals.append(req)
        if req.alone:
            self._alone.append(req)

    def _alive(self, req: Request) -> bool:
        return self.live.get(req.id) is req

    def oldest_arrival(self) -> float:
        while self._arrivals and not self._alive(self._arrivals[0]):
            self._arrivals.popleft()
        return self._arrivals[0].arrival_s

    def earliest_deadline(self) -> float:
        while not self._alive(self._deadlines[0][2]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0]

    def pop_expired(self, now_s: float) -> list[Request]:
        out = []
        while self.live and self.earliest_deadline() <= now_s:
            req = heapq.heappop(self._deadlines)[2]
            del self.live[req.id]
            out.append(req)
        if out:
            self._head = None
        return out

    def urgent(self, until_s: float) -> Iterator[Request]:
        """Live requests whose deadline is at or before ``until_s``, earliest first."""
        for deadline, _, req in sorted(self._deadlines):
            if deadline > until_s:
                return
            if self._alive(req):
                yield req

    def head(self, cfg: PolicyConfig) -> Head:
        """``select(cfg)`` and its padded tokens, remembered until the queue's membership changes."""
        if self._head is None:
            members, limited = self.select(cfg)
            width = padded_width((req.length for req in members), cfg.pad_multiple)
            self._head = Head(members, limited, len(members) * width)
        return self._head

    def head_tokens_bound(self, cfg: PolicyConfig) -> int:
        """The head batch's padded tokens when it is known, else a number no smaller, without
        selecting it: at most ``max_batch`` members (and no more than the queue holds), none wider
        than the widest ever added, and no more than ``max_tokens`` unless it is a lone request."""
        if self._head is not None:
            return self._head.padded_tokens
        widest = self._widest
        return min(min(len(self.live), cfg.max_batch) * widest, max(cfg.max_tokens, widest))

    def select(self, cfg: PolicyConfig, first: Iterable[Request] = ()) -> tuple[list[Request], bool]:
        """The next batch (not removed), ``first`` in it before anything else, and whether it is full
        (it holds ``max_batch``, or one more request would pass ``max_tokens``)."""
        alone = self._alone
        while alone and not self._alive(alone[0]):
            alone.popleft()
        if alone:
            # Unless a request that is not alone is the most urgent (a deadline flush puts it first).
            first = list(first)
            lone = (first[0] if first[0].alone else None) if first else alone[0]
            if lone is not None:
                return [lone], True
        batch = _Batch(cfg)
        if self.order == "tight":
            return self._select_tight(batch, first)
        for req in itertools.chain(first, self._served(cfg.max_batch)):
            if not batch.add(req):
                return batch.members, True
        return batch.members, len(batch.members) >= cfg.max_batch

    def _served(self, limit: int) -> Iterator[Request]:
        """Live requests in service order, at most ``limit``, without removing them."""
        if self.order == "length":
            # Pop stale heads, then read the heap in order past whatever stale entries lie among the
            # smallest (revoked or expired requests), however many: a batch is cut short only by
            # running out of live requests.
            while self._by_length and not self._alive(self._by_length[0][4]):
                heapq.heappop(self._by_length)
            served: set[str] = set()  # a request put back (a failed publish) has two live entries
            for entry in _in_heap_order(self._by_length):
                req = entry[4]
                if req.id in served or not self._alive(req):
                    continue
                served.add(req.id)
                yield req
                if len(served) >= limit:
                    return
            return
        count = 0
        for prio in sorted(self._fifo, reverse=True):
            q = self._fifo[prio]
            while q and not self._alive(q[0]):
                q.popleft()
            for req in q:
                if count >= limit:
                    return
                if self._alive(req):
                    count += 1
                    yield req

    def _select_tight(self, batch: _Batch, first: Iterable[Request]) -> tuple[list[Request], bool]:
        cfg = batch.cfg
        for req in first:
            if not batch.add(req):
                return batch.members, True
        if len(self.live) <= cfg.max_batch:
            # Everything may fit: then it is one batch whatever the order, served as ``arrival`` does.
            rest = sorted(self.live.values(), key=lambda r: -r.priority)
            if not batch.members:
                # The count cannot bind here, and count x widest only grows as members join: adding
                # them one by one succeeds for all exactly when the last add's check (the whole count
                # x the widest) passes. A lone request fits even past max_tokens (it can run nowhere
                # else).
                width = padded_width((req.length for req in rest), cfg.pad_multiple)
                if len(rest) <= 1 or len(rest) * width <= cfg.max_tokens:
                    return rest, len(rest) >= cfg.max_batch
            elif all(batch.add(req) for req in rest):
                return batch.members, len(batch.members) >= cfg.max_batch
            batch = _Batch(cfg)
            for req in first:
                batch.add(req)
        if not batch.members:
            batch.add(self._oldest())
        # Then the nearest widths: those no wider than the batch already is cost no extra padding
        # for anyone (the widest of them first, as it wastes least), wider ones raise everyone's.
        for prio in sorted(self._lanes, reverse=True):
            lanes = self._clean_lanes(prio)
            widths = sorted(lanes)
            cut = bisect_right(widths, batch.width)
            for width in itertools.chain(reversed(widths[:cut]), widths[cut:]):
                for req in lanes[width]:
                    if self._alive(req) and not batch.add(req):
                        return batch.members, True
        return batch.members, len(batch.members) < len(self.live)

    def _clean_lanes(self, prio: int) -> dict[int, _Lane]:
        """The lanes of ``prio`` with stale heads dropped and empty lanes removed."""
        lanes = self._lanes[prio]
        for width in list(lanes):
            lane = lanes[width]
            while lane and not self._alive(lane[0]):
                lane.popleft()
            if not lane:
                del lanes[width]
        return lanes

    def _oldest(self) -> Request:
        """The request that arrived first among the highest priority present (ties: any of them)."""
        for prio in sorted(self._lanes, reverse=True):
            lanes = self._clean_lanes(prio)
            if lanes:
                return min((lane[0] for lane in lanes.values()), key=lambda req: req.arrival_s)
            del self._lanes[prio]
        raise LookupError("the queue is empty")

    def remove(self, reqs: Iterable[Request]) -> None:
        self._head = None
        for req in reqs:
            del self.live[req.id]

    def drain(self) -> list[Request]:
        out = list(self.live.values())
        self._head = None
        self._widest = 0
        self.live.clear()
        self._by_length.clear()
        self._fifo.clear()
        self._lanes.clear()
        self._deadlines.clear()
        self._arrivals.clear()
        self._alone.clear()
        return out


def _in_heap_order(
    heap: list[tuple[int, int, float, int, Request]],
) -> Iterator[tuple[int, int, float, int, Request]]:
    """``heap``'s entries smallest first, without changing it: O(log k) per entry read, for the k
    read so far (a frontier of the entries whose parents were read)."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        entry, at = heapq.heappop(frontier)
        yield entry
        for child in (2 * at + 1, 2 * at + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))


class _Batch:
    """A batch being filled under ``max_batch`` and ``max_tokens`` (count x padded longest)."""

    __slots__ = ("cfg", "members", "seen", "width")

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.members: list[Request] = []
        self.seen: set[str] = set()
        self.width = 0  # padded length of the longest member

    def add(self, req: Request) -> bool:
        """Add ``req`` unless already in; False (and nothing added) when a limit cuts the batch here.

        A lone request over ``max_tokens`` still fills a batch of one: it can run nowhere else. A
        request that runs alone (:attr:`Request.alone`; :meth:`BinQueue.select` gives it a batch of
        its own) is passed over (True, nothing added), so that the batch goes on filling.
        """
        if req.id in self.seen:
            return True
        if len(self.members) >= self.cfg.max_batch:
            return False
        if req.alone and self.members:
            return True
        width = max(self.width, padded_length(req.length, self.cfg.pad_multiple))
        if self.members and (len(self.members) + 1) * width > self.cfg.max_tokens:
            return False
        self.members.append(req)
        self.seen.add(req.id)
        self.width = width
        return True
