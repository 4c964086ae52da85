"""``carpool demo``: the whole path on one machine, then a report.

With no ``CARPOOL_BROKER_URL`` set it starts an embedded redis-server; it starts a coordinator and
worker(s) as real processes, sends a burst of mixed-length texts through ``infer.delay()``, gets
every result, and prints throughput, latency percentiles, batch sizes and padding next to the
model's own offline throughput on the same texts (length-sorted batches, in this process).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from carpool import tasks as _tasks  # noqa: F401  (registers carpool.infer on every app made here)
from carpool.celery_edge.app import create_app, settings_of
from carpool.config import Settings, load_settings, redact_url
from carpool.names import INFER_TASK
from carpool.tools.harness import Harness, ProcessExited, release_result_consumer
from carpool.tools.stats import percentile

if TYPE_CHECKING:
    from celery import Celery
    from rich.console import Console


@dataclass
class RunStats:
    requests: int
    wall_s: float
    latencies_s: list[float]
    batch_sizes: Counter[int]
    padded_tokens: int
    real_tokens: int
    flush: Counter[str]
    batch_stats: bool = True  # False: the coordinator's stats were not readable, the batch figures are empty

    @property
    def throughput(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def padding_ratio(self) -> float:
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0


def coordinator_stats(settings: Settings) -> dict[str, float] | None:
    """The coordinator's counters hash, as numbers; None when this Redis user may not read it (a
    producer's user, see ``carpool acl``)."""
    from redis.exceptions import NoPermissionError

    from carpool.redis_edge.connect import client_for
    from carpool.redis_edge.keys import Keys
    from carpool.redis_edge.socket_options import client_options

    client = client_for(settings.broker_url, settings, **client_options(settings))
    try:
        raw = client.hgetall(Keys(settings.request_queue).stats)
    except NoPermissionError:
        return None
    finally:
        client.close()
    return {(k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in raw.items()}


def send_burst(app: Celery, texts: Sequence[str], progress: object | None = None) -> RunStats:
    """Send every text with ``app``'s ``infer.delay()``, get every result in submission order, measure."""
    infer = app.tasks[INFER_TASK]
    settings = settings_of(app)
    # The coordinator writes its counters every quarter second: the warm-up's must be in before.
    time.sleep(0.6)
    before = coordinator_stats(settings)
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
    after = coordinator_stats(settings)
    readable = before is not None and after is not None
    diff: dict[str, float] = {}
    if before is not None and after is not None:
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
        readable,
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


def _burst(
    harness: Harness, settings: Settings, texts: Sequence[str], workers: int, external: bool, console: Console
) -> tuple[Settings, RunStats]:
    """Start the stack (unless ``external``), wait for it, send ``texts`` as one burst; the settings
    the burst went out with, and its measures. The harness's children are stopped on the way out."""
    from redis.exceptions import NoPermissionError
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with harness:
        if harness.embedded:
            settings = load_settings(broker_url=harness.broker_url, result_backend=harness.result_backend)
        app = create_app(settings)
        try:
            if not external:  # else a running deployment serves; this process only produces
                harness.start_stack(workers, wait=False)
            where = harness.broker_url if harness.embedded else redact_url(settings.broker_url)
            serving = "the deployment's running workers" if external else f"{workers} worker(s)"
            console.print(f"[bold]carpool demo[/]: broker {where}, model {settings.model}, {serving}")
            with console.status("starting coordinator and worker (loading the model)..."):
                try:
                    harness.wait_workers(
                        1 if external else workers, timeout_s=180, request_queue=settings.request_queue
                    )
                except NoPermissionError:  # a producer's user: the warm-up request waits for a worker
                    console.print("[dim]this Redis user may not read worker heartbeats; not counting them[/]")
                app.tasks[INFER_TASK].delay("warm up").get(timeout=120)
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
            ) as bar:
                task = bar.add_task(f"{len(texts)} texts through infer.delay()", total=len(texts))

                class _Advance:
                    def advance(self) -> None:
                        bar.advance(task)

                return settings, send_burst(app, texts, _Advance())
        finally:
            release_result_consumer(app)


