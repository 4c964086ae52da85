"""CPU an idle carpool stack spends per second: the coordinator, a worker and redis-server.

    python scripts/idle_cpu.py [--model sim-v100] [--seconds 10]

Starts a coordinator and one worker (``--model``) on an embedded redis-server, waits for the
worker's heartbeat and a few seconds more, then reads each process's CPU (its CPU-time clock, as
``carpool bench`` reads it) over ``--seconds`` with no request sent. What a process spends waiting
(heartbeats, probes for event listeners, timed waits) is charged to every request of a burst too,
in proportion to the burst's length: divide by a burst's requests per second to compare.
"""

from __future__ import annotations

import argparse
import time

from carpool.tools.bench.procstat import children_by_parent, tree_cpu_s
from carpool.tools.harness import Harness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sim-v100")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    with Harness() as harness:
        harness.start_stack(workers=1, CARPOOL_MODEL=args.model, CARPOOL_MODELS=args.model)
        time.sleep(3)  # start-up work (imports, the model's load) is over
        pids = dict(harness.pids())
        if harness.server is not None and harness.server.process is not None:
            pids["redis-server"] = harness.server.process.pid

        def snapshot() -> dict[str, float]:
            children = children_by_parent()
            return {name: tree_cpu_s(pid, children) for name, pid in pids.items()}

        before = snapshot()
        time.sleep(args.seconds)
        after = snapshot()
    for name in pids:
        print(f"{name:14s} {(after[name] - before[name]) / args.seconds * 1000:6.1f} ms of CPU per second")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
