"""Digests of moved rows: equal bytes agree wherever they sit and however each side's
memory is aligned; misplaced, foreign, partly overwritten, zeroed or internally
rearranged rows do not. Every check runs on the numpy path (host memory) and on the torch
path (what GPU memory takes; here on CPU tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvbridge.layouts.digest as digest
from kvbridge.layouts.digest import fold, row_sums, torch_row_sums, word_bytes
from kvbridge.layouts.errors import LayoutError

BLOCK = 512
OFFSETS = np.array([0, 128, 256, 384])  # four 128-byte pieces per block
LENGTH = 128
PATHS = ("numpy", "torch")
_MASK = (1 << 64) - 1


def _units(num_blocks: int, seed: int, stride: int = BLOCK, width: int = BLOCK) -> torch.Tensor:
    """``[num_blocks, width]`` uint8 rows ``stride`` bytes apart (a cross-layer slice)."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randint(0, 256, (num_blocks, stride), dtype=torch.uint8, generator=g)
    return whole[:, :width]


def _rows(blocks: list[int], pieces: list[int] | None = None) -> np.ndarray:
    sel = np.arange(OFFSETS.size) if pieces is None else np.asarray(pieces)
    return (np.asarray(blocks)[:, None] * OFFSETS.size + sel[None, :]).reshape(-1)


