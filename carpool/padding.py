"""Padding and ordering helpers for batch functions: variable-length rows -> one padded array + mask.

numpy only, so a batch function can hand the arrays to whichever framework it runs
(``torch.from_numpy(ids)`` shares the memory)::

    ids, mask = pad_batch(token_lists, pad_id=tokenizer.pad_token_id)
    return model(torch.from_numpy(ids), torch.from_numpy(mask)).tolist()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from carpool.batching.bins import PAD_MULTIPLE, padded_length

T = TypeVar("T")
U = TypeVar("U")

Row = Sequence[int] | Sequence[float] | npt.NDArray[Any]


class Padded(NamedTuple):
    """A padded batch: ``ids`` (rows x width) and ``mask`` (1 on real positions, 0 on padding)."""

    ids: npt.NDArray[Any]
    mask: npt.NDArray[np.int64]


def pad_batch(
    rows: Sequence[Row],
    pad_id: int | float = 0,
    *,
    multiple: int = PAD_MULTIPLE,
    max_length: int | None = None,
    dtype: npt.DTypeLike = np.int64,
) -> Padded:
    """Rows padded with ``pad_id`` to the longest row rounded up to a multiple of ``multiple``.

    Rows are lists or 1-D arrays of token ids (or of numbers with ``dtype=np.float32``); rows longer
    than ``max_length`` are cut to it. The mask is int64, the dtype attention masks take.
    """
    if not rows:
        raise ValueError("pad_batch needs at least one row")
    if multiple < 1:
        raise ValueError(f"multiple must be an integer >= 1, got {multiple}")
    if max_length is not None:
        if max_length < 1:
            raise ValueError(f"max_length must be an integer >= 1 or None, got {max_length}")
        rows = [row[:max_length] for row in rows]
    for i, row in enumerate(rows):
        if isinstance(row, np.ndarray) and row.ndim != 1:
            raise ValueError(f"row {i} has shape {row.shape}; pad_batch pads 1-D rows")
    lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    width = padded_length(int(lengths.max()), multiple)
    # A row-major boolean mask selects the real positions in the order the rows concatenate, so one
    # vectorised assignment fills every row.
    real = np.arange(width) < lengths[:, None]
    ids = np.full((len(rows), width), pad_id, dtype=dtype)
    total = int(lengths.sum())
    if any(isinstance(row, np.ndarray) for row in rows):
        ids[real] = np.concatenate([np.asarray(row, dtype=dtype) for row in rows])
    elif total:
        ids[real] = np.fromiter(chain.from_iterable(rows), dtype=dtype, count=total)
    return Padded(ids, real.astype(np.int64))


class Restore:
    """Puts outputs computed in sorted order back into the order the items came in."""

    __slots__ = ("_order",)

    def __init__(self, order: Sequence[int]) -> None:
        self._order = order

    def __call__(self, outputs: Sequence[U]) -> list[U]:
        if len(outputs) != len(self._order):
            raise ValueError(f"got {len(outputs)} outputs for {len(self._order)} sorted items")
        restored: list[Any] = [None] * len(outputs)
        for position, index in enumerate(self._order):
            restored[index] = outputs[position]
        return restored


def sort_by_length(
    items: Sequence[T], key: Callable[[Any], int] = len, *, descending: bool = True
) -> tuple[list[T], Restore]:
    """``items`` sorted by ``key`` (stable; longest first by default) and the function that puts
    outputs back in the original order, for a function that cuts its batch into sub-batches::

        texts, restore = sort_by_length(texts)
        return restore([y for i in range(0, len(texts), 32) for y in run(texts[i : i + 32])])
    """
    lengths = [key(item) for item in items]
    # sorted() stays stable with reverse=True: equal lengths keep their arrival order.
    order = sorted(range(len(items)), key=lengths.__getitem__, reverse=descending)
    return [items[i] for i in order], Restore(order)
