"""Physical layouts of one layer's attention cache: shapes, strides, byte offsets.

Per block, K and V each hold ``block_size x num_heads x head_size`` elements in one of::

    NHD: [block_size, num_heads, head_size]   (token-major inside the block)
    HND: [num_heads, block_size, head_size]   (head-major inside the block)

and a layer's tensor packs K/V and blocks in one of::

    KV_SPLIT:     (2, num_blocks, *block)     all K blocks, then all V blocks
    BLOCKS_FIRST: (num_blocks, 2, *block)     K and V of a block side by side

MLA caches have one part (the latent) instead of two; ``num_kv_parts`` says which.
"""

from __future__ import annotations

import enum

import numpy as np

from kvbridge.layouts.errors import LayoutError


class KVLayout(enum.Enum):
    NHD = "NHD"
    HND = "HND"

    @classmethod
    def parse(cls, value: str | KVLayout) -> KVLayout:
        if isinstance(value, KVLayout):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            raise LayoutError(f"unknown KV layout {value!r}; expected 'NHD' or 'HND'") from None


class KVPacking(enum.Enum):
    KV_SPLIT = "kv_split"
    BLOCKS_FIRST = "blocks_first"

    @classmethod
    def parse(cls, value: str | KVPacking) -> KVPacking:
        if isinstance(value, KVPacking):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise LayoutError(
                f"unknown KV packing {value!r}; expected 'kv_split' or 'blocks_first'"
            ) from None


def block_shape(
    layout: KVLayout, block_size: int, num_heads: int, head_size: int
) -> tuple[int, int, int]:
    """Shape of one K (or V) block."""
    if layout is KVLayout.NHD:
        return (block_size, num_heads, head_size)
    return (num_heads, block_size, head_size)


def layer_cache_shape(
    packing: KVPacking,
    layout: KVLayout,
    *,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    num_kv_parts: int = 2,
) -> tuple[int, ...]:
    """Shape of a contiguous per-layer cache tensor."""
    block = block_shape(layout, block_size, num_heads, head_size)
    if packing is KVPacking.KV_SPLIT:
        return (num_kv_parts, num_blocks, *block)
    return (num_blocks, num_kv_parts, *block)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def element_offsets(
    packing: KVPacking,
    layout: KVLayout,
    *,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    kv_part: np.ndarray | int,
    block_id: np.ndarray | int,
    token: np.ndarray | int,
    head: np.ndarray | int,
    num_kv_parts: int = 2,
) -> np.ndarray:
    """Element offsets (multiply by itemsize for bytes) of ``(kv_part, block, token, head, 0)``
    in a contiguous per-layer cache; arguments broadcast like numpy arrays."""
    kv = np.asarray(kv_part, dtype=np.int64)
    blk = np.asarray(block_id, dtype=np.int64)
    tok = np.asarray(token, dtype=np.int64)
    hd = np.asarray(head, dtype=np.int64)
    if np.any((blk < 0) | (blk >= num_blocks)):
        raise LayoutError(f"block ids must lie in [0, {num_blocks})")
    if np.any((tok < 0) | (tok >= block_size)):
        raise LayoutError(f"token slots must lie in [0, {block_size})")
    if np.any((hd < 0) | (hd >= num_heads)):
        raise LayoutError(f"heads must lie in [0, {num_heads})")
    if np.any((kv < 0) | (kv >= num_kv_parts)):
        raise LayoutError(f"kv parts must lie in [0, {num_kv_parts})")
    shape = layer_cache_shape(
        packing,
        layout,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=num_heads,
        head_size=head_size,
        num_kv_parts=num_kv_parts,
    )
    strides = contiguous_strides(shape)
    if packing is KVPacking.KV_SPLIT:
        s_kv, s_blk = strides[0], strides[1]
    else:
        s_blk, s_kv = strides[0], strides[1]
    s_a, s_b = strides[2], strides[3]
    s_tok, s_head = (s_a, s_b) if layout is KVLayout.NHD else (s_b, s_a)
    return kv * s_kv + blk * s_blk + tok * s_tok + hd * s_head
