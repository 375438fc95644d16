"""In-place block rewrites: NHD<->HND, split into smaller blocks, merge from smaller blocks.

Every rewrite is one move from a source :class:`BlockArrangement` to a destination one
(see ``arrangement.py``), applied to chosen block ids of one group::

    permute:  1 x n x NHD  ->  1 x n x HND            (layout change only)
    split:    1 x n x NHD  ->  r x m x HND            (sender, after save: r receiver blocks)
    merge:    r x m x NHD  ->  1 x n x HND            (receiver, after load)

Scratch memory is bounded by ONE block of the group (all its layers). A rewrite moves
contiguous runs (``run_permutation``); whole rows are moved with the widest element type
their alignment allows, because torch's gather/scatter kernels cost per element::

    two units or more fit:  rows --gather--> scratch A --permute runs--> scratch B
                            scratch B --scatter rows--> rows     (batches, A + B <= limit)
    only one unit fits:     row --copy--> scratch --permute runs--> row   (one row at a time)

The permute step reads scratch (cache resident) and writes sequentially, so the buffer
itself is read once and written once, as by a plain copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from layouts.allocation import KVCacheBuffers, UnitSlot
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
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return TransformStats(num_blocks=0, bytes_moved=0, scratch_bytes=0)
    if np.unique(ids).size != ids.size:
        raise LayoutError(f"block ids must be unique for an in-place rewrite, got {ids.tolist()}")
    bad = ids[(ids < 0) | (ids >= units.shape[0])]
    if bad.size:
        raise BlockIdError(f"block ids {bad[:8].tolist()} outside [0, {units.shape[0]})")
    if same_bytes(geometry, src, dst):
        return TransformStats(num_blocks=0, bytes_moved=0, scratch_bytes=0)
    unit_bytes = geometry.unit_bytes
    limit = max(unit_bytes, scratch_limit_bytes or unit_bytes)
    run, runs = run_permutation(geometry, src, dst)
    run_bytes = run * geometry.itemsize
    device = units.device
    # gather form of the permutation: destination run k takes source run src_of[k]
    src_of = np.empty_like(runs)
    src_of[runs] = np.arange(runs.size, dtype=runs.dtype)
    ids_t = torch.as_tensor(ids, device=device)
    batch = min(ids.size, limit // (2 * unit_bytes))
    if batch >= 1:
        scratch = _rewrite_batched(units, unit_bytes, ids_t, src_of, run_bytes, batch)
    else:
        scratch = _rewrite_row_by_row(units, unit_bytes, ids, src_of, run_bytes)
    return TransformStats(
        num_blocks=int(ids.size),
        bytes_moved=int(ids.size) * unit_bytes,
        scratch_bytes=scratch.numel(),
    )


def _rewrite_batched(
    units: torch.Tensor,
    unit_bytes: int,
    ids: torch.Tensor,
    src_of: np.ndarray,
    run_bytes: int,
    batch: int,
) -> torch.Tensor:
    """Rows in batches: gather into scratch A, permute runs into B, scatter B back."""
    row_dtype = _widest_dtype(unit_bytes, units.stride(0), units.storage_offset())
    run_dtype = _widest_dtype(run_bytes)
    run_elems = run_bytes // run_dtype.itemsize
    num_runs = src_of.size
    scratch = torch.empty((2 * batch, unit_bytes), dtype=torch.uint8, device=units.device)
    gathered, permuted = scratch[:batch], scratch[batch:]
    rows_view = units.view(row_dtype)
    index = np.arange(batch, dtype=np.int64)[:, None] * num_runs + src_of[None, :]
    run_index = torch.as_tensor(index.reshape(-1), device=units.device)
    for start in range(0, ids.numel(), batch):
        rows = ids[start : start + batch]
        k = rows.numel()
        torch.index_select(rows_view, 0, rows, out=gathered[:k].view(row_dtype))
        torch.index_select(
            gathered[:k].view(run_dtype).view(k * num_runs, run_elems),
            0,
            run_index[: k * num_runs],
            out=permuted[:k].view(run_dtype).view(k * num_runs, run_elems),
        )
        rows_view.index_copy_(0, rows, permuted[:k].view(row_dtype))
    return scratch


def _rewrite_row_by_row(
    units: torch.Tensor, unit_bytes: int, ids: np.ndarray, src_of: np.ndarray, run_bytes: int
) -> torch.Tensor:
    """One unit of scratch: copy a row out, gather its runs back in place. A Python loop
    over blocks, but each step moves a whole (large) unit, so the loop costs nothing."""
    run_dtype = _widest_dtype(run_bytes, units.stride(0), units.storage_offset())
    run_elems = run_bytes // run_dtype.itemsize
    scratch = torch.empty(unit_bytes, dtype=torch.uint8, device=units.device)
    scratch_runs = scratch.view(run_dtype).view(-1, run_elems)
    index = torch.as_tensor(src_of, device=units.device)
    rows_view = units.view(run_dtype)
    for row in ids.tolist():
        scratch.copy_(units[row])
        torch.index_select(scratch_runs, 0, index, out=rows_view[row].view(-1, run_elems))
    return scratch


def _widest_dtype(*sizes: int) -> torch.dtype:
    """The widest plain element type whose size divides every size (and offset) given;
    complex128 is used as a 16-byte bit container, never for arithmetic."""
    for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8):
        if all(size % dtype.itemsize == 0 for size in sizes):
            return dtype
    raise AssertionError("unreachable: uint8 divides everything")


def rewrite_group(
    buffers: KVCacheBuffers,
    group_id: int,
    block_ids: np.ndarray,
    src: BlockArrangement,
    dst: BlockArrangement,
) -> TransformStats:
    """Rewrite a group's blocks in every region that holds them; scratch <= one block."""
    spec = buffers.config.groups[group_id].spec
    if not isinstance(spec, AttentionSpec):
        raise LayoutError(
            f"group {group_id} is a {spec.kind.value} group; state pages have no token "
            f"layout to rewrite"
        )
    ids = buffers.check_block_ids(block_ids)
    limit = buffers.group_block_bytes(group_id)
    moved, scratch = 0, 0
    for slot in buffers.unit_slots(group_id):
        stats = _rewrite_slot(slot, ids, src, dst, limit)
        moved += stats.bytes_moved
        scratch = max(scratch, stats.scratch_bytes)
    touched = int(ids.size) if moved else 0  # like rewrite_units: a no-op touches nothing
    return TransformStats(num_blocks=touched, bytes_moved=moved, scratch_bytes=scratch)


def _rewrite_slot(
    slot: UnitSlot, ids: np.ndarray, src: BlockArrangement, dst: BlockArrangement, limit: int
) -> TransformStats:
    assert slot.geometry is not None
    return rewrite_units(slot.units, slot.geometry, ids, src, dst, scratch_limit_bytes=limit)


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
    return buffers.config.groups[group_id].spec.block_size
