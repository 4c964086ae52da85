"""The in-process asyncio dynamic batcher under the bench: the same bursts and arrivals, no Redis."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from carpool.tools.arrivals import poisson_times
from carpool.tools.bench.asyncio_batcher import AsyncBatcher
from carpool.tools.bench.measure import RunRecord, make_record
from carpool.tools.bench.offline import load_model
from carpool.tools.bench.procstat import cpu_usage, this_process


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
        cpu = this_process()
        batcher, latencies, failed, wall = self._drive(texts, offsets)
        usage = cpu_usage(cpu, this_process(), len(texts))
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
        return self._record(
            "rate", texts, poisson_times(len(texts), rate_rps, seed, first_at_zero=False), rate_rps
        )

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
