"""How the bytes of one block are ordered inside a *unit*, and views that read them.

A unit is the contiguous run of bytes one region holds for one block (see
``allocation.py``): a cross-layer buffer holds ``num_layers`` layer pages per unit, a
blocks-first layer tensor one page (K and V), a kv-split layer tensor one part (K or V).

Inside a unit the tokens of a ``block_size``-token block are ordered by an arrangement::

    unit = [chunk 0][chunk 1] ... [chunk c-1]              c = num_chunks
    chunk = [layer 0][layer 1] ... [layer L-1]              L = layers in the unit
    layer = [sub 0][sub 1] ... [sub n-1]                    n = sub-blocks per chunk
    sub   = [part 0 (K)][part 1 (V)]                        parts in the unit
    (parts_outer: layer = [part 0: sub 0 .. sub n-1][part 1: ...], so K and V of a
    layer are each contiguous, which per-part (kv-split) peers need)
    part  = NHD [t, H, D] or HND [H, t, D]                  t = sub_block_size tokens

That is ``heads=HeadOrder.INNER``, where ``layout`` places the heads inside a part. The
head-major orders put the heads outermost so that a slice of heads (a tensor-parallel
rank's share) is one contiguous byte range; ``layout`` then changes no byte::

    HeadOrder.IN_LAYER ("layer"): a slice of heads of one layer of a chunk is contiguous
    chunk = [layer 0] ... [layer L-1]
    layer = [head 0][head 1] ... [head H-1]
    head  = [sub 0 .. sub n-1] x [part 0 .. P-1]            (or parts x subs: parts_outer)
    part  = [t, D]

    HeadOrder.IN_CHUNK ("chunk"): a slice of heads of a whole chunk (all its layers) is
    contiguous
    chunk = [head 0][head 1] ... [head H-1]
    head  = [layer 0] ... [layer L-1]
    layer = [sub 0 .. sub n-1] x [part 0 .. P-1]            (or parts x subs: parts_outer)
    part  = [t, D]

token index = (chunk * n + sub) * t + slot

The *native* arrangement of a side has one chunk and kernel-block sub-blocks. A sender
whose blocks are ``r`` times larger than the receiver's rewrites a block as ``r`` chunks,
each laid out exactly like one receiver block (split); a receiver whose blocks are larger
reads ``r`` sender blocks into the chunks of one block and rewrites it (merge).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from functools import lru_cache

import numpy as np
import torch

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.layout import KVLayout

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, kw_only=True)
class UnitGeometry:
    """What one unit holds: layers x parts x block_size tokens x heads x head_size."""

    num_layers: int
    num_kv_parts: int
    block_size: int
    num_heads: int
    head_size: int
    itemsize: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_parts", "block_size", "num_heads", "head_size"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"UnitGeometry.{name}={getattr(self, name)} must be positive")
        if self.itemsize not in _INT_OF_SIZE:
            raise LayoutError(f"itemsize={self.itemsize} must be one of {sorted(_INT_OF_SIZE)}")

    @property
    def elems_per_token(self) -> int:
        return self.num_heads * self.head_size

    @property
    def unit_elems(self) -> int:
        return self.num_layers * self.num_kv_parts * self.block_size * self.elems_per_token

    @property
    def unit_bytes(self) -> int:
        return self.unit_elems * self.itemsize

    @property
    def element_dtype(self) -> torch.dtype:
        """An integer dtype of the element size: moves bits without float semantics."""
        return _INT_OF_SIZE[self.itemsize]


class HeadOrder(Enum):
    """Where the KV heads sit in a unit (see the module docstring)."""

    INNER = "inner"  # inside each part, as ``layout`` (NHD/HND) says
    IN_LAYER = "layer"  # outermost inside each layer of a chunk
    IN_CHUNK = "chunk"  # outermost inside each chunk, above the layers
    # A cache format, not an order inside a unit: each layer keeps every head's blocks
    # apart, heads above blocks (vLLM's LHBNC), so a unit is one (layer, head) of a block
    OUTER = "outer"

    @classmethod
    def parse(cls, value: str | HeadOrder) -> HeadOrder:
        if isinstance(value, HeadOrder):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise LayoutError(
                f"unknown head order {value!r}; expected one of {[h.value for h in cls]}"
            ) from None


@dataclass(frozen=True, kw_only=True)
class BlockArrangement:
    """``num_chunks`` chunks of ``sub_blocks_per_chunk`` sub-blocks, each in ``layout``."""

    layout: KVLayout
    num_chunks: int = 1
    sub_blocks_per_chunk: int = 1
    parts_outer: bool = False  # (part, sub-block) instead of (sub-block, part) in a layer
    heads: HeadOrder = HeadOrder.INNER  # head-major orders ignore ``layout``

    def __post_init__(self) -> None:
        if self.num_chunks <= 0 or self.sub_blocks_per_chunk <= 0:
            raise LayoutError(
                f"BlockArrangement: num_chunks={self.num_chunks} and "
                f"sub_blocks_per_chunk={self.sub_blocks_per_chunk} must be positive"
            )

    @classmethod
    def native(cls, layout: KVLayout, block_size: int, kernel_block_size: int) -> BlockArrangement:
        """A side's own arrangement: one chunk of kernel-sized sub-blocks."""
        from kvbridge.layouts.block_table import kernel_ratio

        return cls(layout=layout, sub_blocks_per_chunk=kernel_ratio(block_size, kernel_block_size))

    def sub_block_size(self, block_size: int) -> int:
        per = self.num_chunks * self.sub_blocks_per_chunk
        if block_size % per:
            raise LayoutError(
                f"{self} cannot hold a {block_size}-token block: {self.num_chunks} chunks x "
                f"{self.sub_blocks_per_chunk} sub-blocks does not divide {block_size}"
            )
        return block_size // per

    def __str__(self) -> str:
        order = "PN" if self.parts_outer else ""
        heads = "" if self.heads is HeadOrder.INNER else f"-H{self.heads.value}"
        return f"{self.num_chunks}x{self.sub_blocks_per_chunk}x{self.layout.value}{order}{heads}"


