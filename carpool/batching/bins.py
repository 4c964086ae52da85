"""Length bins: which bin a request of a given token length belongs to."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

PAD_MULTIPLE = 8  # tensor cores and vectorised CPU kernels like dimensions in multiples of 8


def padded_length(length: int, multiple: int = PAD_MULTIPLE) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (at least one multiple)."""
    return max(multiple, -(-length // multiple) * multiple)


class LengthBins:
    """Bins by upper edge: with edges (16, 32) lengths 1-16 go to bin 0, 17-32 to 1, longer to 2.

    No edges means one bin, which is plain FIFO batching.
    """

    def __init__(self, edges: Sequence[int] = ()) -> None:
        if list(edges) != sorted(set(edges)) or any(e < 1 for e in edges):
            raise ValueError("bin edges must be strictly increasing positive integers")
        self.edges = tuple(edges)

    def __len__(self) -> int:
        return len(self.edges) + 1

    def index(self, length: int) -> int:
        return bisect_left(self.edges, length)

    def label(self, index: int) -> str:
        low = 1 if index == 0 else self.edges[index - 1] + 1
        high = self.edges[index] if index < len(self.edges) else None
        return f"{low}-{high}" if high is not None else f"{low}+"
