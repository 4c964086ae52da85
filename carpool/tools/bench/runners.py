"""The systems ``carpool bench`` compares, and how each is driven.

Every networked system (carpool, plain Celery, celery-batches) shares one embedded redis-server, one
producer (``carpool.producer.client``: pipelined publish, one MGET plus pub/sub to collect) and one clock:
a request's latency is the time its result was stored (``date_done``, written by whoever stored it)
minus its scheduled arrival, so the producer's own collection speed does not enter the figures.
Open-loop runs send each Poisson arrival when it is due (arrivals that fall due together go out in one
publish) whether or not earlier requests finished. Only one system's processes run at a time, and
Redis is flushed between systems.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool.tools.bench.measure import RunRecord, make_record, one_by_one_padding, poisson_arrivals
from carpool.tools.demo import release_result_consumer

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

    from carpool.tools.embedded import EmbeddedRedis

# Messages per MULTI/EXEC when a burst is sent (submit_many's chunk_size): the systems start on the
# first chunk while the producer builds the rest, as an application streaming its work would.
SEND_CHUNK = 500


class BenchError(RuntimeError):
    """A system could not be started or did not answer; the report records it and moves on."""


# --- environment: redis-server, the producer app, child processes -------------------------------


class BenchEnv:
    """An embedded redis-server, a producer Celery app bound to it, and the processes under test."""

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
    ) -> None:
        self.torch_threads = torch_threads
        self.out_dir = out_dir
        self.profile_dir = out_dir / "profiles" if profile else None
        self._profiles: dict[str, Path] = {}
        self.log_dir = out_dir / "logs"
        self.model = model
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.workers = workers
        self.models = tuple(dict.fromkeys((model, *extra_models)))
        self.redis: EmbeddedRedis | None = None
        self.app: Celery | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []

    def __enter__(self) -> BenchEnv:
        from carpool.celery_edge.app import create_app
        from carpool.config import load_settings
        from carpool.tools.embedded import EmbeddedRedis

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = EmbeddedRedis().start()
        settings = load_settings(
            broker_url=self.redis.url(0),
            result_backend=self.redis.url(1),
            model=self.model,
            models=self.models,
            max_batch=self.max_batch,
            max_wait_s=self.max_wait_s,
        )
        self.app = create_app(settings)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        if self.app is not None:
            release_result_consumer(self.app)
        if self.redis is not None:
            self.redis.cleanup()
        for f in self._logs:
            f.close()

    @property
    def settings(self) -> Any:
        assert self.app is not None
        return self.app.carpool_settings

    def redis_client(self, db: int = 0) -> Any:
        import redis

        assert self.redis is not None
        return redis.Redis.from_url(self.redis.url(db))

    def child_env(self, **overrides: str) -> dict[str, str]:
        assert self.redis is not None
        env = dict(os.environ)
        env.update(
            CARPOOL_BROKER_URL=self.redis.url(0),
            CARPOOL_RESULT_BACKEND=self.redis.url(1),
            CARPOOL_MODEL=self.model,
            CARPOOL_MODELS=self.model,
            CARPOOL_MAX_BATCH=str(self.max_batch),
            CARPOOL_MAX_WAIT_S=str(self.max_wait_s),
            CARPOOL_METRICS_PORT="0",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        if self.torch_threads:
            env["CARPOOL_TORCH_THREADS"] = str(self.torch_threads)
        env.update(overrides)
        return env

    def spawn(self, name: str, module_argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start ``python -m <module_argv>`` (under cProfile with ``--profile``); logs in logs/<name>.log."""
        argv = [sys.executable, "-m", *module_argv]
        if self.profile_dir is not None:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            n = sum(1 for k in self._profiles if k.startswith(name + "-"))
            path = self.profile_dir / f"{name}-{n}.prof"
            self._profiles[f"{name}-{n}"] = path
            argv = [sys.executable, "-m", "cProfile", "-o", str(path), "-m", *module_argv]
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        self._logs.append(log)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def summarize_profiles(self) -> list[str]:
        """A text summary (top functions by cumulative and own time) next to each .prof file written."""
        import io
        import pstats

        written = []
        for key, path in self._profiles.items():
            if not path.exists() or path.with_suffix(".txt").exists():
                continue
            buf = io.StringIO()
            stats = pstats.Stats(str(path), stream=buf)
            stats.strip_dirs().sort_stats("cumulative").print_stats(45)
            stats.sort_stats("tottime").print_stats(30)
            path.with_suffix(".txt").write_text(buf.getvalue())
            written.append(key)
        return written

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise BenchError(f"{name} exited with {proc.returncode}; see {self.log_dir / name}.log")

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def flush(self) -> None:
        self.redis_client(0).flushall()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each process under test, redis-server and this producer, plus
        the machine's busy time (see :func:`cpu_snapshot`)."""
        pids = {name: proc.pid for name, proc in self.procs.items() if proc.poll() is None}
        if self.redis is not None and self.redis.process is not None:
            pids["redis-server"] = self.redis.process.pid
        pids["producer"] = os.getpid()
        return cpu_snapshot(pids)


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each pid, and ``_busy`` (CPU seconds the whole machine spent busy)
    and ``_wall`` (a monotonic clock), so a run can tell how much CPU something else took from it.
    Linux /proc only; elsewhere just ``_wall``."""
    out = {"_wall": time.monotonic()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    try:
        cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        out["_busy"] = (sum(cpu[:8]) - cpu[3] - cpu[4]) / tick  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        pass
    return out


def cpu_usage(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, Any]:
    """Per-request CPU of each process, and the cores that processes outside the run kept busy."""
    ours = [k for k in after if not k.startswith("_") and k in before]
    out: dict[str, Any] = {
        "cpu_ms_per_request": {k: round(1000 * (after[k] - before[k]) / max(1, requests), 4) for k in ours}
    }
    wall = after["_wall"] - before["_wall"]
    if "_busy" in after and "_busy" in before and wall > 0:
        other = (after["_busy"] - before["_busy"]) - sum(after[k] - before[k] for k in ours)
        out["background_cpu_cores"] = round(max(0.0, other) / wall, 3)
    return out


def _done_at(result: AsyncResult) -> float:
    done = result.date_done
    if isinstance(done, str):
        done = datetime.fromisoformat(done)
    if done is None:
        return time.time()
    if done.tzinfo is None:
        done = done.replace(tzinfo=UTC)
    return float(done.timestamp())


def counters_since(before: dict[str, float], after: dict[str, float]) -> tuple[Counter[int], int, int]:
    """(batch sizes, padded tokens, real tokens) added to a counter hash between two snapshots."""
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    sizes = Counter({int(k.split(":", 1)[1]): int(v) for k, v in diff.items() if k.startswith("size:") and v})
    return sizes, int(diff.get("padded_tokens", 0)), int(diff.get("real_tokens", 0))


# --- systems driven through Redis -----------------------------------------------------------------


class CelerySystem:
    """Common driver: burst, open-loop rate and light-load runs through the bulk client."""

    name = "?"

    def __init__(self, env: BenchEnv, timeout_s: float = 600.0) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.model = env.model

    # subclasses ---------------------------------------------------------------------------------
    def start(self) -> None:
        raise NotImplementedError

    def send(self, texts: Sequence[str], sent_at: float) -> list[AsyncResult]:
        """``carpool.infer`` for every text, stamped with ``sent_at``, streamed in chunks of
        ``SEND_CHUNK`` (one MULTI/EXEC each) so the system under test starts on the first while the
        rest are built; every system is sent to the same way."""
        from carpool.names import SENT_AT_HEADER
        from carpool.producer.client import submit_many

        return submit_many(
            texts,
            model=self.model,
            app=self.env.app,
            headers={SENT_AT_HEADER: sent_at},
            chunk_size=SEND_CHUNK,
        )

    def spawn_celery_worker(self, name: str, hostname: str, queue: str, *extra: str) -> None:
        """A baseline ``celery worker`` (solo pool, no gossip/mingle/heartbeat) on ``queue``."""
        argv = [
            "celery",
            "-A",
            "carpool.tools.bench.baselines",
            "worker",
            "-Q",
            queue,
            "--pool",
            "solo",
            *extra,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel",
            "warning",
            "-n",
            f"{hostname}-{os.getpid()}@%h",
        ]
        self.env.spawn(name, argv, self.env.child_env())

    def snapshot(self) -> dict[str, float]:
        return {}

    def batches_since(
        self, before: dict[str, float], lengths: Sequence[int]
    ) -> tuple[Counter[int], int | None, int | None]:
        return Counter(), None, None

    def stop(self) -> None:
        self.env.stop_all()

    # shared -------------------------------------------------------------------------------------
    def warm_up(self, texts: Sequence[str], timeout_s: float = 300.0) -> None:
        """Send ``texts`` and wait for every answer, watching that the processes stay up."""
        from celery.exceptions import TimeoutError as CeleryTimeout

        from carpool.producer.client import gather

        results = self.send(texts, time.time())
        deadline = time.monotonic() + timeout_s
        while True:
            self.env.check_alive()
            try:
                gather(results, timeout=2.0, return_exceptions=True)
                return
            except CeleryTimeout:
                if time.monotonic() > deadline:
                    raise BenchError(f"{self.name}: no answer to the warm-up in {timeout_s:.0f}s") from None

    def _collect(self, results: list[AsyncResult], arrivals: list[float]) -> tuple[list[float], int, float]:
        from carpool.producer.client import gather

        values = gather(results, timeout=self.timeout_s, return_exceptions=True)
        latencies = []
        failed = 0
        last = 0.0
        for r, value, arrived in zip(results, values, arrivals, strict=True):
            done = _done_at(r)
            last = max(last, done)
            if isinstance(value, BaseException):
                failed += 1
            else:
                latencies.append(max(0.0, done - arrived))
        return latencies, failed, last

    def _record(
        self,
        mode: str,
        results: list[AsyncResult],
        arrivals: list[float],
        lengths: Sequence[int],
        before: dict[str, float],
        offered: float | None = None,
        settle_s: float = 0.6,
        commands_before: dict[str, int] | None = None,
        cpu_before: dict[str, float] | None = None,
    ) -> RunRecord:
        latencies, failed, last = self._collect(results, arrivals)
        cpu_after = self.env.cpu_seconds()
        time.sleep(settle_s)  # counters reach Redis a moment after the last result
        sizes, padded, real = self.batches_since(before, lengths)
        extra: dict[str, Any] = {}
        if cpu_before is not None:
            extra.update(cpu_usage(cpu_before, cpu_after, len(results)))
        if commands_before is not None:
            after = self._commandstats()
            calls = {
                k: v - commands_before.get(k, 0) for k, v in after.items() if v - commands_before.get(k, 0)
            }
            calls.pop("info", None)
            extra["redis_commands"] = dict(sorted(calls.items(), key=lambda kv: -kv[1]))
            extra["redis_commands_per_request"] = sum(calls.values()) / max(1, len(results))
        return make_record(
            self.name,
            mode,
            latencies,
            wall_s=last - arrivals[0],
            failed=failed,
            offered_rps=offered,
            sizes=sizes,
            padded_tokens=padded,
            real_tokens=real,
            **extra,
        )

    def _commandstats(self) -> dict[str, int]:
        """Calls per Redis command so far (all clients: the system's processes and this producer)."""
        stats = self.env.redis_client(0).info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}

    def burst(self, texts: Sequence[str], lengths: Sequence[int]) -> RunRecord:
        before = self.snapshot()
        commands = self._commandstats()
        cpu = self.env.cpu_seconds()
        start = time.time()
        results = self.send(texts, start)
        published = time.time()
        record = self._record(
            "burst",
            results,
            [start] * len(results),
            lengths,
            before,
            commands_before=commands,
            cpu_before=cpu,
        )
        # The producer's share: until the pipelined publish returned, no request had reached the service.
        end = start + record.wall_s
        record.extra["publish_s"] = published - start
        record.extra["service_rps"] = len(results) / (end - published) if end > published else None
        return record

    def rate(self, texts: Sequence[str], lengths: Sequence[int], rate_rps: float, seed: int) -> RunRecord:
        offsets = poisson_arrivals(len(texts), rate_rps, seed)
        before = self.snapshot()
        commands = self._commandstats()
        cpu = self.env.cpu_seconds()
        start_wall = time.time()
        start = time.perf_counter()
        results: list[AsyncResult] = []
        arrivals: list[float] = []
        i, n = 0, len(texts)
        while i < n:
            now = time.perf_counter() - start
            if offsets[i] > now:
                time.sleep(min(offsets[i] - now, 0.02))
                continue
            j = i + 1
            while j < n and offsets[j] <= now:
                j += 1
            results.extend(self.send(texts[i:j], start_wall + offsets[i]))
            arrivals.extend(start_wall + o for o in offsets[i:j])
            i = j
        record = self._record(
            "rate",
            results,
            arrivals,
            lengths,
            before,
            offered=rate_rps,
            commands_before=commands,
            cpu_before=cpu,
        )
        record.extra["achieved_send_rps"] = n / max(1e-9, arrivals[-1] - arrivals[0]) if n > 1 else None
        return record

    def light(self, text: str, count: int, model_ms: float | None) -> RunRecord:
        """One short request at a time; latency as the caller sees it (send to value in hand)."""
        from carpool.producer.client import gather

        self.send([text], time.time())  # one discarded round, to settle connections
        latencies = []
        cpu = self.env.cpu_seconds()
        for _ in range(count + 1):
            t0 = time.perf_counter()
            gather(self.send([text], time.time()), timeout=self.timeout_s)
            latencies.append(time.perf_counter() - t0)
        latencies = latencies[1:]
        usage = cpu_usage(cpu, self.env.cpu_seconds(), count + 1)
        record = make_record(self.name, "light", latencies, wall_s=sum(latencies), **usage)
        if model_ms is not None:
            record.extra["model_ms"] = model_ms
            record.extra["overhead_p50_ms"] = record.latency_ms["p50"] - model_ms
        return record