def canonical_view(units: torch.Tensor, geometry: UnitGeometry, arr: BlockArrangement):
    """View rows of ``units`` (N, unit_bytes uint8, rows contiguous) as
    ``(N, layers, parts, chunks, subs, t, heads, head_size)`` without copying."""
    if units.dtype != torch.uint8 or units.dim() != 2:
        raise LayoutError(
            f"units must be a 2-D uint8 tensor, got {units.dtype} {tuple(units.shape)}"
        )
    if units.shape[1] != geometry.unit_bytes:
        raise LayoutError(
            f"unit rows hold {units.shape[1]} bytes but the geometry needs {geometry.unit_bytes}"
        )
    if units.stride(1) != 1 or units.stride(0) % geometry.itemsize:
        raise LayoutError("unit rows must be contiguous and element aligned")
    g = geometry
    t = arr.sub_block_size(g.block_size)
    sizes = {
        "N": units.shape[0],
        "c": arr.num_chunks,
        "L": g.num_layers,
        "n": arr.sub_blocks_per_chunk,
        "P": g.num_kv_parts,
        "t": t,
        "H": g.num_heads,
        "D": g.head_size,
    }
    order = _raw_order(arr)
    shape = tuple(sizes[d] for d in order)
    row = units.stride(0) // g.itemsize
    strides = [row, *_contiguous(shape[1:])]
    elems = units.view(g.element_dtype)
    raw = elems.as_strided(shape, strides, elems.storage_offset())
    return raw.permute(*(order.index(d) for d in _CANONICAL_ORDER))


_CANONICAL_ORDER = ("N", "L", "P", "c", "n", "t", "H", "D")


def _raw_order(arr: BlockArrangement) -> tuple[str, ...]:
    """Dims of a row, outermost first, as the arrangement stores them."""
    subs = ("P", "n") if arr.parts_outer else ("n", "P")
    if arr.heads is HeadOrder.IN_CHUNK:
        return ("N", "c", "H", "L", *subs, "t", "D")
    if arr.heads is HeadOrder.IN_LAYER:
        return ("N", "c", "L", "H", *subs, "t", "D")
    inner = ("t", "H", "D") if arr.layout is KVLayout.NHD else ("H", "t", "D")
    return ("N", "c", "L", *subs, *inner)


def token_major(units: torch.Tensor, geometry: UnitGeometry, arr: BlockArrangement):
    """Copy rows out as ``(N, layers, parts, block_size, heads, head_size)``."""
    v = canonical_view(units, geometry, arr)
    g = geometry
    return v.reshape(
        units.shape[0], g.num_layers, g.num_kv_parts, g.block_size, g.num_heads, g.head_size
    )


@lru_cache(maxsize=256)
def same_bytes(geometry: UnitGeometry, a: BlockArrangement, b: BlockArrangement) -> bool:
    """True when two arrangements put every element at the same byte (no rewrite needed).
    Cached per triple (rewrites ask once per region)."""
    if a == b:
        return True
    probe = replace(geometry, head_size=1, itemsize=8)
    return bool(np.array_equal(element_offsets(probe, a), element_offsets(probe, b)))


@lru_cache(maxsize=64)
def run_permutation(
    geometry: UnitGeometry, src: BlockArrangement, dst: BlockArrangement
) -> tuple[int, np.ndarray]:
    """``(R, runs)``: rewriting a unit from ``src`` to ``dst`` moves contiguous runs of ``R``
    elements; ``runs[j]`` is the destination run of source run ``j``. Cached per triple."""
    off_src = element_offsets(geometry, src)
    off_dst = element_offsets(geometry, dst)
    perm = np.empty_like(off_src)
    perm[off_dst] = off_src  # dst element p takes src element perm[p]
    n = perm.size
    starts = np.flatnonzero(np.diff(perm) != 1) + 1
    run = int(np.gcd.reduce(np.concatenate([[n], starts, perm[starts], perm[:1]])))
    src_of_dst_run = perm[::run] // run
    runs = np.empty_like(src_of_dst_run)
    runs[src_of_dst_run] = np.arange(src_of_dst_run.size)
    return run, runs


def element_offsets(geometry: UnitGeometry, arr: BlockArrangement) -> np.ndarray:
    """Element offset inside a unit of every element, in token-major order
    ``(layer, part, token, head, dim)``."""
    g = replace(geometry, itemsize=8)
    units = torch.zeros((1, g.unit_bytes), dtype=torch.uint8)
    units.view(torch.int64).copy_(torch.arange(g.unit_elems, dtype=torch.int64).view(1, -1))
    return canonical_view(units, g, arr).reshape(-1).numpy().copy()


def _contiguous(shape: tuple[int, ...]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides
