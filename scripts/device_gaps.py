"""How a simulated device spent an accelerator bench run: its idle time between batches, and how
many batches were already queued on it when the previous one ended.

    python scripts/device_gaps.py OUT_DIR [OUT_DIR ...]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+", type=Path)
    for out_dir in parser.parse_args().out_dirs:
        print(summary(out_dir))


if __name__ == "__main__":
    main()
