"""Length bins: which bin a request of a given token length belongs to."""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence

from carpool.names import DEFAULT_BIN_EDGES

log = logging.getLogger(__name__)

PAD_MULTIPLE = 8  # tensor cores and vectorised CPU kernels like dimensions in multiples of 8


def padded_length(length: int, multiple: int = PAD_MULTIPLE) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (at least one multiple)."""
    return max(multiple, -(-length // multiple) * multiple)


def padded_width(lengths: Iterable[int], multiple: int = PAD_MULTIPLE) -> int:
    """The length every member of a batch of ``lengths`` is padded to: its longest, rounded up."""
    return padded_length(max(lengths, default=0), multiple)


class LengthBins:
    """Bins by upper edge: with edges (16, 32) lengths 1-16 go to bin 0, 17-32 to 1, longer to 2.

    No edges means one bin, which is plain FIFO batching. A bin's label (in batch messages,
    metrics and ``carpool status``) is its span of token lengths, such as ``"17-32"`` or ``"33+"``.
    """

    def __init__(self, edges: Sequence[int] = ()) -> None:
        if list(edges) != sorted(set(edges)) or any(e < 1 for e in edges):
            raise ValueError("bin edges must be strictly increasing positive integers")
        self.edges = tuple(edges)

    def __len__(self) -> int:
        return len(self.edges) + 1

    def index(self, length: int) -> int:
        return bisect_left(self.edges, length)

    def span(self, index: int) -> str:
        """The token lengths bin ``index`` holds under the current edges: ``"17-32"``, ``"33+"``."""
        low = 1 if index == 0 else self.edges[index - 1] + 1
        high = self.edges[index] if index < len(self.edges) else None
        return f"{low}-{high}" if high is not None else f"{low}+"

    def span_for(self, length: int) -> str:
        return self.span(self.index(length))

    def label(self, index: int) -> str:
        """The name bin ``index`` is shown under: fixed edges name a bin by its span."""
        return self.span(index)

    def label_for(self, length: int) -> str:
        return self.label(self.index(length))

    def spans(self) -> dict[str, str]:
        """Each bin's label and span under the current edges."""
        return {self.label(i): self.span(i) for i in range(len(self))}

    def observe(self, length: int) -> None:
        """Explicit edges learn nothing."""


class AutoBins(LengthBins):
    """Edges fitted to the traffic: quantiles of the last ``window`` lengths, refitted every
    ``refit_every`` requests, so bins follow a shift in the length mix without anyone retuning.

    Edges are rounded up to the pad multiple: a bin then never mixes two padded widths needlessly.
    A bin is labelled by its index, ``"b0"`` (the shortest) to ``"b<n>"``, not by its span: every
    refit moves the spans, and labels named after them would add metric series and gauge fields
    without end. ``name`` (the routing key) only names the bins in the log line of each refit.
    """

    def __init__(
        self,
        count: int = 6,
        window: int = 2048,
        refit_every: int = 256,
        initial: Sequence[int] = DEFAULT_BIN_EDGES,
        multiple: int = PAD_MULTIPLE,
        name: str = "",
    ) -> None:
        if count < 1 or window < count or refit_every < 1:
            raise ValueError("need count >= 1, window >= count and refit_every >= 1")
        super().__init__(initial)
        self.count = count
        self.refit_every = refit_every
        self.multiple = multiple
        self.name = name
        self._recent: deque[int] = deque(maxlen=window)
        self._since_fit = 0

    def label(self, index: int) -> str:
        return f"b{index}"

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
        fitted = tuple(sorted(e for e in edges if e < top))
        self._since_fit = 0
        if fitted != self.edges:
            self.edges = fitted
            # Debug level: a drifting or noisy length mix moves the edges as often as every refit.
            log.debug(
                "length bins of %s refitted: %s",
                self.name or "?",
                "  ".join(f"{label}={span}" for label, span in self.spans().items()),
            )
