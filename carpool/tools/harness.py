"""One process harness for ``carpool demo``, ``carpool bench`` and the integration tests.

A Redis (an embedded redis-server, one already running, or an external URL), then carpool
coordinators and workers, or any ``python -m`` program, as child processes. Each child gets its own
environment dict built from this process's environment, the Redis URLs and per-process overrides:
the harness never changes ``os.environ``, so the process that drives it can run several stacks and
keeps its own settings. Every child writes to its own log file.

    with Harness(log_dir=tmp) as h:          # an embedded redis-server of its own
        h.start_stack(workers=2, CARPOOL_MODEL="toy")
        ...                                  # h.broker_url, h.log("worker0"), h.stop("worker1", SIGKILL)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from carpool.names import DEFAULT_REQUEST_QUEUE, coordinator_hostname
from carpool.tools.embedded import EmbeddedRedis

LOG_TAIL_CHARS = 4000


class ProcessExited(RuntimeError):
    """Raised when a child the harness started has exited while it was still needed: the message
    has the end of its log; ``returncode`` and ``summary`` (one line: who, how, where its log is,
    and the log's last line) are for callers that print one line."""

    def __init__(self, message: str, returncode: int | None = None, summary: str = "") -> None:
        super().__init__(message)
        self.returncode = returncode
        self.summary = summary or message.partition("\n")[0]


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by a SIGTERM that arrives while a :class:`Harness` holds children.

    It unwinds as Ctrl-C does (``except Exception`` does not stop it), so ``with Harness()`` and the
    ``finally`` blocks of demo, bench and soak stop the coordinators, workers and redis-server this
    process started rather than leaving them running with no parent. ``carpool`` exits 143 on it.
    """

    signum = int(signal.SIGTERM)


class _SigtermTrap:
    """SIGTERM as :class:`Terminated` while at least one harness holds children (in the main thread,
    where no one else handles SIGTERM), put back as it was when the last one closes. A SIGTERM that
    comes while a harness starts or stops a process is held until the process is in its hands (or
    stopped), then raised."""

    def __init__(self) -> None:
        self.holders = 0
        self.previous: Any = None
        self.deferring = 0
        self.pending = False

    def _handler(self, signum: int, frame: object) -> None:
        if self.holders == 0:  # the last harness closed off the main thread, which cannot restore it
            signal.signal(signal.SIGTERM, self.previous)
            os.kill(os.getpid(), signal.SIGTERM)  # delivered again, to what was there before
            return
        if self.deferring:
            self.pending = True
            return
        raise Terminated()

    def acquire(self) -> bool:
        """Install the handler (or count one more holder); False where it cannot or should not."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if self.holders == 0:
            current = signal.getsignal(signal.SIGTERM)
            if current != self._handler:
                if current is not signal.SIG_DFL:  # the program handles (or ignores) SIGTERM itself
                    return False
                signal.signal(signal.SIGTERM, self._handler)
                self.previous = current
        self.holders += 1
        return True

    def release(self) -> None:
        self.holders -= 1
        main = threading.current_thread() is threading.main_thread()
        if self.holders == 0 and main and signal.getsignal(signal.SIGTERM) == self._handler:
            signal.signal(signal.SIGTERM, self.previous)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A SIGTERM within waits until :meth:`raise_pending` (the main thread's: it is the one the
        handler interrupts)."""
        main = threading.current_thread() is threading.main_thread()
        self.deferring += main
        try:
            yield
        finally:
            self.deferring -= main

    def raise_pending(self) -> None:
        """Raise the SIGTERM that came while deferred, if one did (outside every deferred block)."""
        if self.pending and not self.deferring and threading.current_thread() is threading.main_thread():
            self.pending = False
            raise Terminated()


_SIGTERM = _SigtermTrap()


@dataclass(frozen=True, slots=True)
class _Spec:
    module_argv: tuple[str, ...]
    env_overrides: dict[str, str]


class Harness:
    """A Redis and named child processes; a context manager that stops them all on exit.

    ``server``: a running :class:`EmbeddedRedis` to use (not stopped on exit). ``broker_url`` and
    ``result_backend``: an external Redis instead. With neither, :meth:`__enter__` starts an
    embedded redis-server and removes it on exit. ``log_dir``: where ``<name>.log`` files go (a
    temporary directory, removed on exit, when None). ``base_env``: the environment children start
    from (this process's, read at each start, when None). ``profile_dir``: run every child under
    cProfile, writing ``<name>-<n>.prof`` there. ``unix_socket``: the embedded redis-server it
    starts is reached through a Unix socket (its URLs are ``redis+socket://`` ones).
    """

    def __init__(
        self,
        server: EmbeddedRedis | None = None,
        log_dir: Path | None = None,
        *,
        broker_url: str | None = None,
        result_backend: str | None = None,
        base_env: Mapping[str, str] | None = None,
        loglevel: str = "info",
        profile_dir: Path | None = None,
        unix_socket: bool = False,
    ) -> None:
        if server is not None and broker_url is not None:
            raise ValueError("give either a server or a broker_url, not both")
        self.server = server
        self._external = (broker_url, result_backend or broker_url) if broker_url else None
        self._own_server = False
        self._own_log_dir = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix="carpool-logs-")) if log_dir is None else log_dir
        self.base_env = dict(base_env) if base_env is not None else None
        self.loglevel = loglevel
        self.profile_dir = profile_dir
        self.unix_socket = unix_socket
        self.profiles: dict[str, Path] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._specs: dict[str, _Spec] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._traps_sigterm = False  # whether this harness holds _SIGTERM

    # --- Redis ---------------------------------------------------------------------------------
    def __enter__(self) -> Harness:
        self._trap_sigterm()
        try:
            if self.server is None and self._external is None:
                with _SIGTERM.deferred():  # a SIGTERM meanwhile waits until the server is ours to stop
                    self.server = EmbeddedRedis(unix_socket=self.unix_socket).start()
                    self._own_server = True
                _SIGTERM.raise_pending()
        except BaseException:
            self.close()  # __exit__ is not called when __enter__ raises
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def broker_url(self) -> str:
        if self._external is not None:
            return str(self._external[0])
        return self._embedded().url(0)

    @property
    def result_backend(self) -> str:
        if self._external is not None:
            return str(self._external[1])
        return self._embedded().url(1)

    @property
    def embedded(self) -> bool:
        """Whether the Redis is a redis-server this harness or its caller runs (not an external one)."""
        return self._external is None

    def _embedded(self) -> EmbeddedRedis:
        if self.server is None:
            raise RuntimeError("the harness has no Redis yet: use it as a context manager")
        return self.server

    def redis_client(self, db: int = 0) -> Any:
        """A ``redis.Redis`` on the broker's server (``db`` 0) or the results' (``db`` 1), as the
        children reach it (through Sentinel when the URLs are Sentinel ones)."""
        from carpool.redis_edge.connect import client_for

        return client_for(self.broker_url if db == 0 else self.result_backend, self.settings())

    def settings(self) -> Any:
        """The :class:`carpool.config.Settings` the children start with (from :meth:`env`)."""
        from carpool.config import Settings, load_settings

        env = self.env()
        fields = {name: env.get(f"CARPOOL_{name.upper()}") for name in Settings.model_fields}
        return load_settings(**{name: value for name, value in fields.items() if value is not None})

    # --- children ------------------------------------------------------------------------------
    def env(self, **overrides: str) -> dict[str, str]:
        """A child's environment: the base environment, the Redis URLs, then ``overrides``."""
        env = dict(os.environ if self.base_env is None else self.base_env)
        env.update(CARPOOL_BROKER_URL=self.broker_url, CARPOOL_RESULT_BACKEND=self.result_backend)
        env.update(overrides)
        return env

    def start(self, name: str, role: str, **env: str) -> subprocess.Popen[bytes]:
        """``carpool <role>`` (coordinator or worker) as ``name``, with ``env`` over :meth:`env`."""
        return self.spawn(name, ["carpool", role, "--loglevel", self.loglevel], **env)

    def spawn(self, name: str, module_argv: list[str], **env: str) -> subprocess.Popen[bytes]:
        """``python -m <module_argv>`` as ``name``; output appended to ``<log_dir>/<name>.log``."""
        if name in self.procs and self.procs[name].poll() is None:
            raise ValueError(f"a process named {name!r} is already running")
        self._trap_sigterm()  # also for a harness used without `with` (the soak's), closed in a finally
        self._close_log(name)
        argv = [sys.executable, "-m", *module_argv]
        if self.profile_dir is not None:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            n = sum(1 for key in self.profiles if key.startswith(name + "-"))
            path = self.profile_dir / f"{name}-{n}.prof"
            self.profiles[f"{name}-{n}"] = path
            argv = [sys.executable, "-m", "cProfile", "-o", str(path), "-m", *module_argv]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115  (closed by stop or close)
        self._logs[name] = log
        with _SIGTERM.deferred():  # a SIGTERM meanwhile waits until close() would stop the child
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(**env))
            self.procs[name] = proc
            self._specs[name] = _Spec(tuple(module_argv), dict(env))
        _SIGTERM.raise_pending()
        return proc

    def start_stack(self, workers: int = 1, prefix: str = "", wait: bool = True, **env: str) -> Harness:
        """``<prefix>coordinator`` and ``workers`` workers ``<prefix>worker0``... sharing ``env``;
        with ``wait``, until the workers heartbeat and this coordinator has stepped."""
        coordinator = self.start(f"{prefix}coordinator", "coordinator", **env)
        for i in range(workers):
            self.start(f"{prefix}worker{i}", "worker", **env)
        if wait:
            queue = self.env(**env).get("CARPOOL_REQUEST_QUEUE", DEFAULT_REQUEST_QUEUE)
            self.wait_workers(workers, request_queue=queue)
            self.wait_coordinator(coordinator.pid, request_queue=queue)
        return self

    def restart(self, name: str, **env: str) -> subprocess.Popen[bytes]:
        """Stop ``name`` and start it again with the same program, ``env`` over its old overrides."""
        spec = self._specs[name]
        self.stop(name)
        return self.spawn(name, list(spec.module_argv), **{**spec.env_overrides, **env})

    def crash_restart(self, name: str, down_s: float = 0.0) -> subprocess.Popen[bytes]:
        """``SIGKILL`` to ``name`` (a crash), ``down_s`` later start it again with the same program
        and environment, as a supervisor would."""
        spec = self._specs[name]
        self.kill(name)
        time.sleep(down_s)
        return self.spawn(name, list(spec.module_argv), **spec.env_overrides)

    def check_alive(self) -> None:
        """Raise :class:`ProcessExited`, with the end of its log, if any running child has exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = self.log(name)
                last = next((line for line in reversed(log.splitlines()) if line.strip()), "")
                where = f"{name} exited with {proc.returncode}; see {self.log_dir / name}.log"
                raise ProcessExited(
                    f"{where}:\n{log}", proc.returncode, f"{where}: {last.strip()}" if last else where
                )

    def wait_workers(
        self, count: int = 1, timeout_s: float = 120, request_queue: str = DEFAULT_REQUEST_QUEUE
    ) -> None:
        """Wait until ``count`` carpool workers heartbeat for ``request_queue``, or raise: a child
        exited (:class:`ProcessExited`) or the time ran out (``TimeoutError``)."""
        from carpool.redis_edge.keys import Keys
        from carpool.redis_edge.store import RequestStore

        def up(client: Any) -> bool:
            return RequestStore(client, Keys(request_queue), 1).live_workers() >= count

        self._wait_until(f"{count} worker(s)", up, timeout_s)

    def wait_coordinator(
        self, pid: int, timeout_s: float = 120, request_queue: str = DEFAULT_REQUEST_QUEUE
    ) -> None:
        """Wait until the coordinator with process id ``pid`` has written its stats for
        ``request_queue`` (its first step, taken once it listens for revokes), or raise as
        :meth:`wait_workers` does."""
        from carpool.redis_edge.keys import Keys

        hostname = coordinator_hostname(pid, socket.gethostname())

        def up(client: Any) -> bool:
            return client.zscore(Keys(request_queue).coordinators, hostname) is not None

        self._wait_until(f"coordinator {hostname}", up, timeout_s)

    def _wait_until(self, what: str, up: Callable[[Any], bool], timeout_s: float) -> None:
        """Poll ``up(client)`` on db 0 until it is true; raise if a child exits or time runs out."""
        client = self.redis_client(0)
        try:
            deadline = time.monotonic() + timeout_s
            while not up(client):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} not up in {timeout_s:g}s")
                time.sleep(0.05)
        finally:
            client.close()

    def log(self, name: str) -> str:
        """The end of ``name``'s log, for error messages."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if path.exists() else ""

    def pids(self) -> dict[str, int]:
        """Pids of the running children, and of the embedded redis-server as ``redis-server``."""
        out = {name: proc.pid for name, proc in self.procs.items() if proc.poll() is None}
        if self.server is not None and self.server.process is not None:
            out["redis-server"] = self.server.process.pid
        return out

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int | None:
        """Send ``sig`` to ``name`` and wait for it (killing it after ``timeout_s``); its exit code.

        The process leaves :attr:`procs`; None when no process has that name.
        """
        proc = self.procs.pop(name, None)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._close_log(name)
        return proc.returncode

    def kill(self, name: str) -> int | None:
        """``SIGKILL`` to ``name``: a crash, with no chance to clean up."""
        return self.stop(name, signal.SIGKILL)

    def stop_all(self, timeout_s: float = 30) -> None:
        """Stop every child: one SIGTERM to each so they wind down together, a kill past ``timeout_s``."""
        with _SIGTERM.deferred():  # a SIGTERM meanwhile is raised by close(), once all is stopped
            stopping = list(self.procs.items())
            for _, proc in stopping:
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + timeout_s
            for name, proc in stopping:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                self.procs.pop(name, None)
                self._close_log(name)

    def close(self) -> None:
        """Stop every child, then the redis-server this harness started and its temporary files.

        A SIGTERM that comes meanwhile is raised (as :class:`Terminated`) once they are stopped."""
        with _SIGTERM.deferred():
            self.stop_all()
            if self._own_server and self.server is not None:
                self.server.cleanup()
                self.server = None
                self._own_server = False
            if self._own_log_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)
        if self._traps_sigterm:
            self._traps_sigterm = False
            _SIGTERM.release()
        _SIGTERM.raise_pending()

    def _trap_sigterm(self) -> None:
        if not self._traps_sigterm:
            self._traps_sigterm = _SIGTERM.acquire()

    def _close_log(self, name: str) -> None:
        log = self._logs.pop(name, None)
        if log is not None:
            log.close()


def release_result_consumer(celery_app: Any = None) -> None:
    """Unsubscribe this process from result pub/sub before its Redis goes away.

    Otherwise AsyncResults collected later try to unsubscribe through Celery's reconnect loop, which
    retries for minutes against a server that is gone. ``celery_app`` defaults to carpool's own app,
    if this process has loaded it.
    """
    import gc

    if celery_app is None:
        if "carpool.celery_edge.app" not in sys.modules:
            return
        from carpool.celery_edge.app import app as celery_app

    gc.collect()
    celery_app.backend.result_consumer.release()
