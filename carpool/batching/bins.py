"""Length bins: which bin a request of a given token length belongs to."""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence

from carpool.names import DEFAULT_BIN_EDGES

PAD_MULTIPLE = 8  # tensor cores and vectorised CPU kernels like dimensions in multiples of 8


def padded_length(length: int, multiple: int = PAD_MULTIPLE) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (at least one multiple)."""
    return max(multiple, -(-length // multiple) * multiple)


def padded_width(lengths: Iterable[int], multiple: int = PAD_MULTIPLE) -> int:
    """The length every member of a batch of ``lengths`` is padded to: its longest, rounded up."""
    return padded_length(max(lengths, default=0), multiple)


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

    def label_for(self, length: int) -> str:
        return self.label(self.index(length))

    def observe(self, length: int) -> None:
        """Explicit edges learn nothing."""


class AutoBins(LengthBins):
    """Edges fitted to the traffic: quantiles of the last ``window`` lengths, refitted every
    ``refit_every`` requests, so bins follow a shift in the length mix without anyone retuning.

    Edges are rounded up to the pad multiple: a bin then never mixes two padded widths needlessly.
    """

    def __init__(
        self,
        count: int = 6,
        window: int = 2048,
        refit_every: int = 256,
        initial: Sequence[int] = DEFAULT_BIN_EDGES,
        multiple: int = PAD_MULTIPLE,
    ) -> None:
        if count < 1 or window < count or refit_every < 1:
            raise ValueError("need count >= 1, window >= count and refit_every >= 1")
        super().__init__(initial)
        self.count = count
        self.refit_every = refit_every
        self.multiple = multiple
        self._recent: deque[int] = deque(maxlen=window)
        self._since_fit = 0

    def observe(self, length: int) -> None:
        self._recent.append(length)
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self._recent) >= 2 * self.count:
            self.refit()

    def refit(self) -> None:
        ordered = sorted(self._recent)
        n = len(ordered)
        edges = {
            padded_length(ordered[min(n - 1, (n * k) // self.count)], self.multiple)
            for k in range(1, self.count)
        }
        top = padded_length(ordered[-1], self.multiple)
        self.edges = tuple(sorted(e for e in edges if e < top))
        self._since_fit = 0
