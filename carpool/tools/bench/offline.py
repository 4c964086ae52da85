"""The model alone in this process, no queue: the ceiling every served system is measured against."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from carpool.tools.bench.measure import RunRecord, make_record
from carpool.tools.bench.procstat import cpu_usage, this_process
from carpool.tools.stats import percentile


def load_model(name: str) -> Any:
    """``name`` loaded in this process as a worker would load it (``CARPOOL_DEVICE``,
    ``CARPOOL_AUTOCAST_BF16``): the ceiling is the same model's, at the same precision."""
    from carpool.gpu_worker.runner import loaded_model

    device, autocast_bf16 = model_placement()
    return loaded_model(name, device, autocast_bf16)


def model_placement() -> tuple[str, bool]:
    """The device and bf16 autocast this environment's settings give a worker's models."""
    from carpool.config import load_settings
    from carpool.gpu_worker.runner import pick_device

    settings = load_settings()
    return pick_device(settings.device), settings.autocast_bf16


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
        cpu = this_process()
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
        usage = cpu_usage(cpu, this_process(), len(texts))
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

    load_model(model_name)
    device, autocast_bf16 = model_placement()
    run_single(model_name, text, device, autocast_bf16)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_single(model_name, text, device, autocast_bf16)
        times.append(time.perf_counter() - t0)
    return percentile(times, 50) * 1000
