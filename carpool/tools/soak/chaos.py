"""The system under a soak and what is done to it: a redis-server with an append-only file synced on
every write, two coordinators and two workers, faults injected on a schedule, memory sampled.

Every change to the processes (a fault, a restart after an unexpected exit) happens under one lock,
so the sampler never reads a process table in the middle of one.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from carpool.redis_edge.keys import Keys
from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.harness import Harness
from carpool.tools.soak.config import SoakConfig
from carpool.tools.soak.model import NAME as MODEL
from carpool.tools.soak.model import PACE_ENV

MIB = 1024 * 1024


def fault_plan(config: SoakConfig) -> list[tuple[float, str]]:
    """(seconds from the start, kind) of every fault: the first when the calm lead-in ends, then one
    every ``interval_s`` (uniform) until the tail; kinds in turn, shuffled afresh each round."""
    rng = random.Random(f"soak-plan:{config.seed}")
    plan: list[tuple[float, str]] = []
    bag: list[str] = []
    at = config.lead_in_s
    while at <= config.duration_s - config.tail_s:
        if not bag:
            bag = list(config.kinds)
            rng.shuffle(bag)
        plan.append((round(at, 3), bag.pop()))
        at += rng.uniform(*config.interval_s)
    return plan


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` (psutil when installed, else /proc); None when it is gone."""
    try:
        import psutil

        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
    except ImportError:
        pass
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Stack:
    """The redis-server and the carpool processes of one soak, and the faults done to them."""

    def __init__(self, config: SoakConfig, log_dir: Path) -> None:
        self.config = config
        self._aof_dir = tempfile.mkdtemp(prefix="carpool-soak-aof-")
        self.server = EmbeddedRedis(appendonly=True, appendfsync="always", directory=self._aof_dir)
        self.harness = Harness(server=self.server, log_dir=log_dir)
        self.lock = threading.Lock()
        self.rng = random.Random(f"soak-targets:{config.seed}")
        self.keys = Keys("carpool.requests")
        self.coordinators = [f"coordinator{i}" for i in range(config.coordinators)]
        self.workers = [f"worker{i}" for i in range(config.workers)]
        self.kills: dict[str, int] = {}

    def env(self) -> dict[str, str]:
        c = self.config
        return {
            "CARPOOL_MODEL": MODEL,
            "CARPOOL_MODELS": MODEL,
            "CARPOOL_MAX_BATCH": str(c.max_batch),
            "CARPOOL_RECOVERY_TIMEOUT_S": str(c.lease_s),
            "CARPOOL_RESULT_EXPIRES_S": str(c.result_expires_s),
            PACE_ENV: f"{c.pace[0]},{c.pace[1]}",
            **c.extra_env,
        }

    def start(self) -> None:
        self.server.start()
        env = self.env()
        for name in self.coordinators:
            self.harness.start(name, "coordinator", **env)
        for name in self.workers:
            self.harness.start(name, "worker", **env)
        self.harness.wait_workers(len(self.workers), timeout_s=300)

    def close(self) -> None:
        self.harness.close()
        self.server.cleanup()

    def client(self, db: int = 0) -> redis.Redis:
        """A client that gives up quickly while the server is away."""
        return redis.Redis(port=self.server.port, db=db, socket_timeout=5, socket_connect_timeout=1)

    def inject(self, kind: str, at_s: float) -> dict[str, Any]:
        """Kill one ``kind`` (one of its processes, in turn) and start it again ``down_s`` later."""
        in_flight = self._in_flight()
        with self.lock:
            t0 = time.monotonic()
            if kind == "redis":
                target = "redis-server"
                self.server.restart(self.config.down_s, kill=True)
            else:
                target = self._least_killed(self.coordinators if kind == "coordinator" else self.workers)
                self.harness.crash_restart(target, self.config.down_s)
            back_s = time.monotonic() - t0
        return {
            "kind": kind,
            "target": target,
            "at_s": round(at_s, 3),
            "back_after_s": round(back_s, 3),
            "in_flight_at_fault": in_flight,
        }

    def _least_killed(self, names: list[str]) -> str:
        """A random one of the processes killed least so far, so each of the two gets its share."""
        fewest = min(self.kills.get(n, 0) for n in names)
        target = self.rng.choice([n for n in names if self.kills.get(n, 0) == fewest])
        self.kills[target] = fewest + 1
        return target

    def _in_flight(self) -> int | None:
        client = self.client()
        try:
            return int(client.zcard(self.keys.inflight_lease))
        except redis.RedisError:
            return None
        finally:
            client.close()

    def restart_exited(self) -> list[dict[str, Any]]:
        """Start again any process that exited though no fault killed it; what each was."""
        out = []
        with self.lock:
            for name, proc in list(self.harness.procs.items()):
                code = proc.poll()
                if code is not None:
                    out.append({"name": name, "exit_code": code, "log_tail": self.harness.log(name)[-1500:]})
                    self.harness.restart(name)
        return out

    def memory(self, client: redis.Redis) -> tuple[dict[str, tuple[int, int]], int | None]:
        """RSS (pid, bytes) of each process, redis-server's included, and Redis's ``used_memory``."""
        with self.lock:
            pids = self.harness.pids()
        rss = {name: (pid, value) for name, pid in pids.items() if (value := rss_bytes(pid)) is not None}
        try:
            used = int(client.info("memory")["used_memory"])
        except (redis.RedisError, KeyError, ValueError):
            used = None
        return rss, used


class Sampler(threading.Thread):
    """Every ``every_s``: each process's RSS, Redis's used memory, and unexpected exits (restarted)."""

    def __init__(self, stack: Stack, every_s: float, start: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.stack, self.every_s, self.start_at = stack, every_s, start
        self.rss: dict[str, list[tuple[float, int, int]]] = {}  # name -> (t, pid, bytes)
        self.redis_used: list[tuple[float, int]] = []
        self.exits: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import os

        client = self.stack.client()
        try:
            while not self.stop.wait(self.every_s):
                t = round(time.time() - self.start_at, 2)
                for exit_ in self.stack.restart_exited():
                    self.exits.append({"at_s": t, **exit_})
                rss, used = self.stack.memory(client)
                mine = rss_bytes(os.getpid())
                if mine is not None:
                    rss["producer"] = (os.getpid(), mine)
                for name, (pid, value) in rss.items():
                    self.rss.setdefault(name, []).append((t, pid, value))
                if used is not None:
                    self.redis_used.append((t, used))
        finally:
            client.close()
