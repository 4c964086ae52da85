"""What one soak run does: its load, its faults and the bounds its report is judged by (plain data)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from carpool.tools.soak.model import DEFAULT_PACE, capacity_rps

FAULT_KINDS = ("coordinator", "worker", "redis")
# Fields that must be above 0 (the load a fraction of capacity, the stack's sizes, the measures' steps).
_POSITIVE = (
    "duration_s",
    "load_fraction",
    "coordinators",
    "workers",
    "max_batch",
    "lease_s",
    "result_expires_s",
    "texts",
    "window_s",
    "memory_every_s",
    "poll_s",
    "p99_factor",
    "p99_recovery_s",
    "min_window_requests",
)


@dataclass(frozen=True)
class SoakConfig:
    """A soak: ``duration_s`` of open-loop Poisson load at ``load_fraction`` of capacity, with a calm
    ``lead_in_s`` (its first ``warmup_s`` ignored) and ``tail_s``, faults in between.

    Faults come every ``interval_s`` (uniform in the range), each kind in turn in a shuffled order
    (every kind once per round), the two coordinators or workers in turn (which first: random); the
    killed process (or redis-server) is started again ``down_s`` later.
    """

    duration_s: float = 600.0
    lead_in_s: float = 60.0
    warmup_s: float = 30.0
    tail_s: float = 60.0
    interval_s: tuple[float, float] = (10.0, 60.0)
    down_s: float = 1.0
    kinds: tuple[str, ...] = FAULT_KINDS
    seed: int = 0
    # the stack
    coordinators: int = 2
    workers: int = 2
    max_batch: int = 8
    pace: tuple[float, float] = DEFAULT_PACE  # the paced toy's seconds per batch and per row
    load_fraction: float = 0.5
    lease_s: float = 5.0  # CARPOOL_RECOVERY_TIMEOUT_S
    result_expires_s: int = 60
    texts: int = 400  # distinct texts the requests cycle through (each checked against the model)
    # measuring
    window_s: float = 5.0
    memory_every_s: float = 5.0
    poll_s: float = 0.05  # how often the producer looks for results
    recheck_after_s: float = 20.0  # a result is read again this long after it was first read
    drain_timeout_s: float = 120.0
    send_give_up_s: float = 30.0  # a send retried this long while Redis is away is given up
    # judging
    p99_factor: float = 2.0  # recovered: window p99 within this factor of the calm lead-in's p99...
    p99_recovery_s: float = 30.0  # ...within this long after each fault
    min_window_requests: int = 5
    memory_ratio: float = 0.25  # flat: late median <= early median x (1 + ratio), or ...
    memory_slack_mib: float = 16.0  # ... no more than this many MiB above it
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in fields(self):  # a NaN passes every comparison below, an infinity most of them
            value = getattr(self, f.name)
            numbers = value if isinstance(value, tuple) and f.name != "kinds" else (value,)
            for number in numbers:
                if isinstance(number, int | float) and not math.isfinite(number):
                    raise ValueError(f"{f.name} must be a finite number, got {value}")
        for name in _POSITIVE:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        low, high = self.interval_s
        if not 0 < low <= high:
            raise ValueError(f"interval_s must be (low, high) with 0 < low <= high, got {self.interval_s}")
        if self.lead_in_s + self.tail_s >= self.duration_s:
            raise ValueError("lead_in_s + tail_s must leave time for faults within duration_s")
        if not 0 <= self.warmup_s < self.lead_in_s:
            raise ValueError("warmup_s must be shorter than lead_in_s: the baseline is measured after it")
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"kinds must be from {', '.join(FAULT_KINDS)}, got {self.kinds}")
        if self.tail_s < self.p99_recovery_s:
            raise ValueError("tail_s must be at least p99_recovery_s: the last fault needs time to recover")
        if self.recheck_after_s >= self.result_expires_s:
            raise ValueError(
                "recheck_after_s must be shorter than result_expires_s (the result must still be there)"
            )

    @property
    def capacity_rps(self) -> float:
        return capacity_rps(self.workers, self.max_batch, self.pace)

    @property
    def rate_rps(self) -> float:
        return self.load_fraction * self.capacity_rps

    @property
    def redis_warmup_s(self) -> float:
        """Redis holds each result for ``result_expires_s``: its memory is level only after that."""
        return max(self.warmup_s, self.result_expires_s + 2 * self.window_s)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(capacity_rps=round(self.capacity_rps, 2), rate_rps=round(self.rate_rps, 2))
        return out


def short_config(**overrides: Any) -> SoakConfig:
    """The test suite's soak: about a minute, faults every 5-10 s, finer windows and samples."""
    base: dict[str, Any] = {
        "duration_s": 70.0,
        "lead_in_s": 15.0,
        "warmup_s": 5.0,
        "tail_s": 25.0,
        "interval_s": (5.0, 10.0),
        "pace": (0.02, 0.05),
        "lease_s": 3.0,
        "result_expires_s": 20,
        "texts": 200,
        "window_s": 2.0,
        "memory_every_s": 1.0,
        "recheck_after_s": 5.0,
        "drain_timeout_s": 90.0,
        "p99_factor": 4.0,
        "p99_recovery_s": 25.0,
        "memory_ratio": 0.5,
        "memory_slack_mib": 32.0,
    }
    base.update(overrides)
    return SoakConfig(**base)
