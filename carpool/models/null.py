"""``null``: no compute at all. Measures the pipeline's own cost; each output is the input's length."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


class NullModel:
    max_length = 256
    pad_id = 0
    needs_token_ids = False

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        # About four characters per token, like a real subword tokenizer, without the work.
        return [[0] * min(self.max_length, 2 + len(t) // 4) for t in texts]

    def load(self, device: str, *, autocast_bf16: bool = False) -> None:
        return None

    def forward(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64]
    ) -> Sequence[Any]:
        return [int(n) for n in attention_mask.sum(axis=1)]
