"""How a simulated device spent an accelerator bench run: its idle time between batches, and how
many batches were already queued on it when the previous one ended.

    python scripts/device_gaps.py OUT_DIR [OUT_DIR ...]
    python scripts/device_gaps.py --trace TRACE_FILE OUT_DIR     # what each gap waited for
    python scripts/device_gaps.py --phases OUT_DIR [OUT_DIR ...] # when in the burst the device waited

With ``--phases``: the device's idle time in the burst, split at the end of the submit call: before
the first forward, between forwards while ``submit_many`` still sent, between forwards after it (and
how much of that among the last, partial batches), and from the last forward to ``gather``'s return.

With ``--trace``: ``TRACE_FILE`` was written by a worker patched with
``scripts/trace-worker-handoffs.patch`` (``git apply`` it on a copy of the tree, then run the bench
there with ``CARPOOL_TRACE_FILE=TRACE_FILE``): per batch, when ``run`` began, when the device stage
had room, when the claim returned (with how many batches the device stage held then), when the
device thread picked it up (none where the Celery thread launched it) and when it was launched.
Each gap, from the end of forward k to the start of forward k+1, is cut at those marks of batch k+1
(and its ``dispatched_at``), and the pieces are summed over the burst; the wait for the device
thread is also split by what the device stage held at the claim.

Each ``OUT_DIR`` is a ``carpool bench --accelerator`` output folder (its ``report.json`` and
``device-*.log``). A batch "queued" started the moment the previous one ended: the worker had
launched it while the device still ran the previous one (the device log is the device's timeline).
The worker's warm-up batch is left out: its gap to the burst is the bench's set-up, not the worker.
"""

from __future__ import annotations

import argparse
import json
import statistics
from itertools import pairwise
from pathlib import Path

from carpool.tools.bench.device import read_device_log

WARM_UP_GAP_S = 0.5  # a gap this long is the pause between the warm-up batch and the burst


def summary(out_dir: Path) -> str:
    (log,) = sorted(out_dir.glob("device-*.log"))
    forwards = sorted(read_device_log(log), key=lambda f: f.start)
    gaps = [b.start - a.end for a, b in pairwise(forwards)]
    gaps = [g for g in gaps if g < WARM_UP_GAP_S]
    carpool = json.loads((out_dir / "report.json").read_text())["carpool"]
    cpu = carpool["cpu_us_per_request"]
    queued = sum(1 for g in gaps if g <= 1e-6)
    return (
        f"{out_dir}: ratio {carpool['ratio_to_capacity']:.3f}, queued {queued}/{len(gaps)}, "
        f"idle between batches {sum(gaps):.3f} s (median {statistics.median(gaps) * 1e3:.2f} ms), "
        f"CPU us/request worker {cpu['worker']:.0f} coordinator {cpu['coordinator']:.0f} "
        f"redis {cpu['redis']:.0f}"
    )


def phases(out_dir: Path) -> str:
    """The burst's idle device time by phase (see the module's docstring), in ms."""
    carpool = json.loads((out_dir / "report.json").read_text())["carpool"]
    begin, submitted, ended = carpool["wall_start"], carpool["submit_s"], carpool["wall_s"]
    (log,) = sorted(out_dir.glob("device-*.log"))
    forwards = sorted((f for f in read_device_log(log) if f.start >= begin), key=lambda f: f.start)
    first = forwards[0].start - begin
    while_sending = after = 0.0
    for a, b in pairwise(forwards):
        gap = max(0.0, b.start - a.end)
        if b.start - begin <= submitted:
            while_sending += gap
        else:
            after += gap
    tail = len(forwards)
    while tail > 1 and forwards[tail - 1].rows < max(f.rows for f in forwards):
        tail -= 1
    partials = sum(max(0.0, b.start - a.end) for a, b in pairwise(forwards[tail - 1 :]))
    last = begin + ended - max(f.end for f in forwards)
    return (
        f"{out_dir}: ratio {carpool['ratio_to_capacity']:.3f}, burst {ended * 1e3:.0f} ms; device idle: "
        f"before the first forward {first * 1e3:.0f}, between forwards while sending "
        f"{while_sending * 1e3:.0f}, after {after * 1e3:.0f} (among the last {len(forwards) - tail} "
        f"partial batches {partials * 1e3:.0f}), after the last forward {last * 1e3:.0f}"
    )


# The marks of a traced batch, in the order a gap is cut at them, and what the device waited for
# until each: (trace kind, or "d" for the batch's dispatched_at; what the piece before it is).
_MARKS = (
    ("d", "the coordinator to dispatch it"),
    ("R", "its delivery to the worker's run()"),
    ("W", "room in the device stage"),
    ("C", "the claim"),
    ("P", "the device thread to pick it up"),
    ("L", "its launch"),
)


def handoffs(out_dir: Path, trace: Path) -> tuple[dict[str, float], dict[int, float]]:
    """Seconds of device idle time in the burst by what it waited for (see the module's doc), and
    the wait for the device thread by the batches the device stage held at the claim."""
    (log,) = sorted(out_dir.glob("device-*.log"))
    forwards = sorted(read_device_log(log), key=lambda f: f.start)
    marks: dict[str, dict[str, float]] = {}
    launched: list[str] = []
    held: dict[str, int] = {}  # batches the device stage held when this one's claim returned
    for line in trace.read_text().splitlines():
        kind, batch_id, dispatched, count, when, _ = line.split()
        marks.setdefault(batch_id, {})[kind] = float(when)
        if kind == "R":
            marks[batch_id]["d"] = float(dispatched)
        if kind == "C":
            held[batch_id] = int(count)
        if kind == "L":
            launched.append(batch_id)
    count = min(len(forwards), len(launched))  # the warm-up batch runs outside run(): not traced
    forwards, launched = forwards[-count:], launched[-count:]
    waited = {what: 0.0 for _, what in _MARKS} | {"the device to start it once launched": 0.0}
    by_held: dict[int, float] = {}
    for (before, after), batch_id in zip(pairwise(forwards), launched[1:], strict=True):
        if not 0 < after.start - before.end < WARM_UP_GAP_S:
            continue
        cut = before.end
        for kind, what in _MARKS:
            at = marks[batch_id].get(kind, cut)
            waited[what] += max(0.0, at - cut)
            if kind == "P" and batch_id in held:
                by_held[held[batch_id]] = by_held.get(held[batch_id], 0.0) + max(0.0, at - cut)
            cut = max(cut, at)
        waited["the device to start it once launched"] += max(0.0, after.start - cut)
    return waited, by_held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+", type=Path)
    parser.add_argument("--trace", type=Path, help="a worker's hand-off trace (one OUT_DIR)")
    parser.add_argument("--phases", action="store_true", help="idle time by phase of the burst")
    args = parser.parse_args()
    for out_dir in args.out_dirs:
        print(phases(out_dir) if args.phases else summary(out_dir))
        if args.trace is not None:
            waited, by_held = handoffs(out_dir, args.trace)
            for what, seconds in waited.items():
                print(f"  waited for {what}: {seconds:.3f} s")
                if what == "the device thread to pick it up":
                    for count, part in sorted(by_held.items()):
                        print(f"    of which with {count} held at the claim: {part:.3f} s")
            print(f"  all gaps: {sum(waited.values()):.3f} s")


if __name__ == "__main__":
    main()