class CarpoolSystem(CelerySystem):
    """carpool itself: a coordinator and ``workers`` GPU-worker processes."""

    name = "carpool"

    def __init__(
        self, env: BenchEnv, timeout_s: float = 600.0, extra_env: dict[str, str] | None = None
    ) -> None:
        super().__init__(env, timeout_s)
        self.extra_env = dict(extra_env or {})

    def start(self) -> None:
        from carpool.tools.workload import mixed_texts

        env = self.env.child_env(**self.extra_env)
        self.start_coordinator()
        for i in range(self.env.workers):
            self.env.spawn(
                f"carpool-worker{i}",
                ["carpool", "worker", "--loglevel", "warning"],
                env,
            )
        self.wait_workers()
        self.warm_up(mixed_texts(4 * self.env.max_batch, seed=999))

    def start_coordinator(self, **overrides: str) -> None:
        env = self.env.child_env(**{**self.extra_env, **overrides})
        self.env.spawn(
            "carpool-coordinator",
            ["carpool", "coordinator", "--loglevel", "warning"],
            env,
        )

    def restart_coordinator(self, **overrides: str) -> None:
        """New batching settings: a fresh coordinator (workers keep their loaded model)."""
        from carpool.tools.workload import mixed_texts

        self.env.stop("carpool-coordinator")
        self.start_coordinator(**overrides)
        self.warm_up(mixed_texts(4 * self.env.max_batch, seed=998))

    def wait_workers(self, timeout_s: float = 300.0) -> None:
        from carpool.redis_edge.keys import Keys
        from carpool.redis_edge.store import RequestStore

        store = RequestStore(self.env.redis_client(0), Keys(self.env.settings.request_queue), 1)
        deadline = time.monotonic() + timeout_s
        while store.live_workers() < self.env.workers:
            self.env.check_alive()
            if time.monotonic() > deadline:
                raise BenchError(f"carpool workers not up in {timeout_s:.0f}s")
            time.sleep(0.1)

    def snapshot(self) -> dict[str, float]:
        from carpool.redis_edge.keys import Keys

        raw = self.env.redis_client(0).hgetall(Keys(self.env.settings.request_queue).stats)
        return {k.decode(): float(v) for k, v in raw.items()}

    def batches_since(
        self, before: dict[str, float], lengths: Sequence[int]
    ) -> tuple[Counter[int], int | None, int | None]:
        return counters_since(before, self.snapshot())


