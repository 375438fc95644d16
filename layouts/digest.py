"""Digests of the bytes a load moves: one read-only pass, on the device that holds them.

A load moves descriptor *rows* of a region (``kvbridge.layouts.descriptors``: row
``b * m + j`` is piece ``j`` of block ``b``). Both sides of a load can name the rows it
moves in the order it moves them: prefill the rows it READs from or WRITEs out of, decode
the rows they land in. Each side sums every row's words (integers of the widest size that
divides the row's offset and length, wrapping at 64 bits), then folds the row sums in
their order with an odd weight per position::

    row sums   s_0, s_1, ..., s_{n-1}                    (int64, one reduction per piece)
    digest     sum_k  s_k * (2k + 1) * 0x9E3779B97F4A7C15   (mod 2**64)

Equal bytes give equal digests on any device. A row holding another row's bytes (a
swapped block, a block of another request), a row partly overwritten, or a row missing
changes the digest (unless the changes cancel modulo 2**64, which a corruption that is
not crafted does not do). A permutation of words *inside* one row is not seen: the
digest proves that decode holds the pieces prefill sent, in their places, not that one
piece's own bytes were arranged right (that is the rewrite code's job, tested apart).

Rows are summed straight from the region's memory: a dense run of blocks as one strided
reduction; scattered large rows (a cross-layer block) one by one in host memory; else
gathered first (one copy, where a loop over many small rows, or a kernel launch per row on
a GPU, would cost more than the bytes). Host memory is summed with numpy on the calling
thread (no parallel region to wait for), GPU memory with torch on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from kvbridge.layouts.errors import LayoutError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_NUMPY = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}
# a run of blocks at most this many times the rows asked is summed in place (strided),
# sparser ones are gathered first
_DENSE = 2
_LARGE_ROW = 64 << 10  # host rows this long are reduced one by one; shorter ones gathered
_GATHER_BYTES = 64 << 20  # gathered rows at a time (scratch memory, on the GPU too)


def row_sums(units: torch.Tensor, offsets: np.ndarray, length: int, rows: np.ndarray) -> np.ndarray:
    """The wrapped int64 sum of each row's words, in ``rows`` order.

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
    out = np.zeros(rows.size, dtype=np.int64)
    if not rows.size:
        return out
    size, dtype = _word(units, offs, length)
    if units.is_cuda:
        return _device_sums(units, offs, length, rows, size, dtype)
    # host memory: numpy, one thread, no parallel region per reduction (torch's threads
    # wait for cores the engine's and NIXL's threads hold: measured 2.0 s for 256 MiB of
    # scattered rows beside a NIXL agent on 2 cores, against 27 ms alone)
    words = units.numpy().view(_NUMPY[size])
    out = np.zeros(rows.size, dtype=np.int64)
    if m == 1:  # one piece a block (cross-layer blocks): rows are block ids
        selections = [(0, np.arange(rows.size), rows)]
    else:
        blocks, pieces = np.divmod(rows, m)
        selections = []
        for j in np.unique(pieces).tolist():
            at = np.flatnonzero(pieces == j)
            selections.append((j, at, blocks[at]))
    for j, at, ids in selections:
        start = int(offs[j]) // size
        piece = words[:, start : start + length // size]
        lo, hi = int(ids.min()), int(ids.max()) + 1
        if hi - lo <= _DENSE * ids.size:  # a dense run: reduce in place, pick the rows
            out[at] = piece[lo:hi].sum(axis=1, dtype=np.int64)[ids - lo]
        elif length >= _LARGE_ROW:  # large rows: one in-place reduction each
            out[at] = [int(piece[b].sum(dtype=np.int64)) for b in ids.tolist()]
        else:  # many small rows: gathered (bounded scratch), one reduction a gather
            step = max(1, _GATHER_BYTES // length)
            for k in range(0, ids.size, step):
                out[at[k : k + step]] = piece[ids[k : k + step]].sum(axis=1, dtype=np.int64)
    return out


def _device_sums(
    units: torch.Tensor,
    offs: np.ndarray,
    length: int,
    rows: np.ndarray,
    size: int,
    dtype: torch.dtype,
) -> np.ndarray:
    """:func:`row_sums` on a GPU: a strided reduction over a dense run, else gathers of
    bounded size; the sums stay on the device until one copy at the end."""
    words = units.view(dtype) if size > 1 else units
    blocks, pieces = np.divmod(rows, offs.size)
    where, parts = [], []
    for j in np.unique(pieces).tolist():
        at = np.flatnonzero(pieces == j)
        ids = blocks[at]
        start = int(offs[j]) // size
        piece = words[:, start : start + length // size]
        lo, hi = int(ids.min()), int(ids.max()) + 1
        if hi - lo <= _DENSE * ids.size:
            sums = piece[lo:hi].sum(dim=1, dtype=torch.int64)
            parts.append(sums[torch.from_numpy(ids - lo).to(sums.device)])
            where.append(at)
            continue
        step = max(1, _GATHER_BYTES // length)  # bounded scratch beside the engine's cache
        for k in range(0, ids.size, step):
            index = torch.from_numpy(ids[k : k + step]).to(units.device)
            parts.append(piece.index_select(0, index).sum(dim=1, dtype=torch.int64))
            where.append(at[k : k + step])
    out = np.zeros(rows.size, dtype=np.int64)
    out[np.concatenate(where)] = torch.cat(parts).cpu().numpy()
    return out


def fold(sums: np.ndarray) -> int:
    """The digest of row sums in their order (see the module docstring)."""
    s = np.asarray(sums, dtype=np.int64).reshape(-1).view(np.uint64)
    weights = (np.arange(s.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * _GOLDEN
    return int(np.add.reduce(s * weights, dtype=np.uint64)) if s.size else 0


def _word(units: torch.Tensor, offsets: np.ndarray, length: int) -> tuple[int, torch.dtype]:
    """The widest integer that divides every piece's offset and length, the block stride
    and the base address (so the rows can be read as words of that size)."""
    for size, dtype in _WORDS:
        aligned = (
            length % size == 0
            and not np.any(offsets % size)
            and units.stride(0) % size == 0
            and units.shape[1] % size == 0
            and units.data_ptr() % size == 0
        )
        if aligned:
            return size, dtype
    raise AssertionError("a byte always divides")  # pragma: no cover
