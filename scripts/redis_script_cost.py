"""Redis time per request by script and command, over a ``carpool bench --accelerator`` burst.

    python scripts/redis_script_cost.py --requests 20000 [-- extra bench options]

Runs ``carpool bench --accelerator h100 --pipeline 0 --light 0 --requests N`` and, once its own
redis-server is up (the child of the bench process), sets ``slowlog-log-slower-than 0`` and drains
the slow log every 0.2 s: every command with its duration, Lua scripts' inner commands included
(they are also inside their script's figure). Prints microseconds per request by command, with
EVALSHA split by script name. SLOWLOG's durations are wall time inside Redis and logging every
command costs Redis a little: read the shares, and the bench's own "Redis" CPU per request for the
total.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from collections import defaultdict

import redis

from carpool.redis_edge.lua import PRELUDE, source
from carpool.tools.bench.procstat import child_redis_port


def script_names() -> dict[str, str]:
    """The first 8 hex digits of each script's SHA1 (as loaded: with the shared helpers) -> its name."""
    from importlib.resources import files

    names = {}
    for entry in (files("carpool.redis_edge") / "scripts").iterdir():
        name = entry.name.removesuffix(".lua")
        if entry.name.endswith(".lua") and name != PRELUDE:
            names[hashlib.sha1(source(name).encode()).hexdigest()[:8]] = name
    return names


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--profile", default="h100")
    parser.add_argument("bench_args", nargs="*", help="more `carpool bench` options (after --)")
    args = parser.parse_args()
    command = [sys.executable, "-m", "carpool", "bench", "--accelerator", args.profile, "--pipeline", "0"]
    command += ["--light", "0", "--requests", str(args.requests), *args.bench_args]
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    names = script_names()
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    client: redis.Redis | None = None
    while bench.poll() is None:
        time.sleep(0.2)
        if client is None:
            port = child_redis_port(bench.pid)
            if port is None:
                continue
            try:
                client = redis.Redis(port=port)
                client.config_set("slowlog-log-slower-than", 0)
                client.config_set("slowlog-max-len", 200_000)
            except redis.RedisError:
                client = None
            continue
        try:
            # One transaction: a command logged between the read and the reset would be lost.
            entries, _ = client.pipeline(transaction=True).slowlog_get(200_000).slowlog_reset().execute()
        except redis.RedisError:
            continue  # the bench stopped its server
        for entry in entries:
            parts = entry["command"].split(b" ")
            name = parts[0].decode().lower()
            if name == "evalsha" and len(parts) > 1:
                name = f"evalsha {names.get(parts[1][:8].decode(), parts[1][:8].decode())}"
            totals[name][0] += 1
            totals[name][1] += entry["duration"]
    report = bench.stdout.read() if bench.stdout else ""
    n = args.requests
    print(f"{'command':26s} {'calls/req':>10s} {'µs/req':>8s} {'µs/call':>9s}")
    for name, (calls, usec) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:16]:
        print(f"{name:26s} {calls / n:10.3f} {usec / n:8.1f} {usec / max(calls, 1):9.1f}")
    for line in report.splitlines():
        if line.startswith("│ Redis") or line.startswith("│ ratio "):
            print(line)
    return bench.returncode or 0


if __name__ == "__main__":
    raise SystemExit(main())