class PlainCelerySystem(CelerySystem):
    """A Celery worker on the request queue itself: ``carpool.infer``'s body, one task per request."""

    name = "celery"

    def start(self) -> None:
        from carpool.tools.workload import mixed_texts

        self.spawn_celery_worker("celery-plain", "bench-plain", self.env.settings.request_queue)
        self.warm_up(mixed_texts(8, seed=999))

    def batches_since(
        self, before: dict[str, float], lengths: Sequence[int]
    ) -> tuple[Counter[int], int | None, int | None]:
        padded, real = one_by_one_padding(lengths)
        return Counter({1: len(lengths)}), padded, real


class CeleryBatchesSystem(CelerySystem):
    """celery-batches: the worker buffers requests and runs each flush as one FIFO batch."""

    name = "celery-batches"

    def start(self) -> None:
        from carpool.tools.workload import mixed_texts

        # A prefetch of 0 reads as "not given" on the CLI; 10000 lets a flush fill up (see docs).
        self.spawn_celery_worker(
            "celery-batches", "bench-batches", self._queue(), "--prefetch-multiplier", "10000"
        )
        self.warm_up(mixed_texts(4 * self.env.max_batch, seed=999))

    @staticmethod
    def _queue() -> str:
        from carpool.tools.bench.baselines import BATCHED_QUEUE

        return BATCHED_QUEUE

    def send(self, texts: Sequence[str], sent_at: float) -> list[AsyncResult]:
        from carpool.names import SENT_AT_HEADER
        from carpool.producer.client import publish_tasks
        from carpool.tools.bench.baselines import BATCHED_QUEUE, BATCHED_TASK

        return publish_tasks(
            BATCHED_TASK,
            [((t,), {}) for t in texts],
            app=self.env.app,
            queue=BATCHED_QUEUE,
            headers={SENT_AT_HEADER: sent_at},
            chunk_size=SEND_CHUNK,
        )

    def snapshot(self) -> dict[str, float]:
        from carpool.tools.bench.baselines import STATS_KEY

        assert self.env.app is not None
        raw = self.env.app.backend.client.hgetall(STATS_KEY)
        return {k.decode(): float(v) for k, v in raw.items()}

    def batches_since(
        self, before: dict[str, float], lengths: Sequence[int]
    ) -> tuple[Counter[int], int | None, int | None]:
        return counters_since(before, self.snapshot())


