"""User models for the fault tests, loaded by workers through CARPOOL_MODEL=tests.integration.models:X."""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from carpool.models.toy import VOCAB, ToyModel

BOOM = 2 + zlib.crc32(b"boom") % (VOCAB - 2)


class SlowToy(ToyModel):
    """The toy model plus a fixed sleep per batch, so a run lasts long enough to kill things in."""

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Sequence[Any]:
        time.sleep(float(os.environ.get("SLOW_TOY_DELAY_S", "0.05")))
        return super().forward(input_ids, attention_mask)


class Exploding(ToyModel):
    """The toy model, except that any batch holding the word 'boom' raises."""

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Sequence[Any]:
        if (input_ids == BOOM).any():
            raise ValueError("cannot digest the word 'boom'")
        return super().forward(input_ids, attention_mask)


SLOW = f"{__name__}:SlowToy"
EXPLODING = f"{__name__}:Exploding"
