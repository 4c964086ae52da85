"""The bench's environment: the process harness, a producer Celery app bound to its Redis, and the
settings every system under test gets, so they are compared on equal terms."""

from __future__ import annotations

import io
import os
import pstats
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool.tools.bench.procstat import cpu_snapshot
from carpool.tools.harness import Harness, release_result_consumer

if TYPE_CHECKING:
    from celery import Celery


class BenchError(RuntimeError):
    """Raised when a system could not be started or did not answer; the report records it and moves on."""


class BenchEnv:
    """An embedded redis-server, a producer Celery app bound to it, and the processes under test.

    Children log to ``<out_dir>/logs/<name>.log`` and, with ``profile``, run under cProfile
    (``<out_dir>/profiles``). ``unix_socket``: every process reaches the redis-server through its
    Unix socket instead of TCP loopback.
    """

    def __init__(
        self,
        out_dir: Path,
        model: str,
        max_batch: int,
        max_wait_s: float,
        workers: int = 1,
        extra_models: Sequence[str] = (),
        profile: bool = False,
        torch_threads: int = 0,
        coordinators: int = 1,
        unix_socket: bool = False,
    ) -> None:
        self.out_dir = out_dir
        self.model = model
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.workers = workers
        self.coordinators = coordinators
        self.models = tuple(dict.fromkeys((model, *extra_models)))
        self.torch_threads = torch_threads
        self.harness = Harness(
            log_dir=out_dir / "logs",
            loglevel="warning",
            profile_dir=out_dir / "profiles" if profile else None,
            unix_socket=unix_socket,
        )
        self.app: Celery | None = None

    def __enter__(self) -> BenchEnv:
        from carpool.celery_edge.app import create_app
        from carpool.config import load_settings

        self.harness.__enter__()
        settings = load_settings(
            broker_url=self.harness.broker_url,
            result_backend=self.harness.result_backend,
            model=self.model,
            models=self.models,
            max_batch=self.max_batch,
            max_wait_s=self.max_wait_s,
        )
        self.app = create_app(settings)
        return self

    def __exit__(self, *exc: object) -> None:
        self.harness.stop_all()
        if self.app is not None:
            release_result_consumer(self.app)
        self.harness.close()

    @property
    def settings(self) -> Any:
        assert self.app is not None
        from carpool.celery_edge.app import settings_of

        return settings_of(self.app)

    def redis_client(self, db: int = 0) -> Any:
        return self.harness.redis_client(db)

    def child_env(self, **overrides: str) -> dict[str, str]:
        """CARPOOL_* and library settings every child process gets (over the harness's environment)."""
        env = {
            "CARPOOL_MODEL": self.model,
            "CARPOOL_MODELS": self.model,
            "CARPOOL_MAX_BATCH": str(self.max_batch),
            "CARPOOL_MAX_WAIT_S": str(self.max_wait_s),
            "CARPOOL_METRICS_PORT": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        if self.torch_threads:
            env["CARPOOL_TORCH_THREADS"] = str(self.torch_threads)
        env.update(overrides)
        return env

    def check_alive(self) -> None:
        self.harness.check_alive()

    def stop(self, name: str) -> None:
        self.harness.stop(name)

    def stop_all(self) -> None:
        self.harness.stop_all()

    def flush(self) -> None:
        client = self.redis_client(0)
        try:
            client.flushall()
        finally:
            client.close()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each process under test, redis-server and this producer, plus
        the machine's busy time (see :func:`carpool.tools.bench.procstat.cpu_snapshot`)."""
        return cpu_snapshot({**self.harness.pids(), "producer": os.getpid()})

    def summarize_profiles(self) -> list[str]:
        """A text summary (top functions by cumulative and own time) next to each .prof file written."""
        written = []
        for key, path in self.harness.profiles.items():
            if not path.exists() or path.with_suffix(".txt").exists():
                continue
            buf = io.StringIO()
            stats = pstats.Stats(str(path), stream=buf)
            stats.strip_dirs().sort_stats("cumulative").print_stats(45)
            stats.sort_stats("tottime").print_stats(30)
            path.with_suffix(".txt").write_text(buf.getvalue())
            written.append(key)
        return written
