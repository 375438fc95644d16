"""Manager block ids <-> kernel block ids."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.layouts.block_table import (
    BlockTable,
    kernel_ratio,
    to_kernel_block_ids,
    to_manager_block_ids,
)
from kvbridge.layouts.errors import LayoutError


@settings(max_examples=100, deadline=None)
@given(
    ids=st.lists(st.integers(0, 10_000), max_size=20),
    kernel=st.integers(1, 16),
    ratio=st.integers(1, 8),
)
def test_kernel_ids_are_r_consecutive_ids_per_manager_block(ids, kernel, ratio):
    block_size = kernel * ratio
    got = to_kernel_block_ids(np.array(ids, dtype=np.int64), block_size, kernel)
    want = [b * ratio + j for b in ids for j in range(ratio)]  # naive
    assert got.dtype == np.int64
    assert got.tolist() == want
    assert to_manager_block_ids(got, block_size, kernel).tolist() == ids


def test_hand_example():
    assert kernel_ratio(64, 16) == 4
    assert to_kernel_block_ids(np.array([0, 2]), 48, 16).tolist() == [0, 1, 2, 6, 7, 8]
    assert to_manager_block_ids(np.array([6, 7, 8, 0, 1, 2]), 48, 16).tolist() == [2, 0]


def test_block_table_appends_and_converts():
    table = BlockTable(block_size=32, kernel_block_size=16)
    table.append([3, 1])
    table.append(np.array([7]))
    assert len(table) == 3
    assert table.block_ids.tolist() == [3, 1, 7]
    assert table.kernel_block_ids.tolist() == [6, 7, 2, 3, 14, 15]
    assert "ids=[3, 1, 7]" in repr(table) and "kernel_block_size=16" in repr(table)


@pytest.mark.parametrize(
    ("block_size", "kernel", "message"),
    [
        (64, 24, "kernel_block_size=24 does not divide block_size=64"),
        (16, 32, "kernel_block_size=32 does not divide block_size=16"),
        (0, 16, "block_size=0 and kernel_block_size=16 must both be positive"),
        (16, -4, "kernel_block_size=-4 must both be positive"),
    ],
)
def test_non_dividing_kernel_sizes_raise(block_size, kernel, message):
    with pytest.raises(LayoutError, match=message):
        kernel_ratio(block_size, kernel)
    with pytest.raises(LayoutError, match=message):
        BlockTable(block_size, kernel)


def test_bad_ids_raise():
    with pytest.raises(LayoutError, match="block ids must be non-negative, got -3"):
        to_kernel_block_ids(np.array([1, -3]), 16, 4)
    with pytest.raises(LayoutError, match=r"must be 1-D, got shape \(1, 2\)"):
        to_kernel_block_ids(np.array([[1, 2]]), 16, 4)
    with pytest.raises(LayoutError, match="5 kernel ids are not a whole number of 2-block"):
        to_manager_block_ids(np.arange(5), 32, 16)
    with pytest.raises(LayoutError, match=r"kernel ids \[1, 2\] are not whole manager blocks"):
        to_manager_block_ids(np.array([1, 2]), 32, 16)
    with pytest.raises(LayoutError, match=r"kernel ids \[4, 6\] are not whole"):
        to_manager_block_ids(np.array([4, 6]), 32, 16)
