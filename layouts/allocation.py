"""KV-cache allocation: per-layer tensors or one canonical cross-layer buffer.

Cross-layer (canonical) allocation puts every layer's page of block ``b`` side by side,
layers group-major, so one group's pages of one block are one contiguous run::

    row b: [ g0 L0 page | g0 L1 page | ... | g1 L0 page | ... ]     (num_blocks rows)
           |<------- group 0 unit ------->|<--- group 1 unit -->

Inside an attention page: ``r = block_size / kernel_block_size`` kernel sub-blocks, each
``[K | V]`` in the layout (NHD or HND). State pages hold the state tensors back to back,
then padding.

Per-layer allocation keeps one tensor per layer, packed KV_SPLIT ``(2, kernel_blocks,
...)`` or BLOCKS_FIRST ``(kernel_blocks, 2, ...)``. Heads-outer per-layer allocation
(``HeadOrder.OUTER``, vLLM's LHBNC) keeps, per layer, each head's blocks apart::

    layer tensor: [ head 0: block 0 | block 1 | ... ][ head 1: block 0 | ... ] ...
                            |<- run ->|               run = block_size * C bytes

so a block of one layer is ``H`` runs ``num_blocks * run`` bytes apart: every (layer,
head) is a region of its own, whose unit is one run (``L * H`` regions and descriptors
per block; K|V interleaved in ``C``). Either way the buffers describe
themselves as :class:`UnitSlot` s (rows of bytes per block, plus the region NIXL sees), so
transforms and descriptor code never branch on the allocation kind.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kvbridge.layouts.arrangement import BlockArrangement, HeadOrder, UnitGeometry
from kvbridge.layouts.block_table import kernel_ratio
from kvbridge.layouts.errors import BlockIdError, LayoutError
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.region import KVRegion, MemoryKind
from kvbridge.layouts.specs import AttentionSpec, StateSpec


@dataclass(frozen=True, kw_only=True)
class CacheFormat:
    """How one side stores its blocks (the block size itself lives in the specs)."""

    layout: KVLayout = KVLayout.NHD
    kernel_block_size: int | None = None  # None: same as the manager block size
    cross_layer: bool = False
    packing: KVPacking = KVPacking.BLOCKS_FIRST  # per-layer only; pages are [K|V] in rows
    # Non-empty: the engine orders the elements of each page its own way (e.g. vLLM's CPU
    # attention stores K transposed), named by this id. kvbridge then moves pages whole
    # and only between sides with the same id and the same block size.
    block_packing: str = ""
    # with block_packing: each head's elements form one contiguous run of the page, heads
    # in order (a slice of heads is a byte range; tensor parallelism reads one)
    packed_heads_major: bool = False
    # Where the KV heads sit in a block. ``IN_CHUNK`` (cross-layer only): each head of a
    # block holds every layer of the group in one run, ``[H][L][t, D]`` (vLLM's BHLNC), so
    # a slice of heads (a tensor-parallel rank's share) is one byte range of the block.
    # ``OUTER`` (per layer only): each layer keeps each head's blocks apart (vLLM's LHBNC).
    heads: HeadOrder = HeadOrder.INNER

    def __post_init__(self) -> None:
        if self.heads is HeadOrder.IN_CHUNK and not self.cross_layer:
            raise LayoutError("heads=IN_CHUNK (head-outer blocks) needs a cross-layer cache")
        if self.heads is HeadOrder.OUTER and (
            self.cross_layer or self.packing is not KVPacking.BLOCKS_FIRST
        ):
            raise LayoutError(
                "heads=OUTER (per-layer head runs) needs a blocks-first per-layer cache"
            )
        if self.heads is HeadOrder.IN_LAYER:
            raise LayoutError("heads=IN_LAYER is a wire order, not a cache format")

    def kernel_block_size_for(self, block_size: int) -> int:
        kb = self.kernel_block_size or block_size
        kernel_ratio(block_size, kb)
        return kb

    def native_arrangement(self, block_size: int) -> BlockArrangement:
        native = BlockArrangement.native(
            self.layout, block_size, self.kernel_block_size_for(block_size)
        )
        # OUTER: a unit holds one head, whose tokens are in order whatever the layout
        return replace(native, heads=HeadOrder.INNER if self.outer_heads else self.heads)

    @property
    def outer_heads(self) -> bool:
        """Each (layer, head) of a block is a region of its own (see the module docstring)."""
        return self.heads is HeadOrder.OUTER


@dataclass(frozen=True, kw_only=True)
class UnitSlot:
    """Rows of bytes a region holds per block for one group (see ``arrangement.py``).

    ``geometry`` is None for state groups, whose pages carry no token structure.
    ``layer_index`` / ``kv_part`` / ``head`` say which layer, part or head (``OUTER``
    caches) the slot covers (-1: several).
    """

    region: KVRegion
    units: torch.Tensor
    group_id: int
    geometry: UnitGeometry | None
    layer_index: int = -1
    kv_part: int = -1
    head: int = -1


class KVCacheBuffers:
    """Owns a side's KV-cache memory and hands out views, unit slots and regions."""

    def __init__(
        self,
        config: KVCacheConfig,
        fmt: CacheFormat,
        device: str | torch.device = "cpu",
        *,
        pin_memory: bool = False,
    ) -> None:
        """``pin_memory``: page-locked host memory (a staging mirror of a CUDA cache)."""
        self.config = config
        self.format = fmt
        self.device = torch.device(device)
        for g in config.groups:
            if isinstance(g.spec, AttentionSpec):
                fmt.kernel_block_size_for(g.spec.block_size)
        page = config.page_size_bytes
        n = config.num_blocks
        self.tensors: list[torch.Tensor] = []
        self._layer_bytes: dict[str, torch.Tensor] = {}
        if fmt.cross_layer:
            buf = torch.zeros(
                (n, page * config.num_layers),
                dtype=torch.uint8,
                device=self.device,
                pin_memory=pin_memory,
            )
            self.tensors.append(buf)
            for i, name in enumerate(config.layer_names):
                self._layer_bytes[name] = buf[:, i * page : (i + 1) * page]
        else:
            for name in config.layer_names:
                t = torch.zeros(
                    (n, page), dtype=torch.uint8, device=self.device, pin_memory=pin_memory
                )
                self.tensors.append(t)
                self._layer_bytes[name] = t
                if fmt.outer_heads:  # (heads, blocks, run): each head's blocks side by side
                    heads = config.group_of(name).spec.num_kv_heads  # type: ignore[union-attr]
                    self._layer_bytes[name] = t.view(heads, n, page // heads)

    @classmethod
    def adopt(
        cls,
        config: KVCacheConfig,
        fmt: CacheFormat,
        tensors: list[torch.Tensor],
        layer_bytes: dict[str, torch.Tensor],
        *,
        device: torch.device,
    ) -> KVCacheBuffers:
        """Buffers over memory someone else allocated (see ``kvbridge.layouts.external``, which
        checks shapes and strides): ``tensors`` are what NIXL registers, ``layer_bytes``
        each layer's ``(num_blocks, page_bytes)`` uint8 rows (``OUTER``: ``(heads,
        num_blocks, run)``)."""
        self = cls.__new__(cls)
        self.config, self.format, self.device = config, fmt, torch.device(device)
        for g in config.groups:
            if isinstance(g.spec, AttentionSpec):
                fmt.kernel_block_size_for(g.spec.block_size)
        self.tensors = list(tensors)
        self._layer_bytes = dict(layer_bytes)
        return self

    # -- views for the model -------------------------------------------------------------

    def layer_bytes(self, layer_name: str) -> torch.Tensor:
        """``(num_blocks, page_bytes)`` uint8 rows of one layer (a strided view)."""
        if self.format.heads is not HeadOrder.INNER:
            raise LayoutError(
                f"layer {layer_name!r}: a head-outer cache ({self.format.heads.value}) keeps "
                f"no layer's page in one run; read whole blocks (unit_slots) instead"
            )
        try:
            return self._layer_bytes[layer_name]
        except KeyError:
            raise LayoutError(
                f"unknown layer {layer_name!r}; known: {list(self.config.layer_names)}"
            ) from None

    def attention_views(self, layer_name: str) -> tuple[torch.Tensor, ...]:
        """Per part (K, V; or the latent for MLA) a kernel-block view
        ``(num_blocks, r, kb, H, D)`` (NHD) or ``(num_blocks, r, H, kb, D)`` (HND)."""
        group = self.config.group_of(layer_name)
        spec = group.spec
        if not isinstance(spec, AttentionSpec):
            raise LayoutError(f"layer {layer_name!r} is a {spec.kind.value} layer, not attention")
        rows = self.layer_bytes(layer_name)
        kb = self.format.kernel_block_size_for(spec.block_size)
        r = spec.block_size // kb
        parts = spec.num_kv_parts
        heads, dim = spec.num_kv_heads, spec.part_head_size
        elems = rows.view(spec.dtype)
        row = rows.stride(0) // spec.itemsize
        sub_elems = kb * heads * dim
        per_layer_split = not self.format.cross_layer and self.format.packing is KVPacking.KV_SPLIT
        if per_layer_split:
            # (2, kernel_blocks, ...): part p occupies the p-th half of the whole tensor
            part_stride = self.config.num_blocks * r * sub_elems
            part_row, sub_stride = r * sub_elems, sub_elems
        else:
            part_stride, part_row, sub_stride = sub_elems, row, parts * sub_elems
        if per_layer_split:
            row = part_row
        inner = (kb, heads, dim) if self.format.layout is KVLayout.NHD else (heads, kb, dim)
        shape = (self.config.num_blocks, r, *inner)
        inner_strides = (
            (heads * dim, dim, 1)
            if self.format.layout is KVLayout.NHD
            else (
                kb * dim,
                dim,
                1,
            )
        )
        strides = (row, sub_stride, *inner_strides)
        base = elems.storage_offset()
        return tuple(elems.as_strided(shape, strides, base + p * part_stride) for p in range(parts))

    def state_views(self, layer_name: str) -> list[torch.Tensor]:
        """The state tensors of a state layer, each ``(num_blocks, *shape)``."""
        spec = self.config.group_of(layer_name).spec
        if not isinstance(spec, StateSpec):
            raise LayoutError(f"layer {layer_name!r} is a {spec.kind.value} layer, not state")
        rows = self.layer_bytes(layer_name)
        views = []
        for shape, dtype, offset, nbytes in zip(
            spec.shapes, spec.dtypes, spec.state_offsets, spec.state_nbytes, strict=True
        ):
            chunk = rows[:, offset : offset + nbytes].view(dtype)
            views.append(chunk.unflatten(1, shape))
        return views

    # -- what transforms and NIXL see ----------------------------------------------------

    def unit_slots(self, group_id: int) -> list[UnitSlot]:
        group = self._group(group_id)
        page = self.config.page_size_bytes
        first = self.config.group_layer_offset(group_id)
        if self.format.cross_layer:
            buf = self.tensors[0]
            units = buf[:, first * page : (first + group.num_layers) * page]
            return [self._slot(f"g{group_id}", units, group, group.num_layers, parts=None)]
        slots = []
        for i, name in enumerate(group.layer_names):
            rows = self._layer_bytes[name]
            spec = group.spec
            if self.format.outer_heads:
                slots += [
                    self._slot(f"{name}.h{h}", u, group, 1, parts=None, layer=first + i, head=h)
                    for h, u in enumerate(rows)
                ]
                continue
            split = self.format.packing is KVPacking.KV_SPLIT and isinstance(spec, AttentionSpec)
            if split and spec.num_kv_parts == 2:
                half = page // 2
                flat = rows.view(-1)
                for p in range(2):
                    units = flat[p * self.config.num_blocks * half :][
                        : self.config.num_blocks * half
                    ].view(self.config.num_blocks, half)
                    slots.append(
                        self._slot(f"{name}.{p}", units, group, 1, parts=1, layer=first + i, part=p)
                    )
            else:
                slots.append(self._slot(name, rows, group, 1, parts=None, layer=first + i))
        return slots

    def regions(self) -> list[KVRegion]:
        return [s.region for g in self.config.groups for s in self.unit_slots(g.group_id)]

    def group_block_bytes(self, group_id: int) -> int:
        """Bytes one block of a group occupies across all its layers."""
        return self._group(group_id).num_layers * self.config.page_size_bytes

    def check_block_ids(self, block_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.config.num_blocks)]
        if bad.size:
            raise BlockIdError(
                f"block ids {bad[:8].tolist()} outside the pool [0, {self.config.num_blocks})"
            )
        return ids

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def _group(self, group_id: int) -> KVCacheGroup:
        if not 0 <= group_id < len(self.config.groups):
            raise LayoutError(f"group id {group_id} outside [0, {len(self.config.groups)})")
        return self.config.groups[group_id]

    def _slot(
        self,
        name: str,
        units: torch.Tensor,
        group: KVCacheGroup,
        num_layers: int,
        *,
        parts: int | None,
        layer: int = -1,
        part: int = -1,
        head: int = -1,
    ) -> UnitSlot:
        spec = group.spec
        geometry = None
        if isinstance(spec, AttentionSpec):
            geometry = UnitGeometry(
                num_layers=num_layers,
                num_kv_parts=parts or spec.num_kv_parts,
                block_size=spec.block_size,
                num_heads=1 if head >= 0 else spec.num_kv_heads,
                head_size=spec.part_head_size,
                itemsize=spec.itemsize,
            )
            assert geometry.unit_bytes == units.shape[1], (geometry, units.shape)
        region = KVRegion(
            name=name,
            base_addr=units.data_ptr(),
            block_bytes=units.shape[1],
            block_stride_bytes=units.stride(0),
            num_blocks=units.shape[0],
            memory_kind=MemoryKind.of(units),
            device_id=units.device.index or 0,
        )
        return UnitSlot(
            region=region,
            units=units,
            group_id=group.group_id,
            geometry=geometry,
            layer_index=layer,
            kv_part=part,
            head=head,
        )


