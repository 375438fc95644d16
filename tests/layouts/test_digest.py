"""Digests of moved rows: equal bytes agree wherever they sit; misplaced, foreign or
partly overwritten rows do not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.layouts.digest import fold, row_sums
from kvbridge.layouts.errors import LayoutError

BLOCK = 512
OFFSETS = np.array([0, 128, 256, 384])  # four 128-byte pieces per block
LENGTH = 128


def _units(num_blocks: int, seed: int, stride: int = BLOCK) -> torch.Tensor:
    """``[num_blocks, BLOCK]`` uint8 rows ``stride`` bytes apart (a cross-layer slice)."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randint(0, 256, (num_blocks, stride), dtype=torch.uint8, generator=g)
    return whole[:, :BLOCK]


def _rows(blocks: list[int], pieces: list[int] | None = None) -> np.ndarray:
    sel = np.arange(OFFSETS.size) if pieces is None else np.asarray(pieces)
    return (np.asarray(blocks)[:, None] * OFFSETS.size + sel[None, :]).reshape(-1)


def _digest(units: torch.Tensor, rows: np.ndarray, offsets=OFFSETS, length=LENGTH) -> int:
    return fold(row_sums(units, offsets, length, rows))


def _reference(units: torch.Tensor, rows: np.ndarray) -> np.ndarray:
    """Row by row, the obvious way."""
    out = []
    for r in rows.tolist():
        b, j = divmod(r, OFFSETS.size)
        piece = units[b, OFFSETS[j] : OFFSETS[j] + LENGTH].contiguous()
        out.append(int(piece.view(torch.int64).sum()))
    return np.asarray(out, dtype=np.int64)


@pytest.mark.parametrize("blocks", [[3, 4, 5, 6], [60, 2, 33, 9], [7]])
def test_row_sums_match_a_row_by_row_reference(blocks):
    """Dense runs (strided, in place) and scattered blocks (gathered) alike."""
    units = _units(64, seed=1, stride=640)
    rows = _rows(blocks, [1, 3])
    assert np.array_equal(row_sums(units, OFFSETS, LENGTH, rows), _reference(units, rows))


def test_the_same_bytes_in_other_blocks_give_the_same_digest():
    """Prefill's rows of blocks 10, 11, 40 land in decode's blocks 2, 7, 3."""
    prefill, decode = _units(64, seed=2), _units(16, seed=3)
    for src, dst in zip((10, 11, 40), (2, 7, 3), strict=True):
        decode[dst] = prefill[src]
    assert _digest(prefill, _rows([10, 11, 40])) == _digest(decode, _rows([2, 7, 3]))


def test_a_swapped_block_a_foreign_block_and_a_partial_overwrite_change_the_digest():
    prefill, decode = _units(64, seed=4), _units(16, seed=5)
    for src, dst in zip((10, 11, 40), (2, 7, 3), strict=True):
        decode[dst] = prefill[src]
    want = _digest(prefill, _rows([10, 11, 40]))
    assert _digest(decode, _rows([7, 2, 3])) != want  # two blocks landed swapped
    foreign = decode.clone()
    foreign[7] = prefill[12]  # another request's block
    assert _digest(foreign, _rows([2, 7, 3])) != want
    partial = decode.clone()
    partial[3, 300] ^= 0x10  # one byte of one piece
    assert _digest(partial, _rows([2, 7, 3])) != want
    assert _digest(decode, _rows([2, 7])) != want  # a block missing


def test_odd_sizes_are_summed_in_narrower_words():
    """A 6-byte piece at odd offsets (a state run) is read as 16-bit words, a 3-byte one
    as bytes: same digests as moving the bytes elsewhere."""
    units = _units(8, seed=6)
    other = torch.zeros_like(units)
    other[5] = units[1]
    for offsets, length in ((np.array([2, 10]), 6), (np.array([1, 7]), 3)):
        assert _digest(units, np.array([2, 3]), offsets, length) == _digest(
            other, np.array([10, 11]), offsets, length
        )


def test_rows_outside_the_region_are_refused():
    with pytest.raises(LayoutError, match="outside the 32 rows"):
        row_sums(_units(8, seed=7), OFFSETS, LENGTH, np.array([32]))


def test_no_rows_fold_to_zero():
    assert fold(row_sums(_units(2, seed=8), OFFSETS, LENGTH, np.array([], dtype=np.int64))) == 0


def test_large_scattered_rows_are_summed_run_by_run_like_the_reference():
    """Cross-layer blocks (one 128 KiB piece each) scattered over the pool: reduced run
    by run in place, same sums as row by row, in the order asked."""
    g = torch.Generator().manual_seed(9)
    units = torch.randint(0, 256, (40, 128 << 10), dtype=torch.uint8, generator=g)
    rows = np.array([30, 3, 4, 5, 12, 0, 39])
    want = [int(units[r].view(torch.int64).sum()) for r in rows.tolist()]
    assert row_sums(units, np.zeros(1, dtype=np.int64), 128 << 10, rows).tolist() == want


def test_gathers_are_bounded_and_give_the_same_sums(monkeypatch):
    """Scattered small rows are gathered a bounded number at a time (scratch memory on a
    GPU that the engine has mostly taken): same sums, same order."""
    import kvbridge.layouts.digest as digest

    units = _units(64, seed=10)
    rows = _rows([60, 2, 33, 9, 41], [0, 2])
    whole = row_sums(units, OFFSETS, LENGTH, rows)
    monkeypatch.setattr(digest, "_GATHER_BYTES", 2 * LENGTH)  # two rows a gather
    assert np.array_equal(row_sums(units, OFFSETS, LENGTH, rows), whole)
    assert np.array_equal(whole, _reference(units, rows))
