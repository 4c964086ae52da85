"""CPU of each component over a run, beside the device's busy fraction: which part held the device
back, and when.

CPU per request over a whole run says what each process costs; it does not say why the device sat
idle at some moment. A :class:`CpuSampler` reads each process's CPU seconds every few milliseconds
while the run goes on; :func:`cores_per_bucket` turns the samples into cores used per bucket of the
device's busy series, and :func:`starved_and_saturated` compares the buckets where the device waited
with those where it was the bottleneck (with the machine's cores all busy while the device waits,
only less CPU per request helps; with cores to spare, the pipeline's order or hand-offs do).

Readings come from /proc in clock ticks (10 ms on Linux), so one bucket of 50 ms is good to about
0.2 cores; the means over many buckets are what to read. The sampler thread runs in the bench's
own process, which is also the producer: reading a handful of /proc files every 10 ms adds well
under 1% of a core to the producer's figure.
"""

from __future__ import annotations

import contextlib
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from carpool.tools.bench.procstat import process_cpu_s

Sample = tuple[float, dict[str, float]]  # (wall-clock time, {component: CPU seconds so far})
STARVED_BELOW = 0.5  # a bucket where the device was busy less than this share of the time waited
SATURATED_FROM = 0.9  # ... and one busy at least this much was the bottleneck


class CpuSampler:
    """Reads the CPU seconds of ``pids`` (component -> process ids, summed) every ``interval_s`` on
    a thread, from ``start()`` until ``stop()``; a process that is gone stops counting."""

    def __init__(
        self,
        pids: Mapping[str, Sequence[int]],
        interval_s: float = 0.01,
        read: Callable[[int], float] = process_cpu_s,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pids = {name: tuple(ids) for name, ids in pids.items()}
        self.interval_s = interval_s
        self.read = read
        self.clock = clock
        self.samples: list[Sample] = []
        self.own_cpu_s = 0.0  # the sampling thread's own CPU: the bench's, not the process's it reads
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def start(self) -> CpuSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.samples

    def sample(self) -> None:
        reading: dict[str, float] = {}
        for name, ids in self.pids.items():
            total = 0.0
            for pid in ids:
                # A process gone keeps its last reading: it adds nothing from there on.
                with contextlib.suppress(OSError):
                    self._last[pid] = self.read(pid)
                total += self._last.get(pid, 0.0)
            reading[name] = total
        self.samples.append((self.clock(), reading))

    def _run(self) -> None:
        started = time.thread_time()
        while not self._stop.wait(self.interval_s):
            self.sample()
        self.own_cpu_s = time.thread_time() - started


def cores_per_bucket(
    samples: Sequence[Sample], start: float, end: float, bucket_s: float
) -> dict[str, list[float]]:
    """Cores each component used in each bucket of ``bucket_s`` from ``start`` to ``end`` (the last
    bucket may be shorter), its CPU seconds read at the bucket's edges by linear interpolation
    between samples. Buckets outside the samples count nothing."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be > 0")
    if end <= start or len(samples) < 2:
        return {name: [] for name in (samples[0][1] if samples else {})}
    count = max(1, -int(-(end - start) // bucket_s))
    edges = [min(end, start + i * bucket_s) for i in range(count + 1)]
    times = [t for t, _ in samples]
    out: dict[str, list[float]] = {}
    for name in samples[0][1]:
        at = [_interpolate(times, samples, name, edge) for edge in edges]
        out[name] = [
            round(max(0.0, (at[i + 1] - at[i]) / (edges[i + 1] - edges[i])), 3)
            if edges[i + 1] > edges[i]
            else 0.0
            for i in range(count)
        ]
    return out


def _interpolate(times: Sequence[float], samples: Sequence[Sample], name: str, at: float) -> float:
    i = bisect_left(times, at)
    if i <= 0:
        return samples[0][1][name]
    if i >= len(samples):
        return samples[-1][1][name]
    (t0, v0), (t1, v1) = (times[i - 1], samples[i - 1][1][name]), (times[i], samples[i][1][name])
    return v0 if t1 <= t0 else v0 + (v1 - v0) * (at - t0) / (t1 - t0)


def starved_and_saturated(
    cores: Mapping[str, Sequence[float]], device_busy: Sequence[float]
) -> dict[str, dict[str, Any]]:
    """Mean cores per component (and in all) over the buckets where the device waited (busy under
    :data:`STARVED_BELOW`) and where it was saturated (at least :data:`SATURATED_FROM`)."""

    def over(picked: list[int]) -> dict[str, Any]:
        if not picked:
            return {"buckets": 0, "total_cores": None, "cores": {}}
        means = {
            name: round(sum(series[i] for i in picked) / len(picked), 3) for name, series in cores.items()
        }
        return {"buckets": len(picked), "total_cores": round(sum(means.values()), 3), "cores": means}

    count = min([len(device_busy), *(len(series) for series in cores.values())])
    return {
        "device_waiting": over([i for i in range(count) if device_busy[i] < STARVED_BELOW]),
        "device_saturated": over([i for i in range(count) if device_busy[i] >= SATURATED_FROM]),
    }
