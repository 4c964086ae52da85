"""Where carpool's CPU goes in ``carpool bench --accelerator``: py-spy on the coordinator and worker.

    python scripts/profile_accelerator.py [--profile h100] [--requests 20000] [--out bench-out/prof]

Runs ``carpool bench --accelerator PROFILE --pipeline 0 --light 0`` and, when its burst starts,
attaches ``py-spy record`` (``--nonblocking``, collapsed stacks) to its coordinator and worker until
they exit (the bench stops them right after the burst). Then, per process, the functions with the
most samples on top of the stack (own time), anywhere in it (inclusive), and carpool's own
functions anywhere in it (where in carpool the time is spent), as shares of the
process's samples and as CPU µs per request (the share times the process's µs per request in the
bench's report). py-spy samples a thread that is running or waiting for a core: on a loaded
machine the wait after a Redis reply lands in the frames that read it, so those shares read high.
``--gil`` samples only the thread holding the GIL, which leaves those waits out (and the kernel's
share of a send or a read with them). ``--thread NAME`` (``MainThread``: the worker's Celery thread;
``carpool-device``, ``carpool-finisher``) samples every thread, idle or not, and reports that one
thread's wall-clock time: where it waits (for a Redis reply, the next message, the device) as well
as where it runs, as shares of its samples.
Needs ``py-spy`` on PATH or ``--py-spy``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROLES = {"coordinator": "carpool coordinator", "worker": "carpool worker"}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _find_children(parent: int, timeout_s: float = 120.0) -> dict[str, int]:
    from carpool.tools.bench.procstat import children_by_parent

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {}
        for pid in children_by_parent().get(parent, []):
            line = _cmdline(pid)
            for role, marker in ROLES.items():
                if f"-m {marker}" in line:
                    found[role] = pid
        if len(found) == len(ROLES):
            return found
        time.sleep(0.05)
    raise TimeoutError("the bench's coordinator and worker did not start")


def _wait_for_line(path: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (path.read_text(errors="replace") if path.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the bench did not reach {text!r}; see {path}")
        time.sleep(0.02)


def _frame(frame: str) -> str:
    """``function (path/to/file.py:line)`` -> ``function (file.py)``: one row per function."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1].rstrip(')')})"


def _carpool_frame(frame: str) -> str | None:
    """``function (carpool/module/file.py)`` for a frame in carpool's own code, else None."""
    name, _, where = frame.partition(" (")
    path = where.split(":")[0]
    if "carpool/" not in path or "site-packages" in path:
        return None
    return f"{name} (carpool/{path.rsplit('carpool/', 1)[-1]})"


def summarize(raw: Path, top: int, thread: str | None = None) -> dict[str, list[tuple[str, float]]]:
    """(own, inclusive, carpool's inclusive) shares of the samples per function in a py-spy
    ``raw`` (collapsed) file; with ``thread``, of that thread's samples alone (recorded with
    ``--threads``, whose stacks start with ``thread (TID): NAME``)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    carpool: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().split("\n"):  # splitlines() would also cut at \x1c, \x85 and the like
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        raw_frames = stack.split(";")
        if thread is not None:
            if raw_frames[0].partition("): ")[2] != thread:
                continue
            raw_frames = raw_frames[1:] or ["(idle)"]
        frames = [_frame(f) for f in raw_frames]
        total += count
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
        for ours in {_carpool_frame(f) for f in raw_frames} - {None}:
            carpool[str(ours)] += count
    share = 1.0 / max(1, total)
    return {
        "own": [(k, v * share) for k, v in own.most_common(top)],
        "inclusive": [(k, v * share) for k, v in inclusive.most_common(top)],
        "carpool": [(k, v * share) for k, v in carpool.most_common(top)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", default="h100", help="--accelerator profile (default h100)")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default="bench-out/profile-accelerator")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument(
        "--gil",
        action="store_true",
        help="sample only the thread holding the GIL: where Python runs, without the waits for Redis, "
        "the device or another thread",
    )
    parser.add_argument(
        "--thread",
        help="sample every thread, waiting or not, and report this one's wall-clock time "
        "(MainThread: a worker's Celery thread; carpool-device; carpool-finisher)",
    )
    opts = parser.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "carpool",
            "bench",
            "--accelerator",
            opts.profile,
            "--requests",
            str(opts.requests),
            "--pipeline",
            "0",
            "--light",
            "0",
            "--out",
            str(out / "bench"),
        ],
        stdout=open(out / "bench.txt", "w"),  # noqa: SIM115  (the child owns it)
        stderr=subprocess.STDOUT,
    )
    spies = {}
    pids = _find_children(bench.pid)
    _wait_for_line(out / "bench.txt", "a burst of", bench)
    for role, pid in pids.items():
        spies[role] = subprocess.Popen(
            [
                opts.py_spy,
                "record",
                "--pid",
                str(pid),
                "--nonblocking",
                *(["--gil"] if opts.gil else []),
                *(["--idle", "--threads"] if opts.thread else []),
                "--rate",
                str(opts.rate),
                "--format",
                "raw",
                "--output",
                str(out / f"{role}.raw"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    rc = bench.wait()
    for spy in spies.values():
        spy.wait(timeout=60)
    report = json.loads((out / "bench" / "report.json").read_text())
    cpu = (report.get("carpool") or {}).get("cpu_us_per_request") or {}
    result = {}
    for role in spies:
        shares = summarize(out / f"{role}.raw", opts.top, opts.thread)
        per_request = cpu.get(role, 0.0)
        result[role] = {"cpu_us_per_request": per_request, "thread": opts.thread, **shares}
        if opts.thread:
            print(f"\n== {role}, thread {opts.thread}: shares of its wall-clock time, waits included")
        else:
            print(f"\n== {role}: {per_request:.0f} µs CPU per request over the run")
        for kind in ("own", "inclusive", "carpool"):
            print(f"-- {kind} time")
            for name, share in shares[kind]:
                cost = "" if opts.thread else f" {share * per_request:8.1f} µs"
                print(f"{share:7.1%}{cost}  {name}")
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    print(f"\nbench exit {rc}; {out / 'bench.txt'}, {out / 'profile.json'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
