"""What one benchmark run measured, and the workload it ran: plain data, no processes, no torch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from carpool.batching.bins import padded_length
from carpool.tools.stats import percentile

SHORT_TEXT = "The quick brown fox jumps over the lazy dog."


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean/max in milliseconds."""
    if not latencies_s:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0}
    ms = [v * 1000 for v in latencies_s]
    return {
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "mean": sum(ms) / len(ms),
        "max": max(ms),
    }


def batch_summary(sizes: Counter[int]) -> dict[str, Any]:
    count = sum(sizes.values())
    mean = sum(k * v for k, v in sizes.items()) / count if count else 0.0
    return {"count": count, "mean_size": mean, "sizes": {str(k): v for k, v in sorted(sizes.items())}}


@dataclass
class RunRecord:
    """One run of one system: a burst, an open-loop rate, or the light-load probe."""

    system: str
    mode: str  # "burst" | "rate" | "light"
    requests: int
    completed: int
    failed: int
    wall_s: float
    throughput_rps: float
    latency_ms: dict[str, float]
    offered_rps: float | None = None
    half_saturation: bool = False
    batches: dict[str, Any] | None = None
    padding_ratio: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_record(
    system: str,
    mode: str,
    latencies_s: Sequence[float],
    wall_s: float,
    failed: int = 0,
    offered_rps: float | None = None,
    sizes: Counter[int] | None = None,
    padded_tokens: int | None = None,
    real_tokens: int | None = None,
    **extra: Any,
) -> RunRecord:
    completed = len(latencies_s)
    requests = completed + failed
    return RunRecord(
        system=system,
        mode=mode,
        requests=requests,
        completed=completed,
        failed=failed,
        wall_s=wall_s,
        throughput_rps=requests / wall_s if wall_s > 0 else 0.0,
        latency_ms=latency_summary(latencies_s),
        offered_rps=offered_rps,
        batches=batch_summary(sizes) if sizes else None,
        padding_ratio=(padded_tokens / real_tokens) if padded_tokens and real_tokens else None,
        extra=dict(extra),
    )


def one_by_one_padding(lengths: Sequence[int]) -> tuple[int, int]:
    """(padded, real) tokens when every request runs alone (the plain-Celery baseline)."""
    return sum(padded_length(n) for n in lengths), sum(lengths)


def padding_of_batches(
    batches: Iterable[Sequence[str]], length_of: Mapping[str, int]
) -> tuple[Counter[int], int, int]:
    """(batch sizes, padded, real tokens) of batches given as request ids, each padded to its longest
    member rounded up to the pad multiple; ids without a known length are left out."""
    sizes: Counter[int] = Counter()
    padded = real = 0
    for ids in batches:
        lengths = [length_of[i] for i in ids if i in length_of]
        if not lengths:
            continue
        sizes[len(lengths)] += 1
        padded += padded_length(max(lengths)) * len(lengths)
        real += sum(lengths)
    return sizes, padded, real


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    if not lengths:
        return {}
    return {
        "min": float(min(lengths)),
        "p50": percentile(lengths, 50),
        "mean": sum(lengths) / len(lengths),
        "p90": percentile(lengths, 90),
        "p99": percentile(lengths, 99),
        "max": float(max(lengths)),
    }


def parse_rates(spec: str) -> list[tuple[float, bool]]:
    """``"0.5x,1x,200"`` -> [(0.5, True), (1.0, True), (200.0, False)]: x = times the offline limit."""
    out = []
    for part in spec.split(","):
        part = part.strip().lower()
        if not part:
            continue
        relative = part.endswith("x")
        value = float(part[:-1] if relative else part)
        if value <= 0:
            raise ValueError(f"rates must be positive, got {part!r}")
        out.append((value, relative))
    if not out:
        raise ValueError("no rates given")
    return out
