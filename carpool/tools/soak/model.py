"""``PacedToy``: the toy model on a pretend device whose batch time is known, so capacity is known.

Each ``forward`` sleeps ``a + b * rows`` seconds (``SOAK_BATCH_S="a,b"`` in the worker's environment,
set by the soak), then returns the toy model's output, which does not depend on the batch a text
rides in: every answer can be checked against the toy model run alone. Sleeping leaves the CPU free,
as a real accelerator would, so the soak loads the pipeline and not the shared machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from carpool.models.toy import ToyModel

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

PACE_ENV = "SOAK_BATCH_S"
# Seconds per batch and per row. The per-row time dominates, so capacity hardly depends on how full
# length binning lets batches get at half load.
DEFAULT_PACE = (0.01, 0.03)
NAME = f"{__name__}:PacedToy"


def pace_from(spec: str | None) -> tuple[float, float]:
    """``"a,b"`` -> (a, b); the default when ``spec`` is empty."""
    if not spec:
        return DEFAULT_PACE
    a, b = (float(v) for v in spec.split(","))
    if a < 0 or b < 0:
        raise ValueError(f"{PACE_ENV} must be two non-negative numbers of seconds, got {spec!r}")
    return a, b


def capacity_rps(workers: int, max_batch: int, pace: tuple[float, float]) -> float:
    """Requests per second ``workers`` can answer at most: full batches back to back."""
    a, b = pace
    return workers * max_batch / (a + b * max_batch)


class PacedToy(ToyModel):
    """The toy model, each batch taking ``a + b * rows`` seconds of (sleeping) device time."""

    def __init__(self) -> None:
        super().__init__()
        self.pace = pace_from(os.environ.get(PACE_ENV))

    def forward(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64]
    ) -> Sequence[Any]:
        time.sleep(self.pace[0] + self.pace[1] * len(input_ids))
        return super().forward(input_ids, attention_mask)
