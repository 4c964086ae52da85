"""Redis commands per request on the ``null`` pipeline, by script and by command.

    python scripts/redis_commands.py [--requests 2000] [--json out.json]

One coordinator and one worker (``null`` model) on an embedded redis-server; a warm-up burst, then
``--requests`` mixed texts through ``submit_many`` + ``gather`` while a MONITOR connection records
every command. A command run inside a Lua script is charged to the EVALSHA before it (Redis runs a
script to its end before any other command), so the table says what each script costs per request.
Also prints ``INFO commandstats`` calls per request over the same burst, which counts the same
commands without MONITOR's attribution.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections import Counter, defaultdict
from typing import Any

from carpool.tools.bench.procstat import redis_cpu_s


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--json", help="write the table here")
    parser.add_argument(
        "--no-monitor", action="store_true", help="skip MONITOR (it costs Redis more than the burst)"
    )
    opts = parser.parse_args()
    n = opts.requests

    import redis

    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from carpool.redis_edge import lua
    from carpool.tools.harness import Harness, release_result_consumer
    from carpool.tools.workload import mixed_texts

    names = ["take", "dispatch", "renew_held", "claim", "finish", "renew", "requeue", "heartbeat"]
    by_sha = {_sha1(lua.source(x)): x for x in names}

    with Harness(loglevel="warning") as harness:
        harness.start_stack(workers=1, CARPOOL_MODEL="null", CARPOOL_METRICS_PORT="0")
        settings = load_settings(
            broker_url=harness.broker_url, result_backend=harness.result_backend, model="null"
        )
        app = create_app(settings)
        texts = mixed_texts(n, seed=0)
        gather(submit_many(texts[:200], app=app), timeout=60)  # warm: connections, scripts, templates

        client = harness.redis_client(0)
        before = _calls(client)
        usec_before = _usec(client)
        cpu_before = redis_cpu_s(client)
        lines: list[tuple[str, str]] = []
        ready = threading.Event()
        stop = threading.Event()

        def record() -> None:
            with redis.Redis.from_url(harness.broker_url).monitor() as m:
                ready.set()
                for event in m.listen():
                    lines.append((event.get("client_type", ""), event["command"]))
                    if stop.is_set():
                        return

        thread = threading.Thread(target=record, daemon=True)
        if not opts.no_monitor:
            thread.start()
            ready.wait(10)
        gather(submit_many(texts, app=app), timeout=120)
        if not opts.no_monitor:
            stop.set()
            client.ping()  # one more command so the recorder sees stop
            thread.join(10)
        after = _calls(client)
        usec = {k: v - usec_before.get(k, 0) for k, v in _usec(client).items()}
        cpu_s = redis_cpu_s(client) - cpu_before
        release_result_consumer(app)

    per_script: dict[str, Counter[str]] = defaultdict(Counter)
    # A script runs to its end before any other command, so its inner commands (client type "lua")
    # follow its EVALSHA in MONITOR's stream.
    current = "client"
    for client_type, raw in lines:
        words = raw.split(" ")
        cmd = words[0].upper()
        if cmd in ("EVALSHA", "EVAL"):
            current = by_sha.get(words[1], "script?")
            per_script[current]["EVALSHA"] += 1
        elif client_type == "lua":
            per_script[current][cmd] += 1
        else:
            per_script["client"][cmd] += 1
    total = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    total.pop("info", None)
    table = {s: {c: round(v / n, 3) for c, v in cnt.most_common()} for s, cnt in per_script.items()}
    print(f"MONITOR, commands per request over {n} requests (script's inner commands under it):")
    for script, cmds in sorted(table.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"  {script:12s} {sum(cmds.values()):7.3f}  {cmds}")
    print(f"commandstats: {sum(total.values()) / n:.3f} per request")
    for cmd, v in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"  {cmd:20s} {v / n:7.3f}")
    print(f"redis-server CPU (INFO cpu, MONITOR's own cost included): {cpu_s / n * 1e6:.1f} us per request")
    print("commandstats usec per request (a script's includes its inner commands'):")
    for cmd, v in sorted(usec.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {cmd:20s} {v / n:7.2f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"requests": n, "monitor": table, "commandstats": total}, f, indent=1)
    return 0


def _sha1(text: str) -> str:
    import hashlib

    return hashlib.sha1(text.encode()).hexdigest()


def _calls(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def _usec(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in stats.items()}


if __name__ == "__main__":
    raise SystemExit(main())
