"""Fit the simulator's latency model (seconds = a + b * padded tokens) by timing a real model here."""

from __future__ import annotations

import time
from collections.abc import Sequence

from carpool.batching import padded_length

# (rows, width) shapes timed by calibrate, spanning 16 to 2048 padded tokens (one short text to a full
# batch of medium ones). The first three already span the range, so a budget cut short still fits a
# line over the whole of it instead of extrapolating from small batches.
CALIBRATION_SHAPES = ((1, 16), (8, 64), (32, 64), (4, 32), (16, 64), (8, 32), (32, 32), (16, 128))


def fit_linear(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b * x, both clipped at 0 like the coordinator's fit."""
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        raise ValueError("need at least two distinct x values to fit a line")
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x)
    return max(0.0, mean_y - slope * mean_x), slope


def calibrate(
    model_name: str, device: str = "cpu", budget_s: float = 10.0, repeats: int = 3, threads: int = 0
) -> tuple[float, float]:
    """Fit (a, b) of t = a + b * padded_tokens by timing ``run_padded`` in this process.

    Each shape runs once to warm up, then ``repeats`` times; the median counts (a worker meets
    interference too, so the minimum would flatter it). Timing stops once ``budget_s`` is spent
    (loading the model comes on top), keeping at least three shapes. ``threads`` > 0 times with that
    many torch threads, as a worker with ``CARPOOL_TORCH_THREADS`` runs; torch's own setting is
    restored afterwards.
    """
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _calibrate(model_name, device, budget_s, repeats)
    finally:
        torch.set_num_threads(previous)


def _calibrate(model_name: str, device: str, budget_s: float, repeats: int) -> tuple[float, float]:
    from carpool.gpu_worker.runner import loaded_model, run_padded
    from carpool.tools.workload import mixed_texts

    model = loaded_model(model_name, device)
    t_start = time.perf_counter()
    # Real token ids of the model's own tokenizer, cut to each width (ids from the vocabulary).
    source = max(model.encode(mixed_texts(50, seed=1)), key=len)
    points: list[tuple[float, float]] = []
    for rows, width in CALIBRATION_SHAPES:
        width = min(width, model.max_length, len(source))
        if len(points) >= 3 and time.perf_counter() - t_start > budget_s:
            break
        row = source[:width] if model.needs_token_ids else None
        batch = [row] * rows
        lengths = [width] * rows
        run_padded(model, batch, lengths)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_padded(model, batch, lengths)
            times.append(time.perf_counter() - t0)
        points.append((float(rows * padded_length(width)), sorted(times)[len(times) // 2]))
    return fit_linear(points)