def _sums(path: str, units: torch.Tensor, rows, offsets=OFFSETS, length=LENGTH) -> np.ndarray:
    rows, offsets = np.asarray(rows, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
    if path == "numpy":
        return row_sums(units, offsets, length, rows)
    return torch_row_sums(units, offsets, length, rows)


def _digest(path: str, units: torch.Tensor, rows, offsets=OFFSETS, length=LENGTH) -> int:
    return fold(_sums(path, units, rows, offsets, length))


def _weight(i: int) -> int:
    """Position ``i``'s weight, written out (splitmix64 of ``i + 1``, made odd)."""
    z = ((i + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) | 1


def _reference(units: torch.Tensor, rows, offsets=OFFSETS, length=LENGTH) -> np.ndarray:
    """Row by row, word by word, in Python integers."""
    size = word_bytes(length)
    weights = [_weight(i) for i in range(length // size)]
    out = []
    for r in np.asarray(rows).tolist():
        b, j = divmod(r, len(offsets))
        raw = bytes(units[b, int(offsets[j]) : int(offsets[j]) + length].tolist())
        total = sum(
            int.from_bytes(raw[i * size : (i + 1) * size], "little", signed=size > 1) * c
            for i, c in enumerate(weights)
        )
        total &= _MASK
        out.append(total - (1 << 64) if total >> 63 else total)
    return np.asarray(out, dtype=np.int64)


def _landed(path_seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Prefill's blocks 10, 11, 40 landed in decode's blocks 2, 7, 3."""
    prefill, decode = _units(64, seed=path_seed), _units(16, seed=path_seed + 1)
    for src, dst in zip((10, 11, 40), (2, 7, 3), strict=True):
        decode[dst] = prefill[src]
    return prefill, decode, _rows([10, 11, 40]), _rows([2, 7, 3])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("blocks", [[3, 4, 5, 6], [60, 2, 33, 9], [7]])
def test_row_values_match_a_word_by_word_reference(path, blocks):
    """Dense runs (strided, in place) and scattered blocks (gathered) alike."""
    units = _units(64, seed=1, stride=640)
    rows = _rows(blocks, [1, 3])
    assert np.array_equal(_sums(path, units, rows), _reference(units, rows))


@pytest.mark.parametrize("path", PATHS)
def test_the_same_bytes_in_other_blocks_give_the_same_digest(path):
    prefill, decode, theirs, ours = _landed(2)
    assert _digest(path, prefill, theirs) == _digest(path, decode, ours)


@pytest.mark.parametrize("path", PATHS)
def test_swapped_blocks_a_foreign_block_a_partial_overwrite_and_a_missing_row(path):
    prefill, decode, theirs, ours = _landed(4)
    want = _digest(path, prefill, theirs)
    assert _digest(path, decode, _rows([7, 2, 3])) != want  # two blocks landed swapped
    foreign = decode.clone()
    foreign[7] = prefill[12]  # another request's block
    assert _digest(path, foreign, ours) != want
    partial = decode.clone()
    partial[3, 300] ^= 0x10  # one byte of one piece
    assert _digest(path, partial, ours) != want
    assert _digest(path, decode, _rows([2, 7])) != want  # a block missing


@pytest.mark.parametrize("path", PATHS)
def test_a_row_whose_halves_swapped_changes_the_digest(path):
    """Piece 1 of decode's block 7 holds its two 64-byte halves the wrong way round: the
    same words, so the same plain sum."""
    prefill, decode, theirs, ours = _landed(11)
    want = _digest(path, prefill, theirs)
    assert _digest(path, decode, ours) == want
    row = decode[7, 128:256].clone()
    decode[7, 128:192], decode[7, 192:256] = row[64:], row[:64]
    assert _digest(path, decode, ours) != want


@pytest.mark.parametrize("path", PATHS)
def test_k_and_v_swapped_inside_one_row_change_the_digest(path):
    """A cross-layer block is one row holding K and V of each layer::

        | L0 K | L0 V | L1 K | L1 V |     128 bytes each, one 512-byte piece
                      '------'  swapped in decode's block 5 (layer 1 only)
    """
    one_piece = np.zeros(1, dtype=np.int64)
    prefill, decode = _units(8, seed=12), _units(8, seed=13)
    decode[5] = prefill[2]
    want = _digest(path, prefill, [2], one_piece, BLOCK)
    assert _digest(path, decode, [5], one_piece, BLOCK) == want
    k, v = decode[5, 256:384].clone(), decode[5, 384:512].clone()
    decode[5, 256:384], decode[5, 384:512] = v, k
    assert _digest(path, decode, [5], one_piece, BLOCK) != want


@pytest.mark.parametrize("path", PATHS)
def test_a_zeroed_row_changes_the_digest_even_where_its_words_cancel(path):
    """A zeroed row is seen; so is one whose words summed to 0 modulo 2**64 (its second
    half the negated first), which a plain sum of words cannot tell from zeros."""
    prefill, decode, theirs, ours = _landed(14)
    want = _digest(path, prefill, theirs)
    zeroed = decode.clone()
    zeroed[3, 0:128] = 0
    assert _digest(path, zeroed, ours) != want
    words = prefill[40, 0:128].clone().view(torch.int64)
    words[8:] = -words[:8]
    prefill[40, 0:128], decode[3, 0:128] = words.view(torch.uint8), words.view(torch.uint8)
    want = _digest(path, prefill, theirs)
    assert int(words.sum()) == 0 and _digest(path, decode, ours) == want
    decode[3, 0:128] = 0
    assert _digest(path, decode, ours) != want


@pytest.mark.parametrize("path", PATHS)
def test_word_size_comes_from_the_length_not_each_sides_alignment(path):
    """The same 120-byte pieces: prefill's at 8-byte aligned offsets of 512-byte blocks,
    decode's at 4-byte aligned offsets, block stride 268 and a base address one byte off
    (a host mirror, a staging slot): read as 8-byte words on both sides, same digest."""
    length, theirs_at, ours_at = 120, np.array([0, 256]), np.array([4, 132])
    prefill = _units(8, seed=15)
    decode = _units(8, seed=16, stride=269)[:, 1:]  # data_ptr odd, stride 269
    decode8 = _units(8, seed=17, stride=268, width=268)  # stride 268: 4-byte aligned
    for dst in (decode, decode8):
        for src_at, dst_at in zip(theirs_at.tolist(), ours_at.tolist(), strict=True):
            dst[6, dst_at : dst_at + length] = prefill[1, src_at : src_at + length]
    want = _digest(path, prefill, [2, 3], theirs_at, length)
    assert _digest(path, decode, [12, 13], ours_at, length) == want
    assert _digest(path, decode8, [12, 13], ours_at, length) == want
    assert np.array_equal(
        _sums(path, decode, [12, 13], ours_at, length),
        _reference(decode, [12, 13], ours_at, length),
    )


@pytest.mark.parametrize("path", PATHS)
def test_odd_sizes_are_read_in_narrower_words(path):
    """A 6-byte piece at odd offsets (a state run) is read as 16-bit words, a 3-byte one
    as bytes: the reference's values, the same digests as moving the bytes elsewhere."""
    units = _units(8, seed=6)
    other = torch.zeros_like(units)
    other[5] = units[1]
    for offsets, length in ((np.array([2, 10]), 6), (np.array([1, 7]), 3)):
        assert np.array_equal(
            _sums(path, units, [2, 3], offsets, length),
            _reference(units, [2, 3], offsets, length),
        )
        assert _digest(path, units, [2, 3], offsets, length) == _digest(
            path, other, [10, 11], offsets, length
        )


def test_the_definition_is_pinned():
    """Digest version 2 of bytes 0, 1, ..., 255 in two blocks of two 128-byte pieces: a
    change here changes what peers compare (``DIGEST_VERSION``)."""
    units = torch.arange(512, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(2, 256)
    assert digest.DIGEST_VERSION == 2
    assert [word_bytes(n) for n in (128, 124, 6, 3)] == [8, 4, 2, 1]
    values = _sums("numpy", units, [0, 1, 2, 3], [0, 128])
    assert np.array_equal(values, _reference(units, [0, 1, 2, 3], [0, 128]))
    assert fold(values) == 0x66BF2D0B67A59B00


def test_rows_outside_the_region_are_refused():
    with pytest.raises(LayoutError, match="outside the 32 rows"):
        row_sums(_units(8, seed=7), OFFSETS, LENGTH, np.array([32]))


def test_no_rows_fold_to_zero():
    assert fold(row_sums(_units(2, seed=8), OFFSETS, LENGTH, np.array([], dtype=np.int64))) == 0


@pytest.mark.parametrize("path", PATHS)
def test_large_scattered_rows_are_read_one_by_one_like_the_reference(path):
    """Cross-layer blocks (one 128 KiB piece each) scattered over the pool: reduced row
    by row in place, the reference's values, in the order asked."""
    g = torch.Generator().manual_seed(9)
    units = torch.randint(0, 256, (40, 128 << 10), dtype=torch.uint8, generator=g)
    rows, at = np.array([30, 3, 4, 5, 12, 0, 39]), np.zeros(1, dtype=np.int64)
    got = _sums(path, units, rows, at, 128 << 10)
    assert np.array_equal(got, _reference(units, rows, at, 128 << 10))


@pytest.mark.parametrize("path", PATHS)
def test_gathers_are_bounded_and_give_the_same_values(path, monkeypatch):
    """Scattered small rows are gathered a bounded number at a time (scratch memory on a
    GPU that the engine has mostly taken): same values, same order."""
    units = _units(64, seed=10)
    rows = _rows([60, 2, 33, 9, 41], [0, 2])
    whole = _sums(path, units, rows)
    monkeypatch.setattr(digest, "_GATHER_BYTES", 2 * LENGTH)  # a row or two a gather
    assert np.array_equal(_sums(path, units, rows), whole)
    assert np.array_equal(whole, _reference(units, rows))