# --- in-process systems -----------------------------------------------------------------------------


def load_model(name: str) -> Any:
    from carpool.gpu_worker.runner import loaded_model, pick_device

    return loaded_model(name, pick_device("auto"))


def offline(model_name: str, texts: Sequence[str], max_batch: int, passes: int = 2) -> RunRecord:
    """The model alone in this process: tokenize, sort by length, batches of ``max_batch``, no queue
    (what sentence-transformers' ``encode`` does). The fastest of ``passes`` passes: the limit."""
    from carpool.batching.bins import padded_length
    from carpool.gpu_worker.runner import run_padded

    model = load_model(model_name)
    warm = sorted(model.encode(list(texts[: 2 * max_batch])), key=len)
    run_padded(model, warm[:max_batch], [len(w) for w in warm[:max_batch]])
    best: RunRecord | None = None
    for _ in range(max(1, passes)):
        cpu = cpu_snapshot({"producer": os.getpid()})
        t0 = time.perf_counter()
        encoded = sorted(model.encode(list(texts)), key=len)
        sizes: Counter[int] = Counter()
        padded = real = 0
        for start in range(0, len(encoded), max_batch):
            chunk = encoded[start : start + max_batch]
            lengths = [len(c) for c in chunk]
            run_padded(model, chunk if model.needs_token_ids else [None] * len(chunk), lengths)
            sizes[len(chunk)] += 1
            padded += padded_length(max(lengths)) * len(chunk)
            real += sum(lengths)
        elapsed = time.perf_counter() - t0
        usage = cpu_usage(cpu, cpu_snapshot({"producer": os.getpid()}), len(texts))
        # Offline has no arrivals: every request "waits" from the start until its batch is done.
        record = make_record(
            "offline",
            "burst",
            [elapsed] * len(texts),
            wall_s=elapsed,
            sizes=sizes,
            padded_tokens=padded,
            real_tokens=real,
            passes=passes,
            **usage,
        )
        if best is None or record.throughput_rps > best.throughput_rps:
            best = record
    assert best is not None
    return best


