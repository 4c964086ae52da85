"""A simulated device's side of ``carpool bench --accelerator``: plain numbers, no processes.

- :func:`device_capacity`: what the device alone does with a workload, length-sorted batches timed
  by the same ``a_s + b_s * padded tokens`` rule the simulated model sleeps for (the ceiling);
- :func:`read_device_log`: the batches it actually ran (``CARPOOL_SIM_DEVICE_LOG``);
- :func:`busy_fractions` / :func:`busy_summary`: how much of each moment it was busy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.batching.bins import PAD_MULTIPLE, padded_length
from carpool.tools.stats import percentile

# Bucket widths the busy-fraction series picks from: round numbers a reader can take in at a glance.
_BUCKETS_S = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class Forward:
    """One batch on the device: which process ran it, when (wall-clock seconds), its padded shape."""

    pid: int
    start: float
    end: float
    rows: int
    width: int


def device_capacity(
    lengths: Sequence[int],
    a_s: float,
    b_s: float,
    max_batch: int,
    pad_multiple: int = PAD_MULTIPLE,
    devices: int = 1,
) -> dict[str, float]:
    """The device alone on ``lengths`` (token counts): sorted by length, cut into batches of
    ``max_batch``, each padded to its longest rounded up to ``pad_multiple`` as a worker pads, each
    taking ``a_s + b_s * padded tokens``. Throughput in texts/s (of ``devices`` such devices, each
    worker process simulating one of its own), and what it added up to (``device_s``: one device's
    time for them all)."""
    if max_batch < 1:
        raise ValueError("max_batch must be an integer >= 1")
    ordered = sorted(lengths)
    device_s = 0.0
    padded = batches = 0
    for first in range(0, len(ordered), max_batch):
        chunk = ordered[first : first + max_batch]
        tokens = padded_length(chunk[-1], pad_multiple) * len(chunk)
        device_s += a_s + b_s * tokens
        padded += tokens
        batches += 1
    real = sum(ordered)
    return {
        "texts_per_s": devices * len(ordered) / device_s if device_s > 0 else 0.0,
        "devices": devices,
        "device_s": device_s,
        "batches": batches,
        "padded_tokens": padded,
        "real_tokens": real,
        "padding_ratio": padded / real if real else 0.0,
    }


def nominal_device_s(forwards: Iterable[Forward], a_s: float, b_s: float) -> float:
    """The device time of ``forwards`` by the device's time rule: what its log's intervals add up to
    (the simulated device logs each batch's place on its timeline, not when a sleep woke)."""
    return sum(a_s + b_s * f.rows * f.width for f in forwards)


def read_device_log(path: Path) -> list[Forward]:
    """The batches in a ``CARPOOL_SIM_DEVICE_LOG`` file, oldest first; a line cut short by a process
    that died mid-write is skipped."""
    out: list[Forward] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 5:
            continue
        try:
            out.append(Forward(int(parts[0]), float(parts[1]), float(parts[2]), int(parts[3]), int(parts[4])))
        except ValueError:
            continue
    out.sort(key=lambda f: f.start)
    return out


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping intervals covering the same time as ``intervals``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def pick_bucket_s(window_s: float, buckets: int = 60) -> float:
    """The first round bucket width that cuts ``window_s`` into at most about ``buckets`` pieces."""
    for width in _BUCKETS_S:
        if window_s / width <= buckets:
            return width
    return _BUCKETS_S[-1]


def busy_fractions(
    forwards: Sequence[Forward], start: float, end: float, bucket_s: float, devices: int = 1
) -> list[float]:
    """Per bucket of ``bucket_s`` from ``start`` to ``end``: the share of it the devices were busy.

    Each process that logged batches is one device, and ``devices`` says how many there were in all
    (one that never ran a batch logs nothing, yet counts as idle); a bucket's fraction is the
    devices' busy time in it over (devices x its length), so it stays within [0, 1] with several
    workers. The last bucket may be shorter than ``bucket_s``.
    """
    if bucket_s <= 0:
        raise ValueError("bucket_s must be > 0")
    if end <= start:
        return []
    count = max(1, -int(-(end - start) // bucket_s))
    busy = [0.0] * count
    by_device: dict[int, list[tuple[float, float]]] = {}
    for f in forwards:
        by_device.setdefault(f.pid, []).append((f.start, f.end))
    for intervals in by_device.values():
        for s, e in merge_intervals(intervals):
            s, e = max(s, start), min(e, end)
            index = int((s - start) // bucket_s)
            while s < e and index < count:
                edge = min(e, start + (index + 1) * bucket_s)
                busy[index] += edge - s
                s, index = edge, index + 1
    devices = max(1, devices, len(by_device))
    lengths = [min(bucket_s, end - start - i * bucket_s) for i in range(count)]
    return [
        min(1.0, b / (devices * length)) if length > 0 else 0.0
        for b, length in zip(busy, lengths, strict=True)
    ]


def busy_summary(
    forwards: Sequence[Forward], start: float, end: float, bucket_s: float | None = None, devices: int = 1
) -> dict[str, Any]:
    """The devices' busy fraction over a run from ``start`` to ``end`` (wall-clock seconds):
    overall, while they had work (first batch's start to last batch's end), and per bucket;
    ``devices``: how many ran (the workers), whether or not each logged a batch."""
    window = [f for f in forwards if f.end > start and f.start < end]
    span = max(0.0, end - start)
    width = bucket_s or pick_bucket_s(span)
    devices = max(devices, len({f.pid for f in window}), 1)
    series = busy_fractions(window, start, end, width, devices)
    out: dict[str, Any] = {
        "bucket_s": width,
        "window_s": span,
        "devices": devices,
        "forwards": len(window),
        "overall": busy_fractions(window, start, end, span, devices)[0] if span > 0 else 0.0,
        "while_working": None,
        "first_start_s": None,
        "last_end_s": None,
        "buckets": [round(v, 4) for v in series],
        "buckets_p10_p50_p90": None,
    }
    if window:
        first = max(start, window[0].start)
        last = min(end, max(f.end for f in window))
        out["first_start_s"] = first - start
        out["last_end_s"] = last - start
        if last > first:
            out["while_working"] = busy_fractions(window, first, last, last - first, devices)[0]
        inside = [
            v for i, v in enumerate(series) if start + i * width >= first and start + (i + 1) * width <= last
        ]
        if inside:
            out["buckets_p10_p50_p90"] = [percentile(inside, q) for q in (10, 50, 90)]
    return out
