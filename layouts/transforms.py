"""In-place block rewrites: NHD<->HND, split into smaller blocks, merge from smaller blocks.

Every rewrite is one move from a source :class:`BlockArrangement` to a destination one
(see ``arrangement.py``), applied to chosen block ids of one group::

    permute:  1 x n x NHD  ->  1 x n x HND            (layout change only)
    split:    1 x n x NHD  ->  r x m x HND            (sender, after save: r receiver blocks)
    merge:    r x m x NHD  ->  1 x n x HND            (receiver, after load)

A rewrite moves contiguous runs (``run_permutation``) through a bounded scratch; how is
``staging.py``'s business. Every rewrite takes two keywords:

- ``scratch_budget_bytes``: the most scratch it may allocate, in whole units, at least one
  unit (default: one block of the group on a CPU, 64 MiB on a GPU);
- ``strategy``: a :class:`RewriteStrategy` (default: chosen from the device of the
  buffers by ``RewriteStrategy.for_device``: SMALL_SCRATCH on a CPU, BATCHED elsewhere;
  FUSED, one Triton kernel, when asked for by name).

:class:`TransformStats` reports the scratch actually used and the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.arrangement import BlockArrangement, UnitGeometry, run_permutation, same_bytes
from kvbridge.layouts.errors import BlockIdError, LayoutError
from kvbridge.layouts.fused_rewrite import fused_plan, fused_rewrite
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import AttentionSpec
from kvbridge.layouts.staging import RewriteStrategy, allocate_scratch, rewrite_rows


@dataclass(frozen=True, kw_only=True)
class TransformStats:
    """What a rewrite did: blocks touched, bytes moved, the scratch used and how."""

    num_blocks: int
    bytes_moved: int
    scratch_bytes: int
    strategy: RewriteStrategy | None = None  # None: nothing to rewrite


_NOTHING = TransformStats(num_blocks=0, bytes_moved=0, scratch_bytes=0)


def rewrite_units(
    units: torch.Tensor,
    geometry: UnitGeometry,
    block_ids: np.ndarray,
    src: BlockArrangement,
    dst: BlockArrangement,
    *,
    scratch_budget_bytes: int | None = None,
    strategy: RewriteStrategy | None = None,
) -> TransformStats:
    """Rewrite rows ``block_ids`` of ``units`` from ``src`` to ``dst`` in place.

    Scratch: whole units within ``scratch_budget_bytes`` (default: one unit on a CPU,
    64 MiB on a GPU), at least one. Block ids must be unique (a block rewritten twice would
    be scrambled).
    """
    ids = _check_rewrite_ids(block_ids, units.shape[0])
    if ids.size == 0 or same_bytes(geometry, src, dst):
        return _NOTHING
    return _rewrite(
        [units],
        geometry,
        ids,
        src,
        dst,
        block_bytes=geometry.unit_bytes,
        budget_bytes=scratch_budget_bytes,
        strategy=strategy,
    )


def rewrite_group(
    buffers: KVCacheBuffers,
    group_id: int,
    block_ids: np.ndarray,
    src: BlockArrangement,
    dst: BlockArrangement,
    *,
    scratch_budget_bytes: int | None = None,
    strategy: RewriteStrategy | None = None,
) -> TransformStats:
    """Rewrite a group's blocks in every region that holds them, with one scratch shared
    by the regions: whole units within ``scratch_budget_bytes`` (default: one block of the
    group on a CPU, 64 MiB on a GPU), at least one."""
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
        return _NOTHING
    return _rewrite(
        [slot.units for slot in slots],
        geometry,
        ids,
        src,
        dst,
        block_bytes=buffers.group_block_bytes(group_id),
        budget_bytes=scratch_budget_bytes,
        strategy=strategy,
    )


def _rewrite(
    unit_tensors: list[torch.Tensor],
    geometry: UnitGeometry,
    ids: np.ndarray,
    src: BlockArrangement,
    dst: BlockArrangement,
    *,
    block_bytes: int,
    budget_bytes: int | None,
    strategy: RewriteStrategy | None,
) -> TransformStats:
    """Rewrite rows ``ids`` of every tensor of ``unit_tensors`` (same geometry), sharing one
    scratch; ``block_bytes`` is what the CPU default budget calls one block."""
    device = unit_tensors[0].device
    if strategy is None:
        strategy = RewriteStrategy.for_device(device)
    if budget_bytes is None:
        budget_bytes = strategy.default_budget_bytes(block_bytes)
    run, runs = run_permutation(geometry, src, dst)
    moved = int(ids.size) * geometry.unit_bytes * len(unit_tensors)
    run_bytes = run * geometry.itemsize
    fused = strategy is RewriteStrategy.FUSED
    plans = [fused_plan(u, runs, run_bytes) for u in unit_tensors] if fused else []
    if fused and all(plan is not None for plan in plans):
        # both index tables in one upload, before any kernel is queued
        both = torch.as_tensor(np.concatenate([ids, runs]).astype(np.int64), device=device)
        ids_t, runs_t = both[: ids.size], both[ids.size :]
        for units, plan in zip(unit_tensors, plans, strict=True):
            assert plan is not None
            fused_rewrite(units, ids_t, runs, runs_t, plan)
        return TransformStats(
            num_blocks=int(ids.size), bytes_moved=moved, scratch_bytes=0, strategy=strategy
        )
    scratch = allocate_scratch(unit_tensors[0], geometry.unit_bytes, ids.size, budget_bytes)
    rewrite_rows(unit_tensors, ids, run_bytes, runs, scratch, strategy)
    return TransformStats(
        num_blocks=int(ids.size),
        bytes_moved=moved,
        scratch_bytes=scratch.numel(),
        strategy=strategy,
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


def permute_layout(
    buffers: KVCacheBuffers,
    group_id: int,
    block_ids: np.ndarray,
    to_layout: KVLayout,
    *,
    scratch_budget_bytes: int | None = None,
    strategy: RewriteStrategy | None = None,
) -> TransformStats:
    """NHD <-> HND in place, keeping the kernel sub-block structure."""
    native = _native(buffers, group_id)
    dst = BlockArrangement(layout=to_layout, sub_blocks_per_chunk=native.sub_blocks_per_chunk)
    return rewrite_group(
        buffers,
        group_id,
        block_ids,
        native,
        dst,
        scratch_budget_bytes=scratch_budget_bytes,
        strategy=strategy,
    )


def split_blocks(
    buffers: KVCacheBuffers,
    group_id: int,
    block_ids: np.ndarray,
    *,
    sub_block_size: int,
    kernel_block_size: int | None = None,
    to_layout: KVLayout | None = None,
    scratch_budget_bytes: int | None = None,
    strategy: RewriteStrategy | None = None,
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
    return rewrite_group(
        buffers,
        group_id,
        block_ids,
        native,
        dst,
        scratch_budget_bytes=scratch_budget_bytes,
        strategy=strategy,
    )


def merge_blocks(
    buffers: KVCacheBuffers,
    group_id: int,
    block_ids: np.ndarray,
    *,
    sub_block_size: int,
    kernel_block_size: int | None = None,
    from_layout: KVLayout | None = None,
    scratch_budget_bytes: int | None = None,
    strategy: RewriteStrategy | None = None,
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
    return rewrite_group(
        buffers,
        group_id,
        block_ids,
        src,
        native,
        scratch_budget_bytes=scratch_budget_bytes,
        strategy=strategy,
    )


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
