"""``carpool.tools.arrivals.poisson_times``: the one Poisson arrival process of simulate and bench."""

from __future__ import annotations

import math

import pytest

from carpool.tools.arrivals import poisson_times


def test_first_at_zero_starts_the_run_with_a_request() -> None:
    times = poisson_times(50, 10.0, seed=1, first_at_zero=True)
    assert times[0] == 0.0
    assert times == sorted(times) and len(times) == 50


def test_otherwise_the_first_request_comes_one_gap_after_zero() -> None:
    at_zero = poisson_times(50, 10.0, seed=1, first_at_zero=True)
    after_gap = poisson_times(50, 10.0, seed=1, first_at_zero=False)
    assert after_gap[0] > 0.0
    # The same draws: the process is the same, only the arrival at time 0 is left out.
    assert after_gap[:-1] == at_zero[1:]


def test_same_seed_same_gaps_scaled_to_any_rate() -> None:
    slow = poisson_times(200, 10.0, seed=4, first_at_zero=True)
    fast = poisson_times(200, 40.0, seed=4, first_at_zero=True)
    assert fast == pytest.approx([t / 4 for t in slow])
    assert poisson_times(200, 10.0, seed=5, first_at_zero=True) != slow


def test_the_mean_gap_is_one_over_the_rate() -> None:
    times = poisson_times(20_000, 50.0, seed=0, first_at_zero=False)
    assert times[-1] / len(times) == pytest.approx(1 / 50, rel=0.05)


def test_infinite_rate_is_a_burst_and_a_rate_must_be_positive() -> None:
    assert poisson_times(5, math.inf, first_at_zero=False) == [0.0] * 5
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            poisson_times(5, bad, first_at_zero=True)
