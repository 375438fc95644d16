"""Digests of the bytes a load moves: one read-only pass, on the device that holds them.

A load moves descriptor *rows* of a region (``kvbridge.layouts.descriptors``: row
``b * m + j`` is piece ``j`` of block ``b``). Both sides of a load can name the rows it
moves in the order it moves them: prefill the rows it READs from or WRITEs out of, decode
the rows they land in. Each side reads every row as words, weights each word by an odd
weight for its position in the row and sums (wrapping at 64 bits), then folds the row
values in their order with an odd weight per position::

    row r        words w_0, w_1, ..., w_{n-1}       (n = length / word_bytes(length))
    row value    v_r = sum_i  w_i * c_i                     (mod 2**64, c_i odd, mixed)
    digest       sum_k  v_k * (2k + 1) * 0x9E3779B97F4A7C15   (mod 2**64)

The word size comes from the piece length alone (:func:`word_bytes`), which both sides
share through the plan; each side's offsets, block stride and base address may differ
(a host mirror, a staging slot, another block size), so rows that are not aligned to
their words on one side are gathered into aligned scratch first. Words are read little
endian, sign-extended (1-byte words: unsigned), the same in numpy and torch.

Equal bytes give equal digests on any device. A row holding another row's bytes (a
swapped block, a block of another request), a row partly overwritten, zeroed or
missing, and a row whose own words moved (its halves swapped, K and V swapped inside it,
any permutation of its words) changes the digest, unless the changes cancel modulo
2**64, which a corruption that is not crafted does not do. What it cannot see: bytes it
is not asked to read (rows outside the load, padding between pieces), a change made
before the writer digests (the digest proves decode holds what prefill had, not that
prefill's bytes were right), and collisions one builds on purpose (it is a checksum, not
a MAC). Which rows and in which order is the caller's business
(``kvbridge.connector.worker.digests``).

Rows are read straight from the region's memory: a dense run of blocks as one strided
reduction; scattered large rows (a cross-layer block) one by one in host memory; else
gathered first (one copy, where a loop over many small rows, or a kernel launch per row on
a GPU, would cost more than the bytes). Host memory is read with numpy on the calling
thread (no parallel region to wait for), GPU memory with torch on the device. Cost:
docs/performance.md, "Verified loads".
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvbridge.layouts.errors import LayoutError

# 1: plain word sums per row, words as wide as each side's alignment allowed
# 2: position-weighted row values, words from the piece length alone
DIGEST_VERSION = 2

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TORCH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_NUMPY = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}
# a run of blocks at most this many times the rows asked is read in place (strided),
# sparser ones are gathered first
_DENSE = 2
_LARGE_ROW = 16 << 10  # host rows this long are reduced one by one; shorter ones gathered
_GATHER_BYTES = 64 << 20  # scratch at a time (gathered rows, GPU products)


def word_bytes(length: int) -> int:
    """The size of the words a ``length``-byte piece is read in: the widest of 8, 4, 2
    and 1 bytes that divides it (from the length alone: both sides of a load agree)."""
    return next(size for size in (8, 4, 2, 1) if length % size == 0)


@functools.lru_cache(maxsize=64)
def position_weights(num_words: int) -> np.ndarray:
    """The odd weight of each word position in a row (int64, read-only): splitmix64 of
    the position, so that two positions' weights differ in their low bits too (a
    linear ``2i + 1`` would let a swap of far-apart words lose their distance's bits)."""
    z = (np.arange(num_words, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
    out = z.view(np.int64)
    out.flags.writeable = False
    return out


def row_sums(units: torch.Tensor, offsets: np.ndarray, length: int, rows: np.ndarray) -> np.ndarray:
    """The value of each row (its words weighted by position, wrapped int64 sum), in
    ``rows`` order.

    ``units``: a region's memory as ``[num_blocks, block_bytes]`` uint8 (rows of blocks
    ``stride(0)`` bytes apart, as ``UnitSlot.units``); ``offsets``: the ``m`` piece offsets
    of a block; ``length``: bytes per piece; ``rows``: descriptor rows ``b * m + j``."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
    m = offs.size
    if units.dim() != 2 or units.dtype != torch.uint8 or units.stride(1) != 1:
        raise LayoutError(f"digest: units must be [blocks, bytes] uint8 rows, got {units.shape}")
    if m == 0 or length <= 0 or offs.min() < 0 or offs.max() + length > units.shape[1]:
        raise LayoutError(
            f"digest: pieces at offsets {offs[:4].tolist()} of {length} bytes do not fit "
            f"{units.shape[1]}-byte blocks"
        )
    if rows.size and (rows.min() < 0 or rows.max() >= units.shape[0] * m):
        raise LayoutError(
            f"digest: rows {rows.min()}..{rows.max()} outside the {units.shape[0] * m} rows "
            f"of {units.shape[0]} blocks x {m} pieces"
        )
    if not rows.size:
        return np.zeros(0, dtype=np.int64)
    if units.is_cuda:
        return torch_row_sums(units, offs, length, rows)
    # host memory: numpy, one thread, no parallel region per reduction (torch's threads
    # wait for cores the engine's and NIXL's threads hold: measured 2.0 s for 256 MiB of
    # scattered rows beside a NIXL agent on 2 cores, against 27 ms alone)
    size = word_bytes(length)
    weights = position_weights(length // size)
    aligned = _aligned(units, offs, size)
    raw = units.numpy()
    out = np.zeros(rows.size, dtype=np.int64)
    for j, at, ids in _by_piece(rows, m):
        piece = raw[:, int(offs[j]) : int(offs[j]) + length]
        lo, hi = int(ids.min()), int(ids.max()) + 1
        if aligned and hi - lo <= _DENSE * ids.size:  # a dense run: in place, pick the rows
            words = piece[lo:hi].view(_NUMPY[size])
            out[at] = np.einsum("ij,j->i", words, weights)[ids - lo]
        elif aligned and length >= _LARGE_ROW:  # large rows: one in-place reduction each
            words = piece.view(_NUMPY[size])
            out[at] = [int(np.einsum("j,j->", words[b], weights)) for b in ids.tolist()]
        else:  # many small rows, or unaligned here: gathered (bounded, aligned scratch)
            step = max(1, _GATHER_BYTES // length)
            for k in range(0, ids.size, step):
                words = piece[ids[k : k + step]].view(_NUMPY[size])
                out[at[k : k + step]] = np.einsum("ij,j->i", words, weights)
    return out


def torch_row_sums(
    units: torch.Tensor, offs: np.ndarray, length: int, rows: np.ndarray
) -> np.ndarray:
    """:func:`row_sums` with torch on the device that holds ``units`` (what a GPU region
    takes; the same values as the numpy path): a dense run read in place, else gathers;
    products in bounded scratch; the values stay on the device until one copy at the end.
    Arguments as :func:`row_sums`, already checked."""
    size = word_bytes(length)
    weights = torch.from_numpy(position_weights(length // size).copy()).to(units.device)
    aligned = _aligned(units, offs, size)
    step = max(1, _GATHER_BYTES // (length + 8 * (length // size)))  # bytes + products
    where, parts = [], []
    for j, at, ids in _by_piece(rows, offs.size):
        piece = units[:, int(offs[j]) : int(offs[j]) + length]
        lo, hi = int(ids.min()), int(ids.max()) + 1
        if aligned and hi - lo <= _DENSE * ids.size:
            words = piece[lo:hi].view(_TORCH[size])
            values = torch.cat(
                [(words[k : k + step] * weights).sum(dim=1) for k in range(0, hi - lo, step)]
            )
            parts.append(values[torch.from_numpy(ids - lo).to(values.device)])
            where.append(at)
            continue
        for k in range(0, ids.size, step):  # bounded scratch beside the engine's cache
            index = torch.from_numpy(ids[k : k + step]).to(units.device)
            words = piece.index_select(0, index).view(_TORCH[size])  # fresh: aligned
            parts.append((words * weights).sum(dim=1))
            where.append(at[k : k + step])
    out = np.zeros(rows.size, dtype=np.int64)
    out[np.concatenate(where)] = torch.cat(parts).cpu().numpy()
    return out


def fold(sums: np.ndarray) -> int:
    """The digest of row values in their order (see the module docstring)."""
    s = np.asarray(sums, dtype=np.int64).reshape(-1).view(np.uint64)
    weights = (np.arange(s.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * _GOLDEN
    return int(np.add.reduce(s * weights, dtype=np.uint64)) if s.size else 0


def _by_piece(rows: np.ndarray, m: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``rows`` grouped by piece: (piece, where in ``rows``, block ids)."""
    if m == 1:  # one piece a block (cross-layer blocks): rows are block ids
        return [(0, np.arange(rows.size), rows)]
    blocks, pieces = np.divmod(rows, m)
    out = []
    for j in np.unique(pieces).tolist():
        at = np.flatnonzero(pieces == j)
        out.append((j, at, blocks[at]))
    return out


def _aligned(units: torch.Tensor, offsets: np.ndarray, size: int) -> bool:
    """Whether every piece's words can be read in place here: offsets, block stride,
    base address and offset in its storage all multiples of the word size (else its rows
    are gathered first)."""
    return (
        not np.any(offsets % size)
        and units.stride(0) % size == 0
        and units.data_ptr() % size == 0
        and units.storage_offset() % size == 0
    )
