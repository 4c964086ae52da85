"""Open-loop Poisson arrival times, defined once for ``carpool simulate`` and ``carpool bench``."""

from __future__ import annotations

import random


def poisson_times(n: int, rate_per_s: float, seed: int = 0, *, first_at_zero: bool) -> list[float]:
    """Times (seconds from the start) of ``n`` Poisson arrivals at ``rate_per_s``, non-decreasing.

    Gaps are exponential with mean ``1 / rate_per_s``. ``first_at_zero`` says where the first
    arrival falls: at 0 (a run that starts with its first request, so ``n`` arrivals span ``n - 1``
    gaps) or one gap after 0 (a process observed from time 0). The same ``seed`` draws the same gaps
    scaled to any rate, so runs across rates compare like with like (common random numbers). An
    infinite rate puts every arrival at 0.
    """
    if not rate_per_s > 0:
        raise ValueError("rate_per_s must be > 0")
    rng = random.Random(f"arrivals:{seed}")
    t = 0.0
    out = []
    for i in range(n):
        if i or not first_at_zero:
            t += rng.expovariate(1.0) / rate_per_s
        out.append(t)
    return out
