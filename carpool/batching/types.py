"""Plain value objects the batching core works on."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FlushReason(StrEnum):
    """Why a batch left the coordinator; reported per batch in metrics and Flower."""

    FULL = "full"  # max_batch requests, or adding one more would pass max_tokens
    DEADLINE = "deadline"  # waiting longer would miss its most urgent member's deadline
    WAIT = "wait"  # a worker is free and the batch waited its adaptive share
    DRAIN = "drain"  # shutdown: hand everything on
    ALONE = "alone"  # a request a worker died running: alone, and its worker runs nothing beside it


@dataclass(slots=True, eq=False)
class Request:
    """One inference request as the policy sees it. ``payload`` rides along untouched."""

    id: str
    model: str
    length: int  # real model-input tokens, special tokens included
    arrival_s: float  # coordinator clock
    deadline_s: float  # coordinator clock; past it the request fails with DeadlineExceeded
    priority: int = 0  # higher runs first
    payload: object = None
    alone: bool = False  # runs in a batch of its own (a worker died running it in a batch)


@dataclass(frozen=True, slots=True)
class Batch:
    """A micro-batch cut by the policy: same model, one bin, within the limits."""

    model: str
    bin_label: str  # fixed edges: the token lengths the bin holds ("17-32", "129+"); automatic: "b0"...
    requests: tuple[Request, ...]
    padded_len: int  # longest member rounded up to the pad multiple
    flush_reason: FlushReason

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def padded_tokens(self) -> int:
        return self.padded_len * len(self.requests)

    @property
    def real_tokens(self) -> int:
        return sum(r.length for r in self.requests)


@dataclass(slots=True)
class Plan:
    """What the coordinator should do now, and when to ask again if nothing arrives."""

    batches: list[Batch] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)
    wake_at_s: float | None = None
