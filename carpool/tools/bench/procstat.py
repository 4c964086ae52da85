"""CPU seconds of processes and of the whole machine, read from Linux /proc.

A run takes a snapshot before and after and reports the difference per request, and how much CPU
processes outside the run took meanwhile (a shared machine slows every figure). A process's figure
covers its whole tree: its threads, its children that have exited, and every live descendant, so
work a process hands to a helper process still counts as its own.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: [0] state, [1] ppid, [11] utime..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` (all its threads, ended ones too) has used; OSError when it
    is gone or there is no /proc."""
    precise = _clock_cpu_s(pid)
    if precise is not None:
        return precise
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime


def _clock_cpu_s(pid: int) -> float | None:
    """``pid``'s CPU seconds from the kernel's CPU-time clock of that process (Linux's
    ``clock_getcpuclockid``: nanoseconds of run time, where /proc's utime and stime count 10 ms
    ticks, which is 1.7 µs per request of a 6,000-request burst); None where it cannot be read."""
    try:
        return time.clock_gettime_ns((~pid << 3) | _CPUCLOCK_SCHED) / 1e9
    except (OSError, OverflowError, AttributeError):  # gone, not Linux, no such clock
        return None


_CPUCLOCK_SCHED = 2  # the clock id of a process's run time (include/linux/posix-timers.h)


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's children, from one pass over /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(_stat(int(entry))[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        out.setdefault(parent, []).append(int(entry))
    return out


def tree_cpu_s(pid: int, children: dict[int, list[int]]) -> float:
    """CPU seconds of ``pid``'s tree: its threads, its exited (reaped) children, its live descendants."""
    fields = _stat(pid)
    total = process_cpu_s(pid) + (int(fields[13]) + int(fields[14])) / _TICKS_PER_S  # + reaped children
    for child in children.get(pid, ()):
        try:
            total += tree_cpu_s(child, children)
        except OSError:
            continue  # exited meanwhile: its time moves to our cutime at the next reading
    return total


def cpu_snapshot(pids: dict[str, int], trees: bool = True) -> dict[str, float]:
    """User + system CPU seconds of each pid (its whole tree with ``trees``; this process alone,
    whose children are the processes under test), and ``_busy`` (CPU seconds the whole machine spent
    busy) and ``_wall`` (a monotonic clock), so a run can tell how much CPU something else took from
    it. Linux /proc only; elsewhere just ``_wall``."""
    out = {"_wall": time.monotonic()}
    me = os.getpid()
    try:
        children = children_by_parent() if trees else {}
    except OSError:
        children = {}
    for name, pid in pids.items():
        try:
            out[name] = tree_cpu_s(pid, children) if trees and pid != me else process_cpu_s(pid)
        except OSError:
            continue
    try:
        cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        out["_busy"] = (sum(cpu[:8]) - cpu[3] - cpu[4]) / _TICKS_PER_S  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        pass
    return out


def cpu_usage(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, Any]:
    """Per-request CPU of each process, and the cores that processes outside the run kept busy."""
    ours = [k for k in after if not k.startswith("_") and k in before]
    out: dict[str, Any] = {
        "cpu_ms_per_request": {k: round(1000 * (after[k] - before[k]) / max(1, requests), 4) for k in ours}
    }
    wall = after["_wall"] - before["_wall"]
    if "_busy" in after and "_busy" in before and wall > 0:
        other = (after["_busy"] - before["_busy"]) - sum(after[k] - before[k] for k in ours)
        out["background_cpu_cores"] = round(max(0.0, other) / wall, 3)
    return out


def this_process() -> dict[str, float]:
    """A snapshot of this process alone, as ``producer`` (the in-process systems' only process)."""
    return cpu_snapshot({"producer": os.getpid()}, trees=False)


def redis_cpu_s(client: Any) -> float:
    """User + system CPU seconds the Redis server behind ``client`` has used (its INFO cpu)."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def child_redis_port(parent: int) -> int | None:
    """The TCP port of a redis-server that process ``parent`` started (a bench's own server), read
    from the title redis-server gives itself ("redis-server 127.0.0.1:<port>"), for scripts that
    watch a bench's Redis from outside; None while there is none."""
    for pid in children_by_parent().get(parent, []):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        found = re.search(r"redis-server \S*:(\d+)", title)
        if found:
            return int(found.group(1))
    return None
