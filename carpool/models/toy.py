"""``toy``: a small deterministic torch model whose cost grows with padded tokens, for fast tests.

Words are hashed to ids (no vocabulary file); the network is a seeded embedding, two linear layers
and a masked mean, so a text's output does not depend on the batch or padding it rides in (up to
float32 rounding, which the math library may do differently in another process).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

VOCAB = 4096
DIM = 32


class ToyModel:
    max_length = 256
    pad_id = 0
    needs_token_ids = True
    plain_ids = True  # encode gives lists of Python ints (see carpool.models.base)

    def __init__(self) -> None:
        self._net: Any = None
        self._device = "cpu"

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        out = []
        for text in texts:
            ids = [1] + [
                2 + zlib.crc32(w.encode("utf-8", "surrogatepass")) % (VOCAB - 2) for w in text.split()
            ]
            out.append(ids[: self.max_length])
        return out

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [1 + len(t.split()) for t in texts]

    def load(self, device: str, *, autocast_bf16: bool = False) -> None:
        import torch

        gen = torch.Generator().manual_seed(1234)
        self._net = {
            "emb": torch.randn(VOCAB, DIM, generator=gen).to(device),
            "w1": (torch.randn(DIM, 4 * DIM, generator=gen) / DIM**0.5).to(device),
            "w2": (torch.randn(4 * DIM, DIM, generator=gen) / (4 * DIM) ** 0.5).to(device),
        }
        self._device = device

    def forward(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64]
    ) -> Sequence[Any]:
        import torch

        net = self._net
        ids = torch.from_numpy(input_ids).to(self._device)
        mask = torch.from_numpy(attention_mask).to(self._device).unsqueeze(-1).float()
        h = net["emb"][ids]
        h = h + torch.tanh(h @ net["w1"]) @ net["w2"]
        pooled = (h * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return [[round(v, 6) for v in row] for row in pooled.cpu().tolist()]
