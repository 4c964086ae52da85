"""``carpool demo``: the whole path on one machine, then a report.

With no ``CARPOOL_BROKER_URL`` set it starts an embedded redis-server; it starts a coordinator and
worker(s) as real processes, sends a burst of mixed-length texts through ``infer.delay()``, gets
every result, and prints throughput, latency percentiles, batch sizes and padding next to the
model's own offline throughput on the same texts (length-sorted batches, in this process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import IO, Any

from carpool.tools.bench.measure import percentile
from carpool.tools.embedded import EmbeddedRedis


@dataclass
class RunStats:
    requests: int
    wall_s: float
    latencies_s: list[float]
    batch_sizes: Counter[int]
    padded_tokens: int
    real_tokens: int
    flush: Counter[str]

    @property
    def throughput(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def padding_ratio(self) -> float:
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0


class Stack:
    """Embedded Redis (when no broker is configured), a coordinator and workers as processes."""

    def __init__(
        self,
        workers: int = 1,
        env: dict[str, str] | None = None,
        log_dir: str | None = None,
        external: bool = False,
    ) -> None:
        self.workers = workers
        self.external = external
        self.extra_env = env or {}
        self.log_dir = log_dir
        self.redis: EmbeddedRedis | None = None
        self.processes: list[subprocess.Popen[bytes]] = []
        self._stack = ExitStack()

    def __enter__(self) -> Stack:
        if "CARPOOL_BROKER_URL" not in os.environ and "CARPOOL_BROKER_URL" not in self.extra_env:
            self.redis = self._stack.enter_context(EmbeddedRedis())
            os.environ["CARPOOL_BROKER_URL"] = self.redis.url(0)
            os.environ["CARPOOL_RESULT_BACKEND"] = self.redis.url(1)
        os.environ.update(self.extra_env)
        self._stack.callback(self.stop)
        if self.external:  # a running deployment serves; this process only produces
            return self
        self.processes.append(self._spawn("coordinator"))
        for _ in range(self.workers):
            self.processes.append(self._spawn("worker"))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _spawn(self, role: str) -> subprocess.Popen[bytes]:
        out: int | IO[bytes] = subprocess.DEVNULL
        if self.log_dir:
            log = open(os.path.join(self.log_dir, f"{role}-{len(self.processes)}.log"), "wb")  # noqa: SIM115
            self._stack.callback(log.close)
            out = log
        return subprocess.Popen(
            [sys.executable, "-m", "carpool", role, "--loglevel", "warning"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        from carpool.celery_edge.app import app as celery_app
        from carpool.celery_edge.app import settings_of
        from carpool.redis_edge.keys import Keys
        from carpool.redis_edge.store import RequestStore

        settings = settings_of(celery_app)
        import redis

        store = RequestStore(redis.Redis.from_url(settings.broker_url), Keys(settings.request_queue), 1)
        deadline = time.monotonic() + timeout_s
        needed = 1 if self.external else self.workers
        while store.live_workers() < needed:
            for proc in self.processes:
                if proc.poll() is not None:
                    raise RuntimeError(f"a carpool process exited early with code {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not come up in time")
            time.sleep(0.1)

    def stop(self) -> None:
        release_result_consumer()
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def release_result_consumer(celery_app: Any = None) -> None:
    """Unsubscribe this process from result pub/sub before its Redis goes away.

    Otherwise AsyncResults collected later try to unsubscribe through Celery's reconnect loop, which
    retries for minutes against a server that is gone.
    """
    import gc

    if celery_app is None:
        if "carpool.celery_edge.app" not in sys.modules:
            return
        from carpool.celery_edge.app import app as celery_app

    gc.collect()
    consumer = celery_app.backend.result_consumer
    # The connection may already be broken; we are letting go of it anyway.
    with contextlib.suppress(Exception):
        consumer.stop()
    consumer._pubsub = None
    consumer.subscribed_to.clear()


def coordinator_stats() -> dict[str, float]:
    import redis

    from carpool.celery_edge.app import app, settings_of
    from carpool.redis_edge.keys import Keys

    settings = settings_of(app)
    raw = redis.Redis.from_url(settings.broker_url).hgetall(Keys(settings.request_queue).stats)
    return {(k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in raw.items()}


def send_burst(texts: Sequence[str], progress: object | None = None) -> RunStats:
    """Send every text with ``infer.delay()``, get every result in submission order, measure."""
    from carpool.tasks import infer

    before = coordinator_stats()
    t0 = time.time()
    sent = [(time.time(), infer.delay(text)) for text in texts]
    latencies = []
    last_done = t0
    for sent_at, result in sent:
        result.get(timeout=300)
        done = result.date_done.timestamp()
        latencies.append(done - sent_at)
        last_done = max(last_done, done)
        if progress is not None:
            progress.advance()  # type: ignore[attr-defined]
    # Let the coordinator write its counters after the last batch report.
    time.sleep(0.6)
    after = coordinator_stats()
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    sizes = Counter({int(k.split(":", 1)[1]): int(v) for k, v in diff.items() if k.startswith("size:") and v})
    flush = Counter({k.split(":", 1)[1]: int(v) for k, v in diff.items() if k.startswith("flush:") and v})
    return RunStats(
        len(texts),
        last_done - t0,
        latencies,
        sizes,
        int(diff.get("padded_tokens", 0)),
        int(diff.get("real_tokens", 0)),
        flush,
    )


def offline_throughput(model_name: str, texts: Sequence[str], max_batch: int) -> float:
    """The model alone, in this process: length-sorted batches of ``max_batch``, no queue."""
    from carpool.gpu_worker.runner import loaded_model, pick_device, run_padded

    model = loaded_model(model_name, pick_device("auto"))
    t0 = time.perf_counter()
    encoded = sorted(model.encode(list(texts)), key=len)
    for start in range(0, len(encoded), max_batch):
        chunk = encoded[start : start + max_batch]
        run_padded(model, chunk, [len(c) for c in chunk])
    return len(texts) / (time.perf_counter() - t0)


def redact(url: str) -> str:
    """``url`` with any password replaced, for printing."""
    from kombu.utils.url import maybe_sanitize_url

    return str(maybe_sanitize_url(url))


def run_demo(requests: int = 300, seed: int = 0, workers: int = 1, external: bool = False) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from carpool.tools.workload import describe, mixed_texts

    console = Console()
    texts = mixed_texts(requests, seed)
    if external and "CARPOOL_BROKER_URL" not in os.environ:
        console.print("[red]--external needs CARPOOL_BROKER_URL pointing at a running carpool deployment[/]")
        return 2
    with Stack(workers=workers, external=external) as stack:
        from carpool.celery_edge.app import app, settings_of

        settings = settings_of(app)
        where = stack.redis.url(0) if stack.redis else redact(settings.broker_url)
        console.print(f"[bold]carpool demo[/]: broker {where}, model {settings.model}, {workers} worker(s)")
        with console.status("starting coordinator and worker (loading the model)..."):
            stack.wait_ready()
            from carpool.tasks import infer

            infer.delay("warm up").get(timeout=120)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as bar:
            task = bar.add_task(f"{requests} texts through infer.delay()", total=requests)

            class _Advance:
                def advance(self) -> None:
                    bar.advance(task)

            stats = send_burst(texts, _Advance())
    with console.status("measuring the model offline on the same texts..."):
        offline = offline_throughput(settings.model, texts, settings.max_batch)

    table = Table(title=f"{requests} mixed-length texts ({describe()}), one burst")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("end-to-end throughput (carpool)", f"{stats.throughput:.1f} texts/s")
    table.add_row("offline limit (model alone, length-sorted)", f"{offline:.1f} texts/s")
    table.add_row("carpool / offline", f"{stats.throughput / offline:.2f}")
    for q in (50, 95, 99):
        table.add_row(f"latency p{q}", f"{percentile(stats.latencies_s, q) * 1000:.0f} ms")
    mean_size = sum(k * v for k, v in stats.batch_sizes.items()) / max(1, sum(stats.batch_sizes.values()))
    table.add_row("batches", f"{sum(stats.batch_sizes.values())} (mean size {mean_size:.1f})")
    table.add_row("batch sizes", " ".join(f"{k}x{v}" for k, v in sorted(stats.batch_sizes.items())))
    table.add_row("padding ratio (padded / real tokens)", f"{stats.padding_ratio:.2f}")
    table.add_row("flush reasons", " ".join(f"{k}={v}" for k, v in sorted(stats.flush.items())))
    console.print(table)
    return 0
