"""A FIFO dynamic batcher on one asyncio event loop: the in-process way of batching a model."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from carpool.tools.bench.offline import load_model


class AsyncBatcher:
    """A batch leaves when it holds ``max_batch`` requests or its oldest request has waited
    ``max_wait_s``; the model runs in one executor thread so the loop keeps taking requests."""

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
