"""The soak's judging, on numbers: windows, recovery after a fault, memory flatness, the fault plan."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from carpool.tools.soak import analysis
from carpool.tools.soak.chaos import fault_plan
from carpool.tools.soak.config import FAULT_KINDS, SoakConfig, short_config
from carpool.tools.soak.load import is_named_error
from carpool.tools.soak.model import capacity_rps, pace_from

MIB = analysis.MIB


def window(t: float, p99: float | None, offered: int = 10, answered: int = 10) -> dict[str, Any]:
    return {"t_s": t, "offered": offered, "answered": answered, "p99_ms": p99}


def test_windows_count_offered_by_arrival_and_latency_by_answer() -> None:
    arrivals = [0.5, 1.5, 2.5, 2.6]
    answers = [(0.9, 0.4, True), (2.1, 0.6, True), (2.9, 0.3, True), (3.5, 1.0, False)]
    wins = analysis.windows(arrivals, answers, end_s=4.0, window_s=2.0, min_requests=1)
    assert [(w["offered"], w["answered"]) for w in wins] == [(2, 1), (2, 3)]
    assert wins[1]["p99_ms"] == 600.0, "failures count as answered but not in latency"
    assert analysis.windows(arrivals, answers, 4.0, 2.0, min_requests=3)[0]["p99_ms"] is None


def test_a_fault_recovers_when_every_later_window_is_healthy() -> None:
    wins = [window(0, 100), window(5, 900), window(10, 2000), window(15, 120), window(20, 110)]
    [fault] = analysis.recoveries([{"at_s": 6.0}], wins, 5.0, bound_ms=200, within_s=30, end_s=25)
    assert fault["recovery_s"] == 9.0 and fault["verdict"] == "recovered"


def test_a_window_that_answers_too_little_is_not_healthy() -> None:
    wins = [window(0, 100), window(5, 100, offered=50, answered=3), window(10, 100)]
    [fault] = analysis.recoveries([{"at_s": 5.0}], wins, 5.0, bound_ms=200, within_s=30, end_s=15)
    assert fault["recovery_s"] == 5.0


def test_slow_overlapped_and_never_recovered_faults() -> None:
    wins = [window(t, 5000 if 5 <= t < 45 else 100) for t in range(0, 60, 5)]
    faults = [{"at_s": 5.0}, {"at_s": 10.0}, {"at_s": 55.0}]
    first, second, _ = analysis.recoveries(faults, wins, 5.0, bound_ms=200, within_s=20, end_s=60)
    assert first["verdict"] == "overlapped" and first["recovery_s"] is None
    assert second["verdict"] == "slow" and second["recovery_s"] == 35.0
    stuck = [window(t, 5000 if t >= 5 else 100) for t in range(0, 60, 5)]
    [alone] = analysis.recoveries([{"at_s": 5.0}], stuck, 5.0, bound_ms=200, within_s=20, end_s=60)
    assert alone["verdict"] == "not recovered"


def test_memory_flat_within_ratio_or_slack_and_growing_otherwise() -> None:
    flat = [(float(t), 100 * MIB + (t % 3) * MIB) for t in range(30)]
    assert analysis.memory_verdict(flat, 0, ratio=0.25, slack_bytes=16 * MIB)["flat"] is True
    leak = [(float(t), 100 * MIB + t * 5 * MIB) for t in range(30)]
    verdict = analysis.memory_verdict(leak, 0, ratio=0.25, slack_bytes=16 * MIB)
    assert verdict["flat"] is False and verdict["slope_mib_per_min"] == pytest.approx(300.0)
    assert analysis.memory_verdict(leak, 28, 0.25, 16 * MIB)["judged"] is False, "too few samples"


def test_incarnations_split_a_process_series_by_pid() -> None:
    lives = analysis.incarnations([(1.0, 10, 5), (2.0, 10, 6), (3.0, 11, 4)])
    assert lives == [(10, [(1.0, 5), (2.0, 6)]), (11, [(3.0, 4)])]


def test_the_fault_plan_is_seeded_spaced_and_takes_every_kind_in_turn() -> None:
    config = SoakConfig(duration_s=600, lead_in_s=60, tail_s=60, interval_s=(10, 60), seed=3)
    plan = fault_plan(config)
    assert plan == fault_plan(config)
    assert plan[0][0] == 60 and plan[-1][0] <= 540
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(plan)]
    assert all(10 <= g <= 60 for g in gaps)
    for first in range(0, len(plan) - 2, 3):
        assert {kind for _, kind in plan[first : first + 3]} == set(FAULT_KINDS)


def test_named_errors_are_carpool_errors_only() -> None:
    assert is_named_error("carpool.errors", "DeadlineExceeded")
    assert not is_named_error("builtins", "ValueError")
    assert not is_named_error("carpool.errors", "Nothing")


def test_config_is_checked_and_capacity_follows_the_pace() -> None:
    assert capacity_rps(2, 8, (0.05, 0.01)) == pytest.approx(2 * 8 / 0.13)
    assert pace_from("0.1,0.02") == (0.1, 0.02)
    assert short_config().rate_rps == pytest.approx(0.5 * capacity_rps(2, 8, short_config().pace))
    with pytest.raises(ValueError, match="tail_s"):
        SoakConfig(tail_s=10, p99_recovery_s=30)
    with pytest.raises(ValueError, match="kinds"):
        SoakConfig(kinds=("disk",))


def test_the_window_holding_the_next_fault_is_that_fault_s() -> None:
    wins = [window(0, 100), window(5, 100), window(10, 5000), window(15, 100)]
    first, second = analysis.recoveries(
        [{"at_s": 1.0}, {"at_s": 12.0}], wins, 5.0, bound_ms=200, within_s=20, end_s=20
    )
    assert first["verdict"] == "recovered" and first["recovery_s"] == 0.0
    assert second["verdict"] == "recovered" and second["recovery_s"] == 3.0
