"""N x 3 descriptor arrays ``(address, length, device_id)`` as NIXL takes them.

A region is cut into equal *pieces* per block (a whole block, ``c`` chunks of a split
block, or per-layer state runs); the full table lists every piece of every block::

    row  b * num_pieces + j  ->  base + b * stride + offsets[j],  length

Tables are built once (prepared lists); transfers pick rows by index, see
:func:`piece_indices`. Everything is vectorised numpy: no per-block Python loops.
"""

from __future__ import annotations

import numpy as np

from kvbridge.layouts.errors import BlockIdError, LayoutError
from kvbridge.layouts.region import KVRegion


def piece_offsets(region: KVRegion, num_pieces: int) -> np.ndarray:
    """Offsets of ``num_pieces`` equal chunks of a block."""
    if num_pieces <= 0 or region.block_bytes % num_pieces:
        raise LayoutError(
            f"region {region.name!r}: {region.block_bytes} bytes per block cannot be cut "
            f"into {num_pieces} equal pieces"
        )
    return np.arange(num_pieces, dtype=np.int64) * (region.block_bytes // num_pieces)


def descriptor_table(
    region: KVRegion, offsets: np.ndarray | None = None, length: int | None = None
) -> np.ndarray:
    """Descriptors for every piece of every block of ``region``."""
    return block_descriptors(
        region, np.arange(region.num_blocks, dtype=np.int64), offsets=offsets, length=length
    )


def block_descriptors(
    region: KVRegion,
    block_ids: np.ndarray,
    *,
    offsets: np.ndarray | None = None,
    length: int | None = None,
) -> np.ndarray:
    """Descriptors of the pieces ``offsets`` (default: the whole block) of ``block_ids``,
    block-major, as an ``(len(block_ids) * len(offsets), 3)`` int64 array."""
    ids = _check_ids(region, block_ids)
    offs = np.zeros(1, dtype=np.int64) if offsets is None else np.asarray(offsets, np.int64)
    size = region.block_bytes if length is None else int(length)
    if size <= 0 or offs.ndim != 1 or offs.size == 0:
        raise LayoutError(f"region {region.name!r}: need a positive length and 1-D offsets")
    if offs.min() < 0 or offs.max() + size > region.block_bytes:
        raise LayoutError(
            f"region {region.name!r}: pieces at offsets up to {int(offs.max())} of {size} "
            f"bytes overrun the {region.block_bytes}-byte block"
        )
    out = np.empty((ids.size * offs.size, 3), dtype=np.int64)
    addr = out[:, 0].reshape(ids.size, offs.size)
    np.add((region.base_addr + ids * region.block_stride_bytes)[:, None], offs[None, :], out=addr)
    out[:, 1] = size
    out[:, 2] = region.device_id
    return out


def piece_indices(block_ids: np.ndarray, num_pieces: int, pieces: np.ndarray | None = None):
    """Rows of a :func:`descriptor_table` for pieces ``pieces`` (default all) of blocks,
    block-major, as int32 (what ``make_prepped_xfer`` wants)."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    sel = np.arange(num_pieces, dtype=np.int64) if pieces is None else np.asarray(pieces, np.int64)
    return (ids[:, None] * num_pieces + sel[None, :]).reshape(-1).astype(np.int32)


def _check_ids(region: KVRegion, block_ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if ids.size:
        bad = ids[(ids < 0) | (ids >= region.num_blocks)]
        if bad.size:
            raise BlockIdError(
                f"region {region.name!r}: block ids {bad[:8].tolist()} outside "
                f"[0, {region.num_blocks})"
            )
    return ids
