"""In-place block rewrites: NHD<->HND, split into smaller blocks, merge from smaller blocks.

Every rewrite is one move from a source :class:`BlockArrangement` to a destination one
(see ``arrangement.py``), applied to chosen block ids of one group::

    permute:  1 x n x NHD  ->  1 x n x HND            (layout change only)
    split:    1 x n x NHD  ->  r x m x HND            (sender, after save: r receiver blocks)
    merge:    r x m x NHD  ->  1 x n x HND            (receiver, after load)

Scratch memory is bounded by ONE block of the group (all its layers). A rewrite moves
contiguous runs (``run_permutation``): rows are copied to scratch a batch of whole units
at a time (never more than the limit), then every run is scattered from scratch straight
to its destination inside its own row::

    rows --index_select--> scratch --index_copy_ (run by run)--> same rows

So the buffer is read once and written once, like a plain copy. Large units (>= 256 KiB)
are put back by one gather per row instead, which writes the row sequentially. Rows and
runs move as the widest element type their sizes and alignment allow: torch's
gather/scatter kernels cost per element, not per byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from layouts.allocation import KVCacheBuffers
from layouts.arrangement import BlockArrangement, UnitGeometry, run_permutation, same_bytes
from layouts.errors import BlockIdError, LayoutError
from layouts.layout import KVLayout
from layouts.specs import AttentionSpec


@dataclass(frozen=True, kw_only=True)
class TransformStats:
    """What a rewrite did: blocks touched, bytes moved, and the largest scratch used."""

    num_blocks: int
    bytes_moved: int
    scratch_bytes: int


def rewrite_units(
    units: torch.Tensor,
    geometry: UnitGeometry,
    block_ids: np.ndarray,
    src: BlockArrangement,
    dst: BlockArrangement,
    *,
    scratch_limit_bytes: int | None = None,
) -> TransformStats:
    """Rewrite rows ``block_ids`` of ``units`` from ``src`` to ``dst`` in place.

    ``scratch_limit_bytes`` caps the scratch (default: one unit); at least one unit is
    always needed. Block ids must be unique (a block rewritten twice would be scrambled).
    """
    ids = _check_rewrite_ids(block_ids, units.shape[0])
    if ids.size == 0 or same_bytes(geometry, src, dst):
        return TransformStats(num_blocks=0, bytes_moved=0, scratch_bytes=0)
    scratch = _scratch(units, geometry, ids.size, scratch_limit_bytes)
    _rewrite_rows(units, geometry, torch.as_tensor(ids, device=units.device), src, dst, scratch)
    return TransformStats(
        num_blocks=int(ids.size),
        bytes_moved=int(ids.size) * geometry.unit_bytes,
        scratch_bytes=scratch.numel(),
    )


def rewrite_group(
    buffers: KVCacheBuffers,
    group_id: int,
    block_ids: np.ndarray,
    src: BlockArrangement,
    dst: BlockArrangement,
) -> TransformStats:
    """Rewrite a group's blocks in every region that holds them; scratch <= one block."""
    slots = buffers.unit_slots(group_id)
    spec = buffers.config.groups[group_id].spec
    if not isinstance(spec, AttentionSpec):
        raise LayoutError(
            f"group {group_id} is a {spec.kind.value} group; state pages have no token "
            f"layout to rewrite"
        )
    ids = _check_rewrite_ids(buffers.check_block_ids(block_ids), buffers.config.num_blocks)
    geometry = slots[0].geometry
    assert geometry is not None and all(s.geometry == geometry for s in slots)
    if ids.size == 0 or same_bytes(geometry, src, dst):
        return TransformStats(num_blocks=0, bytes_moved=0, scratch_bytes=0)
    # one scratch for every region of the group: a group block spans all of its slots
    limit = buffers.group_block_bytes(group_id)
    scratch = _scratch(slots[0].units, geometry, ids.size, limit)
    ids_t = torch.as_tensor(ids, device=scratch.device)
    for slot in slots:
        _rewrite_rows(slot.units, geometry, ids_t, src, dst, scratch)
    return TransformStats(
        num_blocks=int(ids.size),
        bytes_moved=int(ids.size) * geometry.unit_bytes * len(slots),
        scratch_bytes=scratch.numel(),
    )


