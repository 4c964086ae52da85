"""Driving a system through Redis, as an application would: the same producer and clock for every one.

Requests go out with ``carpool.producer`` (pipelined publish, one MGET plus pub/sub to collect).
A request's latency is the time its result was stored (``date_done``, written by whoever stored it)
minus its scheduled arrival, so the producer's own collection speed does not enter the figures.
Open-loop runs send each Poisson arrival when it is due (arrivals that fall due together go out in one
publish) whether or not earlier requests finished.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from carpool.tools.arrivals import poisson_times
from carpool.tools.bench.env import BenchEnv, BenchError
from carpool.tools.bench.measure import RunRecord, make_record
from carpool.tools.bench.procstat import cpu_usage

if TYPE_CHECKING:
    from celery.result import AsyncResult

# Messages per MULTI/EXEC when a burst is sent (submit_many's chunk_size): the systems start on the
# first chunk while the producer builds the rest, as an application streaming its work would.
SEND_CHUNK = 500
# Counters reach Redis a moment after the results they count (the coordinator writes them every
# quarter second): waited out after a run, and after a warm-up so that its batches count in no run.
SETTLE_S = 0.6


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


class CelerySystem:
    """Common driver: burst, open-loop rate and light-load runs through the bulk client."""

    name = "?"

    def __init__(self, env: BenchEnv, timeout_s: float = 600.0) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.model = env.model
        #: the last run's request ids and values (an exception for a failed request), in send order
        self.last_ids: list[str] = []
        self.last_values: list[Any] = []
        self.last_done: list[float] = []  # when each result of the last collect was stored (its date_done)

    # subclasses ---------------------------------------------------------------------------------
    def start(self) -> None:
        raise NotImplementedError

    def send(self, texts: Sequence[str], sent_at: float) -> list[AsyncResult]:
        """``carpool.infer`` for every text, stamped with ``sent_at``, streamed in chunks of
        ``SEND_CHUNK`` (one MULTI/EXEC each) so the system under test starts on the first while the
        rest are built; every system is sent to the same way."""
        from carpool.names import SENT_AT_HEADER
        from carpool.producer.submit import submit_many

        return submit_many(
            texts,
            model=self.model,
            app=self.env.app,
            headers={SENT_AT_HEADER: sent_at},
            chunk_size=SEND_CHUNK,
        )

    def send_one(self, text: Any, sent_at: float) -> AsyncResult:
        """One request, as a caller sends one (carpool's system: ``infer.delay(text, model)``)."""
        return self.send([text], sent_at)[0]

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

        from carpool.producer.gather import gather

        results = self.send(texts, time.time())
        deadline = time.monotonic() + timeout_s
        while True:
            self.env.check_alive()
            try:
                gather(results, timeout=2.0, return_exceptions=True)
                time.sleep(SETTLE_S)
                return
            except CeleryTimeout:
                if time.monotonic() > deadline:
                    raise BenchError(f"{self.name}: no answer to the warm-up in {timeout_s:.0f}s") from None

    def _collect(self, results: list[AsyncResult], arrivals: list[float]) -> tuple[list[float], int, float]:
        from carpool.producer.gather import gather

        values = gather(results, timeout=self.timeout_s, return_exceptions=True)
        self.last_ids = [r.id for r in results]
        self.last_values = values
        latencies = []
        failed = 0
        last = 0.0
        self.last_done = []
        for r, value, arrived in zip(results, values, arrivals, strict=True):
            done = _done_at(r)
            self.last_done.append(done)
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
        settle_s: float = SETTLE_S,
        commands_before: dict[str, int] | None = None,
        cpu_before: dict[str, float] | None = None,
    ) -> RunRecord:
        latencies, failed, last = self._collect(results, arrivals)
        cpu_after = self.env.cpu_seconds()
        time.sleep(settle_s)
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
        # The service's own rate: the requests it completed once the publish had returned, over that
        # time. A streamed publish reaches the service chunk by chunk, so some were served during it.
        end = start + record.wall_s
        after = sum(1 for done in self.last_done if done > published)
        record.extra["publish_s"] = published - start
        record.extra["served_during_publish"] = len(results) - after
        record.extra["service_rps"] = after / (end - published) if end > published else None
        return record

    def rate(self, texts: Sequence[str], lengths: Sequence[int], rate_rps: float, seed: int) -> RunRecord:
        offsets = poisson_times(len(texts), rate_rps, seed, first_at_zero=False)
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
        """One short request at a time, each ``.delay()`` then ``.get()`` as an online caller sends
        it; latency as the caller sees it (send to value in hand)."""
        self.send_one(text, time.time()).get(timeout=self.timeout_s)  # a discarded round: connections
        latencies = []
        cpu = self.env.cpu_seconds()
        for _ in range(count + 1):
            t0 = time.perf_counter()
            self.send_one(text, time.time()).get(timeout=self.timeout_s)
            latencies.append(time.perf_counter() - t0)
        latencies = latencies[1:]
        usage = cpu_usage(cpu, self.env.cpu_seconds(), count + 1)
        record = make_record(self.name, "light", latencies, wall_s=sum(latencies), **usage)
        if model_ms is not None:
            record.extra["model_ms"] = model_ms
            record.extra["overhead_p50_ms"] = record.latency_ms["p50"] - model_ms
        return record
