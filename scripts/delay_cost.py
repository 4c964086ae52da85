"""What one ``infer.delay()`` costs the producer: CPU and wall time per call against a bare redis-server.

    python scripts/delay_cost.py [--calls 2000] [--profile]

Starts a redis-server on a free port (no coordinator: the messages just pile up), warms up, then
times ``--calls`` calls of ``infer.delay(short text, "null")`` in this process. ``--profile`` prints
the top of a cProfile of the same calls. Run it from another checkout's tree
(``PYTHONPATH=/tmp/other python scripts/delay_cost.py``) to compare two versions on one machine.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import subprocess
import time

TEXT = "The quick brown fox jumps over the lazy dog."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    port = _free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
    )
    try:
        time.sleep(0.3)
        os.environ.update(
            CARPOOL_BROKER_URL=f"redis://127.0.0.1:{port}/0",
            CARPOOL_RESULT_BACKEND=f"redis://127.0.0.1:{port}/1",
            CARPOOL_MODEL="null",
            CARPOOL_MODELS="null",
        )
        from carpool.tasks import infer

        for _ in range(50):
            infer.delay(TEXT)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.calls):
            infer.delay(TEXT)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(
            f"infer.delay(): {cpu / args.calls * 1e6:.0f} us CPU, "
            f"{wall / args.calls * 1e6:.0f} us wall per call ({args.calls} calls)"
        )
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                infer.delay(TEXT)
            profile.disable()
            pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