def _check_rewrite_ids(block_ids: np.ndarray, num_rows: int) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    unique, counts = np.unique(ids, return_counts=True)
    if unique.size != ids.size:
        repeated = unique[counts > 1][:8].tolist()
        raise LayoutError(
            f"block ids must be unique for an in-place rewrite (a block rewritten twice is "
            f"scrambled); repeated: {repeated}"
        )
    bad = ids[(ids < 0) | (ids >= num_rows)]
    if bad.size:
        raise BlockIdError(f"block ids {bad[:8].tolist()} outside [0, {num_rows})")
    return ids


def _scratch(
    units: torch.Tensor, geometry: UnitGeometry, num_ids: int, limit: int | None
) -> torch.Tensor:
    """Whole units of scratch: as many as ``limit`` allows (at least one), no more than ids."""
    unit_bytes = geometry.unit_bytes
    batch = max(1, min(num_ids, (limit or unit_bytes) // unit_bytes))
    return torch.empty((batch, unit_bytes), dtype=torch.uint8, device=units.device)


def _rewrite_rows(
    units: torch.Tensor,
    geometry: UnitGeometry,
    ids: torch.Tensor,
    src: BlockArrangement,
    dst: BlockArrangement,
    scratch: torch.Tensor,
) -> None:
    """Copy rows to scratch a batch at a time, then put every run of each row in place.

    Large units are rebuilt row by row with a gather (sequential writes into the row);
    small units with one run scatter per batch, since a torch call per row would cost
    more than the row's bytes. Measured in ``scripts/bench_layouts.py``."""
    run, runs = run_permutation(geometry, src, dst)
    if geometry.unit_bytes >= _ROW_GATHER_MIN_BYTES:
        _gather_row_by_row(units, ids, runs, run * geometry.itemsize, scratch)
    else:
        _scatter_batches(units, ids, runs, run * geometry.itemsize, scratch)


_ROW_GATHER_MIN_BYTES = 256 << 10


def _gather_row_by_row(
    units: torch.Tensor, ids: torch.Tensor, runs: np.ndarray, run_bytes: int, scratch: torch.Tensor
) -> None:
    batch, unit_bytes = scratch.shape
    dtype = _widest_dtype(run_bytes, unit_bytes, units.stride(0), units.storage_offset())
    run_elems = run_bytes // dtype.itemsize
    src_of = np.empty_like(runs)  # destination run k takes source run src_of[k]
    src_of[runs] = np.arange(runs.size, dtype=runs.dtype)
    src_of_t = torch.as_tensor(src_of, device=units.device)
    elems = units.view(dtype)
    row_ids = ids.tolist()  # one torch call per (large) row: the loop costs nothing
    for start in range(0, len(row_ids), batch):
        rows = row_ids[start : start + batch]
        part = scratch[: len(rows)].view(dtype)
        torch.index_select(elems, 0, ids[start : start + batch], out=part)
        for j, row in enumerate(rows):
            out = elems[row].view(-1, run_elems)
            torch.index_select(part[j].view(-1, run_elems), 0, src_of_t, out=out)


def _scatter_batches(
    units: torch.Tensor, ids: torch.Tensor, runs: np.ndarray, run_bytes: int, scratch: torch.Tensor
) -> None:
    batch, unit_bytes = scratch.shape
    row_stride = units.stride(0)
    # runs must tile the rows' address space: cut them at the row stride if needed
    piece = math.gcd(run_bytes, row_stride)
    per_run = run_bytes // piece
    dst_piece = (runs[:, None] * per_run + np.arange(per_run)).reshape(-1)
    dtype = _widest_dtype(piece, unit_bytes, row_stride, units.storage_offset())
    elems = units.view(dtype)
    piece_elems = piece // dtype.itemsize
    num_pieces = ((units.shape[0] - 1) * row_stride + unit_bytes) // piece
    # every piece of every row, as one (num_pieces, piece) table over the same memory
    pieces = elems.as_strided((num_pieces, piece_elems), (piece_elems, 1))
    dst_piece_t = torch.as_tensor(dst_piece, device=units.device)
    for start in range(0, ids.numel(), batch):
        rows = ids[start : start + batch]
        part = scratch[: rows.numel()].view(dtype)
        torch.index_select(elems, 0, rows, out=part)
        where = torch.add(dst_piece_t[None, :], rows[:, None], alpha=row_stride // piece)
        pieces.index_copy_(0, where.view(-1), part.view(-1, piece_elems))


def _widest_dtype(*sizes: int) -> torch.dtype:
    """The widest plain element type whose size divides every size (and offset) given;
    complex128 is used as a 16-byte bit container, never for arithmetic."""
    for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8):
        if all(size % dtype.itemsize == 0 for size in sizes):
            return dtype
    raise AssertionError("unreachable: uint8 divides everything")


def permute_layout(
    buffers: KVCacheBuffers, group_id: int, block_ids: np.ndarray, to_layout: KVLayout
) -> TransformStats:
    """NHD <-> HND in place, keeping the kernel sub-block structure."""
    native = _native(buffers, group_id)
    dst = BlockArrangement(layout=to_layout, sub_blocks_per_chunk=native.sub_blocks_per_chunk)
    return rewrite_group(buffers, group_id, block_ids, native, dst)


def split_blocks(
    buffers: KVCacheBuffers,
    group_id: int,
    block_ids: np.ndarray,
    *,
    sub_block_size: int,
    kernel_block_size: int | None = None,
    to_layout: KVLayout | None = None,
) -> TransformStats:
    """Sender after save: rewrite each block as ``block_size / sub_block_size`` contiguous
    sub-blocks, each laid out like a receiver block of ``sub_block_size`` tokens (kernel
    sub-blocks of ``kernel_block_size``, layout ``to_layout``)."""
    native = _native(buffers, group_id)
    dst = chunked_arrangement(
        _block_size(buffers, group_id),
        sub_block_size,
        kernel_block_size or sub_block_size,
        to_layout or native.layout,
    )
    return rewrite_group(buffers, group_id, block_ids, native, dst)


def merge_blocks(
    buffers: KVCacheBuffers,
    group_id: int,
    block_ids: np.ndarray,
    *,
    sub_block_size: int,
    kernel_block_size: int | None = None,
    from_layout: KVLayout | None = None,
) -> TransformStats:
    """Receiver after load: each block holds ``block_size / sub_block_size`` sender blocks
    back to back (kernel sub-blocks ``kernel_block_size``, layout ``from_layout``); rewrite
    them into this side's own format. The inverse of :func:`split_blocks`."""
    native = _native(buffers, group_id)
    src = chunked_arrangement(
        _block_size(buffers, group_id),
        sub_block_size,
        kernel_block_size or sub_block_size,
        from_layout or native.layout,
    )
    return rewrite_group(buffers, group_id, block_ids, src, native)


def chunked_arrangement(
    block_size: int, chunk_size: int, kernel_block_size: int, layout: KVLayout
) -> BlockArrangement:
    """A block of ``block_size`` tokens stored as chunks of ``chunk_size`` tokens, each
    made of kernel sub-blocks of ``kernel_block_size`` tokens."""
    if chunk_size <= 0 or block_size % chunk_size:
        raise LayoutError(
            f"sub-block size {chunk_size} does not divide block_size={block_size}; "
            f"block sizes must be multiples of each other"
        )
    if kernel_block_size <= 0 or chunk_size % kernel_block_size:
        raise LayoutError(
            f"kernel_block_size={kernel_block_size} does not divide the {chunk_size}-token "
            f"sub-block"
        )
    return BlockArrangement(
        layout=layout,
        num_chunks=block_size // chunk_size,
        sub_blocks_per_chunk=chunk_size // kernel_block_size,
    )


def _native(buffers: KVCacheBuffers, group_id: int) -> BlockArrangement:
    return buffers.format.native_arrangement(_block_size(buffers, group_id))


def _block_size(buffers: KVCacheBuffers, group_id: int) -> int:
    groups = buffers.config.groups
    if not 0 <= group_id < len(groups):
        raise LayoutError(f"group id {group_id} outside [0, {len(groups)})")
    return groups[group_id].spec.block_size