def read_group_token_major(
    buffers: KVCacheBuffers,
    group_id: int,
    block_ids: np.ndarray,
    arr: BlockArrangement | None = None,
) -> torch.Tensor:
    """Copy a group's blocks out as ``(layers, parts, tokens, heads, head_size)`` in the
    element dtype's integer twin (exact bytes). Attention groups only."""
    from kvbridge.layouts.arrangement import token_major

    ids = torch.as_tensor(buffers.check_block_ids(block_ids), device=buffers.device)
    group = buffers._group(group_id)
    spec = group.spec
    if not isinstance(spec, AttentionSpec):
        raise LayoutError(f"group {group_id} is a state group; read its state views instead")
    arr = arr or buffers.format.native_arrangement(spec.block_size)
    per_slot = []
    for slot in buffers.unit_slots(group_id):
        assert slot.geometry is not None
        tm = token_major(slot.units.index_select(0, ids), slot.geometry, arr)
        # (N, L, P, T, H, D) -> (L, P, N*T, H, D)
        per_slot.append(tm.permute(1, 2, 0, 3, 4, 5).flatten(2, 3))
    if buffers.format.outer_heads:  # slots per (layer, head): heads side by side per layer
        h = spec.num_kv_heads
        return torch.cat(
            [torch.cat(per_slot[i : i + h], dim=3) for i in range(0, len(per_slot), h)]
        )
    if buffers.format.cross_layer or buffers.format.packing is KVPacking.BLOCKS_FIRST:
        return torch.cat(per_slot, dim=0)
    # kv-split per layer: slots alternate K, V per layer
    pairs = [torch.cat(per_slot[i : i + 2], dim=1) for i in range(0, len(per_slot), 2)]
    if spec.num_kv_parts == 1:
        pairs = per_slot
    return torch.cat(pairs, dim=0)


def pool_bytes(config: KVCacheConfig) -> int:
    return config.num_blocks * config.page_size_bytes * config.num_layers