def model_time_ms(model_name: str, text: str, repeats: int = 20) -> float:
    """Median time of the model on ``text`` alone, tokenizing included (``run_single``)."""
    from carpool.gpu_worker.runner import run_single
    from carpool.tools.bench.measure import percentile

    load_model(model_name)
    run_single(model_name, text)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_single(model_name, text)
        times.append(time.perf_counter() - t0)
    return percentile(times, 50) * 1000


class AsyncBatcher:
    """A FIFO dynamic batcher on one event loop: a batch leaves when it holds ``max_batch`` requests
    or its oldest request has waited ``max_wait_s``; the model runs in one executor thread."""

    def __init__(self, model_name: str, max_batch: int, max_wait_s: float) -> None:
        self.model = load_model(model_name)
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.pending: deque[tuple[str, float, asyncio.Future[Any]]] = deque()
        self.sizes: Counter[int] = Counter()
        self.padded = 0
        self.real = 0
        self._wake: asyncio.Event | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-batcher")

    async def infer(self, text: str) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.pending.append((text, loop.time(), future))
        assert self._wake is not None
        self._wake.set()
        return await future

    def _run(self, texts: list[str]) -> list[tuple[bool, Any]]:
        from carpool.batching.bins import padded_length
        from carpool.gpu_worker.runner import run_isolating

        ids = self.model.encode(texts)
        lengths = [len(i) for i in ids]
        self.padded += padded_length(max(lengths)) * len(lengths)
        self.real += sum(lengths)
        return run_isolating(self.model, ids if self.model.needs_token_ids else [None] * len(ids), lengths)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        while True:
            while not self.pending:
                self._wake.clear()
                await self._wake.wait()
            deadline = self.pending[0][1] + self.max_wait_s
            while len(self.pending) < self.max_batch:
                left = deadline - loop.time()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    break
            batch = [self.pending.popleft() for _ in range(min(self.max_batch, len(self.pending)))]
            self.sizes[len(batch)] += 1
            outcomes = await loop.run_in_executor(self._executor, self._run, [t for t, _, _ in batch])
            for (_, _, future), (ok, out) in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if ok:
                    future.set_result(out)
                else:
                    future.set_exception(out)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class AsyncioSystem:
    """The in-process asyncio dynamic batcher, driven by the same bursts and arrivals."""

    name = "asyncio"

    def __init__(self, model_name: str, max_batch: int, max_wait_s: float) -> None:
        self.model_name = model_name
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s

    def start(self) -> None:
        load_model(self.model_name)

    def stop(self) -> None:
        return None

    def _drive(
        self, texts: Sequence[str], offsets: Sequence[float]
    ) -> tuple[AsyncBatcher, list[float], int, float]:
        batcher = AsyncBatcher(self.model_name, self.max_batch, self.max_wait_s)

        async def main() -> tuple[list[float], int, float]:
            loop = asyncio.get_running_loop()
            server = asyncio.create_task(batcher.serve())
            await asyncio.sleep(0)
            start = loop.time()
            latencies: list[float] = []
            failed = 0
            last = start

            async def one(text: str, due: float) -> None:
                nonlocal failed, last
                try:
                    await batcher.infer(text)
                except Exception:
                    failed += 1
                else:
                    latencies.append(loop.time() - due)
                last = max(last, loop.time())

            tasks = []
            for text, offset in zip(texts, offsets, strict=True):
                delay = start + offset - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(text, start + offset)))
            await asyncio.gather(*tasks)
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
            return latencies, failed, last - start - offsets[0]

        try:
            latencies, failed, wall = asyncio.run(main())
        finally:
            batcher.close()
        return batcher, latencies, failed, wall

    def _record(
        self, mode: str, texts: Sequence[str], offsets: Sequence[float], offered: float | None
    ) -> RunRecord:
        cpu = cpu_snapshot({"producer": os.getpid()})
        batcher, latencies, failed, wall = self._drive(texts, offsets)
        usage = cpu_usage(cpu, cpu_snapshot({"producer": os.getpid()}), len(texts))
        return make_record(
            self.name,
            mode,
            latencies,
            wall_s=wall,
            failed=failed,
            offered_rps=offered,
            sizes=batcher.sizes,
            padded_tokens=batcher.padded,
            real_tokens=batcher.real,
            **usage,
        )

    def burst(self, texts: Sequence[str], lengths: Sequence[int]) -> RunRecord:
        return self._record("burst", texts, [0.0] * len(texts), None)

    def rate(self, texts: Sequence[str], lengths: Sequence[int], rate_rps: float, seed: int) -> RunRecord:
        return self._record("rate", texts, poisson_arrivals(len(texts), rate_rps, seed), rate_rps)

    def light(self, text: str, count: int, model_ms: float | None) -> RunRecord:
        latencies = []
        for _ in range(count):
            _, lat, _, _ = self._drive([text], [0.0])
            latencies.extend(lat)
        record = make_record(self.name, "light", latencies, wall_s=sum(latencies))
        if model_ms is not None:
            record.extra["model_ms"] = model_ms
            record.extra["overhead_p50_ms"] = record.latency_ms["p50"] - model_ms
        return record


SYSTEMS = ("offline", "carpool", "celery", "celery-batches", "asyncio")
# carpool under its other queueing policies, to compare policies in one run (not run by default).
POLICY_SYSTEMS = ("carpool-fifo", "carpool-shortest", "carpool-auto")
