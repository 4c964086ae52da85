"""Padding helpers for batch functions: shapes, multiple of 8, mask, pad id, truncation, order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.padding import pad_batch, sort_by_length

token_lists = st.lists(st.lists(st.integers(1, 30_000), max_size=70), min_size=1, max_size=12)


@given(rows=token_lists, multiple=st.integers(1, 16), pad_id=st.integers(-1, 3))
def test_rows_are_copied_and_padded_to_a_multiple(rows: list[list[int]], multiple: int, pad_id: int) -> None:
    ids, mask = pad_batch(rows, pad_id, multiple=multiple)
    longest = max(len(r) for r in rows)
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.shape == mask.shape == (len(rows), ids.shape[1])
    assert ids.shape[1] % multiple == 0
    assert max(longest, 1) <= ids.shape[1] < max(longest, 1) + multiple
    for i, row in enumerate(rows):
        assert ids[i, : len(row)].tolist() == row
        assert mask[i].tolist() == [1] * len(row) + [0] * (ids.shape[1] - len(row))
    assert (ids[mask == 0] == pad_id).all()


def test_default_is_a_multiple_of_8_and_arrays_pad_like_lists() -> None:
    rows = [[5, 6, 7], [1] * 9]
    from_lists = pad_batch(rows, pad_id=0)
    from_arrays = pad_batch([np.array(r) for r in rows], pad_id=0)
    mixed = pad_batch([rows[0], np.array(rows[1], dtype=np.int32)], pad_id=0)
    assert from_lists.ids.shape == (2, 16)
    for other in (from_arrays, mixed):
        assert np.array_equal(other.ids, from_lists.ids) and np.array_equal(other.mask, from_lists.mask)
    assert from_lists.mask.sum(axis=1).tolist() == [3, 9]


def test_max_length_truncates_and_dtype_pads_feature_rows() -> None:
    ids, mask = pad_batch([[1] * 20, [2, 3]], pad_id=0, max_length=10)
    assert ids.shape == (2, 16) and mask.sum(axis=1).tolist() == [10, 2]
    values, mask = pad_batch([np.array([0.5, 1.5], dtype=np.float32), [2.5]], -1.0, dtype=np.float32)
    assert values.dtype == np.float32 and values[1].tolist() == [2.5] + [-1.0] * 7


def test_empty_rows_are_all_padding() -> None:
    ids, mask = pad_batch([[], []], pad_id=9)
    assert ids.shape == (2, 8) and not mask.any() and (ids == 9).all()


@pytest.mark.parametrize(
    ("rows", "options", "message"),
    [
        ([], {}, "at least one row"),
        ([np.zeros((2, 3), dtype=np.int64)], {}, "1-D rows"),
        ([[1]], {"multiple": 0}, "multiple must be"),
        ([[1]], {"max_length": 0}, "max_length must be"),
    ],
)
def test_bad_arguments_say_what_to_change(rows: list[object], options: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pad_batch(rows, **options)  # type: ignore[arg-type]


@given(items=st.lists(st.text(max_size=12), max_size=20), descending=st.booleans())
def test_sort_by_length_then_restore_gives_outputs_in_arrival_order(
    items: list[str], descending: bool
) -> None:
    ordered, restore = sort_by_length(items, descending=descending)
    lengths = [len(s) for s in ordered]
    assert lengths == sorted(lengths, reverse=descending)
    assert restore([s.upper() + "!" for s in ordered]) == [s.upper() + "!" for s in items]


def test_sort_is_stable_and_restore_checks_the_count() -> None:
    ordered, restore = sort_by_length(["bb", "a1", "ccc", "a2"], key=len)
    assert ordered == ["ccc", "bb", "a1", "a2"]
    with pytest.raises(ValueError, match="3 outputs for 4"):
        restore([1, 2, 3])
