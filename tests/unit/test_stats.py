"""The one percentile definition the demo, the simulator and the bench report with."""

from __future__ import annotations

import pytest

from carpool.tools.stats import percentile


@pytest.mark.parametrize(
    ("n", "q", "rank"),
    [(300, 50, 150), (20, 50, 10), (3, 50, 2), (300, 99, 297), (20, 90, 18), (5, 0, 1), (5, 100, 5)],
)
def test_percentile_is_the_nearest_rank(n: int, q: float, rank: int) -> None:
    """The value at rank ceil(q/100 * n), counting from 1: at least q% of the values are at or below it."""
    assert percentile(list(range(n, 0, -1)), q) == rank


def test_percentile_of_no_values_is_zero() -> None:
    assert percentile([], 99) == 0.0
