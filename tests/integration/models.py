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


class Letters:
    """A user model written against the protocol alone (carpool.models.base), without torch: a token
    per character (its code point), a window of 16; each output is its row's token sum and count."""

    max_length = 16
    pad_id = 0
    needs_token_ids = True

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [[ord(c) for c in text[: self.max_length]] for text in texts]

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(text) for text in texts]

    def load(self, device: str, *, autocast_bf16: bool = False) -> None:
        self.device = device

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Sequence[Any]:
        sums = (input_ids * attention_mask).sum(axis=1)
        return [{"sum": int(s), "len": int(n)} for s, n in zip(sums, attention_mask.sum(axis=1), strict=True)]


class Unstorable(Letters):
    """Letters, except that a text holding "~" gets an output no result serializer stores: a set."""

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Sequence[Any]:
        outputs = list(super().forward(input_ids, attention_mask))
        for i, row in enumerate(input_ids):
            if (row == ord("~")).any():
                outputs[i] = {"seen": {1, 2}}
        return outputs


class BrokenLoad(ToyModel):
    """The toy model, except that its weights fail to load (a missing file, a device out of memory)."""

    def load(self, device: str, *, autocast_bf16: bool = False) -> None:
        raise RuntimeError("weights file missing")


class NumpyLetters(Letters):
    """Letters whose encode returns numpy rows of numpy ints, as many tokenizers do; a text holding
    "?" gets ids that are no integers (floats)."""

    def encode(self, texts: Sequence[str]) -> list[Any]:
        rows = [np.asarray(row, dtype=np.int64) for row in super().encode(texts)]
        return [row + 0.5 if "?" in text else row for text, row in zip(texts, rows, strict=True)]


class SneakyLetters(Letters):
    """Letters, vouching for its ids as the built-in tokenizers do (``plain_ids``), except that a
    text holding "!" gets a row that ends with something no batch message can carry."""

    plain_ids = True

    def encode(self, texts: Sequence[str]) -> list[list[Any]]:
        rows = super().encode(texts)
        return [[*row, object()] if "!" in text else row for text, row in zip(texts, rows, strict=True)]


SLOW = f"{__name__}:SlowToy"
EXPLODING = f"{__name__}:Exploding"
LETTERS = f"{__name__}:Letters"
UNSTORABLE = f"{__name__}:Unstorable"
BROKEN_LOAD = f"{__name__}:BrokenLoad"
NUMPY_LETTERS = f"{__name__}:NumpyLetters"
SNEAKY_LETTERS = f"{__name__}:SneakyLetters"