def run_demo(requests: int = 300, seed: int = 0, workers: int = 1, external: bool = False) -> int:
    from celery.exceptions import TimeoutError as CeleryTimeoutError
    from kombu.exceptions import OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError as RedisResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from rich.console import Console
    from rich.table import Table

    from carpool.errors import CONFIG_ERROR_EXIT, InvalidInput
    from carpool.redis_edge.connect import deployment_hint, missing_database
    from carpool.tools.workload import describe, mixed_texts

    if requests < 1 or workers < 1:
        raise ValueError(f"requests and workers must be >= 1, got {requests} and {workers}")
    console = Console()
    texts = mixed_texts(requests, seed)
    if external and "CARPOOL_BROKER_URL" not in os.environ:
        console.print("[red]--external needs CARPOOL_BROKER_URL pointing at a running carpool deployment[/]")
        return 2
    settings = load_settings()
    if "CARPOOL_BROKER_URL" in os.environ and "CARPOOL_RESULT_BACKEND" not in os.environ:
        from carpool.redis_edge.connect import server_and_db

        if server_and_db(settings.broker_url)[0] != server_and_db(settings.result_backend)[0]:
            # The results would go to the default backend, another server: the demo waited on them
            # two minutes, then died with a traceback.
            print(
                "carpool demo: CARPOOL_BROKER_URL is set and CARPOOL_RESULT_BACKEND is not, so the results"
                f" would go to {redact_url(settings.result_backend)}, another Redis: set"
                " CARPOOL_RESULT_BACKEND too (the broker's server with another database, say .../1)",
                file=sys.stderr,
            )
            return CONFIG_ERROR_EXIT
    if "CARPOOL_BROKER_URL" in os.environ:
        harness = Harness(
            broker_url=settings.broker_url, result_backend=settings.result_backend, loglevel="warning"
        )
    else:
        harness = Harness(loglevel="warning")
    try:
        settings, stats = _burst(harness, settings, texts, workers, external, console)
    except InvalidInput as exc:  # a deployment's settings refuse some of the demo's texts
        # Past the model's window, truncation is the fix; past CARPOOL_MAX_INPUT_BYTES, the error
        # names that setting itself.
        past_window = "window" in str(exc)
        print(
            f"carpool demo: the deployment refused a demo text ({exc}); the demo sends mixed texts "
            "of up to about 1,600 bytes and a few hundred tokens"
            + (
                ", some past the model's window: run it against a deployment that truncates them"
                " (CARPOOL_TRUNCATE=true, the default)"
                if past_window
                else ""
            ),
            file=sys.stderr,
        )
        return 1
    except ProcessExited as exc:  # a coordinator or worker that stopped (a setting it refused)
        print(f"carpool demo: {exc.summary}", file=sys.stderr)
        return CONFIG_ERROR_EXIT if exc.returncode == CONFIG_ERROR_EXIT else 1
    except TimeoutError as exc:  # what the demo waited for (workers up) never came
        print(f"carpool demo: {exc}", file=sys.stderr)
        return 1
    except CeleryTimeoutError:  # a result never came: no worker answering (--external), say
        print(
            "carpool demo: no result came back in time; check that the deployment's coordinator and"
            " workers run (`carpool status`) and share CARPOOL_BROKER_URL and CARPOOL_RESULT_BACKEND"
            " with this process",
            file=sys.stderr,
        )
        return 1
    except RedisResponseError as exc:  # a database the server lacks, say
        missing = missing_database(exc, "CARPOOL_BROKER_URL", "CARPOOL_RESULT_BACKEND")
        print(f"carpool demo: {missing or exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT if missing is not None else 1
    except (RedisConnectionError, RedisTimeoutError, OperationalError) as exc:
        # One line, as `carpool status` says it, rather than the client's traceback; the children the
        # harness started are stopped by now.
        where = "the embedded redis-server" if harness.embedded else redact_url(settings.broker_url)
        hint = deployment_hint(exc, "CARPOOL_BROKER_URL", "CARPOOL_RESULT_BACKEND")
        if hint is not None:  # a setting to change, not an outage to wait out
            print(f"carpool demo: {where}: {hint}", file=sys.stderr)
            return 2
        print(f"carpool demo: redis unavailable at {where}: {exc}", file=sys.stderr)
        return 1
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
    if not stats.batch_stats:
        table.add_row("batches", "(this Redis user may not read the coordinator's stats)")
        console.print(table)
        return 0
    mean_size = sum(k * v for k, v in stats.batch_sizes.items()) / max(1, sum(stats.batch_sizes.values()))
    table.add_row("batches", f"{sum(stats.batch_sizes.values())} (mean size {mean_size:.1f})")
    table.add_row("batch sizes", " ".join(f"{k}x{v}" for k, v in sorted(stats.batch_sizes.items())))
    table.add_row("padding ratio (padded / real tokens)", f"{stats.padding_ratio:.2f}")
    table.add_row("flush reasons", " ".join(f"{k}={v}" for k, v in sorted(stats.flush.items())))
    console.print(table)
    return 0
