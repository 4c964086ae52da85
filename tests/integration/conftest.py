"""Real parts: a redis-server on a random port for the session, real coordinator/worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from carpool.tools.embedded import EmbeddedRedis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    # tests/conftest.py already pointed CARPOOL_BROKER_URL at this port for the whole session.
    with EmbeddedRedis(port=int(os.environ["CARPOOL_TEST_REDIS_PORT"])) as server:
        os.environ["CARPOOL_BROKER_URL"] = server.url(0)
        os.environ["CARPOOL_RESULT_BACKEND"] = server.url(1)
        yield server
        from carpool.tools.demo import release_result_consumer

        release_result_consumer()


@pytest.fixture()
def clean_redis(redis_server: EmbeddedRedis) -> EmbeddedRedis:
    import redis

    redis.Redis(port=redis_server.port).flushall()
    return redis_server


class Processes:
    """Coordinator and worker processes with their own environment; logs kept for failures."""

    def __init__(self, server: EmbeddedRedis, log_dir: Path) -> None:
        self.server = server
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[object] = []

    def env(self, **overrides: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(CARPOOL_BROKER_URL=self.server.url(0), CARPOOL_RESULT_BACKEND=self.server.url(1))
        env.update(overrides)
        return env

    def start(self, name: str, role: str, **env: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115
        self._files.append(log)
        proc = subprocess.Popen(
            [sys.executable, "-m", "carpool", role, "--loglevel", "info"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(**env),
        )
        self.procs[name] = proc
        return proc

    def wait_workers(self, count: int = 1, timeout_s: float = 120) -> None:
        import redis

        from carpool.redis_edge.keys import Keys
        from carpool.redis_edge.store import RequestStore

        store = RequestStore(redis.Redis(port=self.server.port), Keys("carpool.requests"), 1)
        deadline = time.monotonic() + timeout_s
        while store.live_workers() < count:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} worker(s) not up in {timeout_s}s")
            time.sleep(0.1)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self, name: str, sig: int = 15, timeout_s: float = 30) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)
        for f in self._files:
            f.close()  # type: ignore[attr-defined]


@pytest.fixture()
def processes(clean_redis: EmbeddedRedis, tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(clean_redis, tmp_path)
    yield procs
    procs.stop_all()


def start_stack(processes: Processes, workers: int = 1, **env: str) -> Processes:
    """A coordinator and ``workers`` GPU workers sharing ``env`` (CARPOOL_* overrides)."""
    processes.start("coordinator", "coordinator", **env)
    for i in range(workers):
        processes.start(f"worker{i}", "worker", **env)
    processes.wait_workers(workers)
    return processes
