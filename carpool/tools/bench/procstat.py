"""CPU seconds of processes and of the whole machine, read from Linux /proc.

A run takes a snapshot before and after and reports the difference per request, and how much CPU
processes outside the run took meanwhile (a shared machine slows every figure).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used; OSError when it is gone or there is no /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each pid, and ``_busy`` (CPU seconds the whole machine spent busy)
    and ``_wall`` (a monotonic clock), so a run can tell how much CPU something else took from it.
    Linux /proc only; elsewhere just ``_wall``."""
    out = {"_wall": time.monotonic()}
    for name, pid in pids.items():
        try:
            out[name] = process_cpu_s(pid)
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
    return cpu_snapshot({"producer": os.getpid()})
