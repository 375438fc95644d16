"""Describe KV-cache tensors kvbridge did not allocate (an engine's, e.g. vLLM's).

An engine hands over one tensor per attention layer. Its *logical* shape may list the
axes in any order (vLLM keeps a logical ``[B, H, N, C]`` and permutes strides for the
physical layout), so the description works on the *physical* order: axes sorted by
stride, size-1 axes dropped. That order must be one of::

    blocks_first  (kernel_blocks, [parts,] *block)     parts = 2 for K, V; absent if one
    kv_split      (parts, kernel_blocks, *block)        parts = 2 only
    block = (kb, H, D') NHD or (H, kb, D') HND;  D' = D, or 2*D when K|V are interleaved

with every axis inside a block dense. The block axis may be sparser than one page: then
the layers are views into one canonical cross-layer buffer, which is accepted when every
layer shares one storage, one block stride of ``num_layers * page`` bytes, and sits at
``i * page`` in the group-major layer order kvbridge uses (see ``allocation.py``).
Head-outer orders too: vLLM's BHLNC (a cross-layer view, every layer's run between two
heads) and LHBNC (each layer ``[H, kernel_blocks, kb, C]``, see ``heads_outer.py``).

Anything else is a :class:`ExternalLayoutError` naming the layer, its shape and strides,
and the shapes that would have been accepted; never a silent wrong read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.arrangement import HeadOrder
from kvbridge.layouts.errors import ExternalLayoutError
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.heads_outer import adopt_heads_outer, heads_outer_kernel_block
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import AttentionSpec, KVCacheKind, StateSpec


@dataclass(frozen=True, kw_only=True)
class LayerFormat:
    """How one handed-in layer tensor stores its blocks."""

    layout: KVLayout
    packing: KVPacking
    kernel_block_size: int
    kv_interleaved: bool
    block_stride_bytes: int  # distance between logical blocks
    base_addr: int  # address of block 0
    # 0: the heads of a block are dense. Else the distance between two heads of a block:
    # the layer is a view into a head-outer cross-layer buffer (vLLM's BHLNC)
    head_stride_bytes: int = 0
    # heads above blocks (LHBNC): block_stride_bytes is then one head's run of a block
    heads_outer: bool = False

    def __str__(self) -> str:
        outer = " heads-outer (LHBNC)" if self.heads_outer else ""
        return f"{self.packing.value} {self.layout.value} kb={self.kernel_block_size}{outer}"


def _physical(tensor: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sizes and element strides in memory order (outermost first), size-1 axes dropped."""
    axes = [(st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz != 1]
    axes.sort(key=lambda a: -a[0])
    return [sz for _, sz in axes], [st for st, _ in axes]


def _block_shape(layout: KVLayout, kb: int, heads: int, width: int) -> list[int]:
    return [kb, heads, width] if layout is KVLayout.NHD else [heads, kb, width]


def _candidates(
    spec: AttentionSpec, num_blocks: int
) -> list[tuple[KVLayout, KVPacking, int, bool, list[int]]]:
    """Every accepted (layout, packing, kernel block, interleaved, physical shape)."""
    out = []
    bs = spec.block_size
    kernel_sizes = [kb for kb in range(bs, 0, -1) if bs % kb == 0]
    is_mla = spec.kind is KVCacheKind.MLA
    for kv_interleaved in [False] if is_mla else [False, True]:
        parts = 1 if kv_interleaved or is_mla else 2
        width = spec.head_size * (2 if kv_interleaved else 1)
        for kb in kernel_sizes:
            nk = num_blocks * (bs // kb)
            for layout in (KVLayout.NHD, KVLayout.HND):
                block = _block_shape(layout, kb, spec.num_kv_heads, width)
                shapes = [(KVPacking.BLOCKS_FIRST, [nk, parts, *block])]
                if parts == 2:
                    shapes.append((KVPacking.KV_SPLIT, [parts, nk, *block]))
                for packing, shape in shapes:
                    out.append((layout, packing, kb, kv_interleaved, [s for s in shape if s != 1]))
    return out


def describe_layer(
    name: str,
    tensor: torch.Tensor,
    spec: AttentionSpec,
    num_blocks: int,
    *,
    layout_hint: KVLayout | None = None,
) -> LayerFormat:
    """The format of one attention layer's tensor; raises :class:`ExternalLayoutError`."""
    where = (
        f"layer {name!r}: tensor shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, "
        f"dtype {tensor.dtype}"
    )
    if tensor.dtype.itemsize != spec.itemsize or (
        tensor.dtype != spec.dtype and tensor.dtype != torch.uint8
    ):
        raise ExternalLayoutError(f"{where}: expected dtype {spec.dtype} for its KV-cache spec")
    if any(st < 0 for st in tensor.stride()):
        raise ExternalLayoutError(f"{where}: negative strides are not supported")
    sizes, strides = _physical(tensor)
    matches = [c for c in _candidates(spec, num_blocks) if c[4] == sizes]
    kb_outer = heads_outer_kernel_block(sizes, strides, spec, num_blocks)
    if kb_outer is not None and matches:  # as many heads as kernel blocks: never guess
        raise ExternalLayoutError(
            f"{where}: fits both heads outside blocks (LHBNC) and blocks outside heads, "
            f"since the pool has as many kernel blocks as heads; allocate more blocks"
        )
    if kb_outer is not None:  # block stride: one head's run of a block
        run = spec.block_size * sizes[3] * spec.itemsize
        return LayerFormat(
            layout=KVLayout.HND,
            packing=KVPacking.BLOCKS_FIRST,
            kv_interleaved=True,
            kernel_block_size=kb_outer,
            block_stride_bytes=run,
            base_addr=tensor.data_ptr(),
            head_stride_bytes=num_blocks * run,
            heads_outer=True,
        )
    if layout_hint is not None and len({c[0] for c in matches}) > 1:
        matches = [c for c in matches if c[0] is layout_hint]
    if not matches:
        accepted = sorted(
            {
                f"{c[1].value} {c[0].value} kb={c[2]}{' K|V' if c[3] else ''}: {c[4]}"
                for c in _candidates(spec, num_blocks)
                if c[2] == spec.block_size
            }
        )
        raise ExternalLayoutError(
            f"{where} (memory order {sizes}) matches no layout kvbridge knows for "
            f"{num_blocks} blocks of {spec.block_size} tokens x {spec.num_kv_heads} heads x "
            f"{spec.head_size}; expected one of {accepted} (size-1 axes dropped; kernel "
            f"blocks that divide the block size also accepted), or heads outermost "
            f"[{spec.num_kv_heads}, kernel blocks, kb, {2 * spec.head_size}] (LHBNC)"
        )
    distinct = {(c[0], c[1], c[2], c[3]) for c in matches}
    if len(distinct) > 1:
        raise ExternalLayoutError(
            f"{where}: the shape fits several layouts {sorted(str(d) for d in distinct)}; "
            f"pass the engine's layout (NHD or HND) to tell them apart"
        )
    layout, packing, kb, kv_interleaved, _ = matches[0]
    # Density: every axis inside the outermost one must be packed; the outermost may be
    # sparser only for blocks-first (views into a cross-layer buffer), and the head axis
    # of an HND block of one part, whose heads then hold other layers between them.
    head_stride = 0
    for i in range(len(sizes) - 1, 0, -1):
        want = 1 if i == len(sizes) - 1 else strides[i + 1] * sizes[i + 1]
        if _head_outer_axis(i, sizes, strides, want, layout, packing, kb, spec):
            head_stride = strides[i]
            continue
        if strides[i] != want:
            raise ExternalLayoutError(
                f"{where}: axis of size {sizes[i]} (memory order {sizes}) has element stride "
                f"{strides[i]}, expected {want}; only the block axis may be strided"
            )
    page_elems = spec.page_size_bytes // spec.itemsize
    r = spec.block_size // kb
    outer_dense = strides[0] == strides[1] * sizes[1] if len(sizes) > 1 else strides[0] == 1
    if packing is KVPacking.KV_SPLIT or r > 1:
        if not outer_dense:
            raise ExternalLayoutError(
                f"{where}: a strided outer axis is only supported for blocks-first layers "
                f"whose kernel block equals the block size ({spec.block_size}); got "
                f"{packing.value} with kernel block {kb}"
            )
        block_stride = page_elems
    else:
        block_stride = strides[0]
        if block_stride < page_elems:
            raise ExternalLayoutError(f"{where}: block stride {block_stride} < page {page_elems}")
    return LayerFormat(
        layout=layout,
        packing=packing,
        kernel_block_size=kb,
        kv_interleaved=kv_interleaved,
        block_stride_bytes=block_stride * spec.itemsize,
        base_addr=tensor.data_ptr(),
        head_stride_bytes=head_stride * spec.itemsize,
    )


def _head_outer_axis(
    i: int,
    sizes: list[int],
    strides: list[int],
    want: int,
    layout: KVLayout,
    packing: KVPacking,
    kb: int,
    spec: AttentionSpec,
) -> bool:
    """Whether axis ``i`` is the head axis of a head-outer cross-layer view: memory order
    ``(blocks, H, kb, C)`` with ``H`` strided by whole multiples of a head's run."""
    return (
        i == 1
        and len(sizes) == 4
        and layout is KVLayout.HND
        and packing is KVPacking.BLOCKS_FIRST
        and kb == spec.block_size
        and sizes[1] == spec.num_kv_heads > 1
        and strides[1] > want
        and strides[1] % want == 0
    )


def describe_state_layer(
    name: str, tensor: torch.Tensor, spec: StateSpec, num_blocks: int, page_bytes: int
) -> None:
    """Check one state layer's tensor (vLLM's Mamba layers: a ``[blocks, 1, 1, C]`` byte
    view, ``C`` the states back to back, one page apart); raises
    :class:`ExternalLayoutError` naming what differs."""
    where = (
        f"state layer {name!r}: tensor shape {tuple(tensor.shape)}, strides "
        f"{tuple(tensor.stride())}, dtype {tensor.dtype}"
    )
    packed, offsets = 0, []  # the engine's states back to back, no alignment gaps
    for nbytes in spec.state_nbytes:
        offsets.append(packed)
        packed += nbytes
    if tuple(offsets) != spec.state_offsets:
        raise ExternalLayoutError(
            f"{where}: the engine packs its states at byte offsets {offsets}, kvbridge's "
            f"state spec aligns them at {list(spec.state_offsets)} (dtypes {spec.dtypes})"
        )
    sizes, strides = _physical(tensor)
    item = tensor.element_size()
    want_sizes = [num_blocks, packed // item] if num_blocks > 1 else [packed // item]
    want_strides = [page_bytes // item, 1] if num_blocks > 1 else [1]
    if packed % item or sizes != want_sizes or strides != want_strides:
        raise ExternalLayoutError(
            f"{where} (memory order {sizes}, element strides {strides}): expected "
            f"{num_blocks} blocks of {packed} state bytes, one {page_bytes}-byte page apart "
            f"(a per-layer cache: block-outer layouts overlay a hybrid model's groups inside "
            f"each block, which kvbridge does not move; use VLLM_KV_CACHE_LAYOUT=LBHNC)"
        )


def adopt_kv_caches(
    config: KVCacheConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    layout_hint: KVLayout | None = None,
    block_packing: str = "",
    packed_heads_major: bool = False,
) -> KVCacheBuffers:
    """Wrap an engine's per-layer tensors as :class:`KVCacheBuffers` (no copy).

    ``config`` names every layer and its spec; its attention specs are given the
    ``kv_interleaved`` flag the tensors show. Every layer must be present; tensors for
    layers outside ``config`` are an error (the caller filters shared or unused layers).
    ``block_packing``: the engine's id for a page order the shape does not show (its
    kernels' private element order, see ``CacheFormat.block_packing``); "" if none.
    ``packed_heads_major``: in that order each head is one contiguous run of the page.
    """
    missing = [n for n in config.layer_names if n not in tensors]
    extra = sorted(set(tensors) - set(config.layer_names))
    if missing or extra:
        raise ExternalLayoutError(
            f"KV-cache tensors do not match the KV-cache config: missing {missing}, "
            f"unexpected {extra}"
        )
    formats: dict[str, LayerFormat] = {}
    page = config.page_size_bytes
    for g in config.groups:
        for name in g.layer_names:
            if isinstance(g.spec, StateSpec):
                describe_state_layer(name, tensors[name], g.spec, config.num_blocks, page)
            else:
                formats[name] = describe_layer(
                    name, tensors[name], g.spec, config.num_blocks, layout_hint=layout_hint
                )
    if not formats:
        raise ExternalLayoutError(
            f"KV-cache groups {[g.spec.kind.value for g in config.groups]}: kvbridge adopts an "
            f"engine's cache when at least one group is attention"
        )
    first_name = next(iter(formats))
    first = formats[first_name]
    for name, f in formats.items():
        if str(f) != str(first):
            raise ExternalLayoutError(
                f"layer {name!r} is {f} but layer {first_name!r} is {first}; "
                f"kvbridge needs one format"
            )
    groups = tuple(
        g
        if isinstance(g.spec, StateSpec)
        else replace(
            g, spec=replace(g.spec, kv_interleaved=formats[g.layer_names[0]].kv_interleaved)
        )
        for g in config.groups
    )
    config = replace(config, groups=groups)
    has_state = len(formats) != len(config.layer_names)
    per_layer = not (first.heads_outer or first.head_stride_bytes)
    if has_state and not (per_layer and first.block_stride_bytes == page):
        raise ExternalLayoutError(
            f"attention layer {first_name!r} is {first} with a {first.block_stride_bytes}-byte "
            f"block stride: kvbridge moves state (Mamba) groups beside attention laid out per "
            f"layer, blocks-first (vLLM: VLLM_KV_CACHE_LAYOUT=LBHNC or LBNHC)"
        )
    if first.heads_outer:
        return adopt_heads_outer(
            config, tensors, kernel_block_size=first.kernel_block_size, block_packing=block_packing
        )
    if any(f.head_stride_bytes for f in formats.values()):
        fmt = CacheFormat(
            layout=first.layout,
            kernel_block_size=first.kernel_block_size,
            cross_layer=True,
            block_packing=block_packing,
            heads=HeadOrder.IN_CHUNK,
        )
        return _adopt_head_outer(config, fmt, tensors, formats)
    cross_layer = first.block_stride_bytes != page
    fmt = CacheFormat(
        layout=first.layout,
        kernel_block_size=first.kernel_block_size,
        cross_layer=cross_layer,
        packing=first.packing if not cross_layer else KVPacking.BLOCKS_FIRST,
        block_packing=block_packing,
        packed_heads_major=packed_heads_major,
    )
    if cross_layer:
        return _adopt_cross_layer(config, fmt, tensors, formats)
    layer_bytes = {
        name: _byte_rows(tensors[name], config.num_blocks, page, page)
        for name in config.layer_names
    }
    # vLLM's hybrid allocator gives layer i of every group the same tensor (the groups
    # share one block pool): register each piece of memory once.
    unique = {(t.data_ptr(), t.numel()): t for t in layer_bytes.values()}
    return KVCacheBuffers.adopt(
        config, fmt, list(unique.values()), layer_bytes, device=tensors[name].device
    )


def _byte_rows(t: torch.Tensor, rows: int, row_bytes: int, stride: int) -> torch.Tensor:
    """``(rows, row_bytes)`` uint8 over ``t``'s storage from its lowest address."""
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (rows, row_bytes), (stride, 1)
    )
    return out


def _adopt_cross_layer(
    config: KVCacheConfig,
    fmt: CacheFormat,
    tensors: Mapping[str, torch.Tensor],
    formats: Mapping[str, LayerFormat],
) -> KVCacheBuffers:
    page = config.page_size_bytes
    names = config.layer_names
    buf = _check_layers(
        config,
        tensors,
        formats,
        layer_step=page,
        what="strided (cross-layer)",
        must="hold every layer's page of a block side by side, group-major",
    )
    layer_bytes = {name: buf[:, i * page : (i + 1) * page] for i, name in enumerate(names)}
    return KVCacheBuffers.adopt(config, fmt, [buf], layer_bytes, device=buf.device)


def _adopt_head_outer(
    config: KVCacheConfig,
    fmt: CacheFormat,
    tensors: Mapping[str, torch.Tensor],
    formats: Mapping[str, LayerFormat],
) -> KVCacheBuffers:
    """vLLM's BHLNC: one buffer, a block is ``[H][L][kb, C]`` over every layer::

        row b: [ head 0: L0 | L1 | ... | L(n-1) ][ head 1: L0 | ... ] ...
                 |<- run ->|                       run = kb * C bytes

    kvbridge's head-outer cross-layer format (``HeadOrder.IN_CHUNK``) with one group.
    """
    if len(config.groups) != 1:
        raise ExternalLayoutError(
            f"a head-outer (BHLNC) cache with {len(config.groups)} KV-cache groups: kvbridge "
            f"moves head-outer blocks of one group only; set VLLM_KV_CACHE_LAYOUT=BLHNC or "
            f"LBHNC for hybrid models"
        )
    spec = config.groups[0].spec
    assert isinstance(spec, AttentionSpec)
    run = config.page_size_bytes // spec.num_kv_heads
    buf = _check_layers(
        config,
        tensors,
        formats,
        layer_step=run,
        head_stride=run * len(config.layer_names),
        what="head-outer (BHLNC)",
        must="hold, per block and head, every layer's run side by side",
    )
    return KVCacheBuffers.adopt(config, fmt, [buf], {}, device=buf.device)


def _check_layers(
    config: KVCacheConfig,
    tensors: Mapping[str, torch.Tensor],
    formats: Mapping[str, LayerFormat],
    *,
    layer_step: int,
    what: str,
    must: str,
    head_stride: int = 0,
) -> torch.Tensor:
    """The ``(num_blocks, page * num_layers)`` rows of a cross-layer buffer whose layer
    ``i`` is a view at ``i * layer_step`` after layer 0 in the first layer's storage,
    blocks a whole row apart (and heads ``head_stride`` apart, when non-zero); any layer
    that is not raises :class:`ExternalLayoutError` naming it and ``what`` it must be."""
    names = config.layer_names
    row = config.page_size_bytes * len(names)
    first = tensors[names[0]]
    storage = first.untyped_storage().data_ptr()
    base = formats[names[0]].base_addr
    for i, name in enumerate(names):
        f, t = formats[name], tensors[name]
        problems = []
        if t.untyped_storage().data_ptr() != storage:
            problems.append("lives in another storage than the first layer")
        if f.block_stride_bytes != row:
            problems.append(f"block stride {f.block_stride_bytes} B, expected {row} B")
        if head_stride and f.head_stride_bytes != head_stride:
            problems.append(f"head stride {f.head_stride_bytes} B, expected {head_stride} B")
        if f.base_addr - base != i * layer_step:
            problems.append(
                f"starts {f.base_addr - base} B after the first layer, expected "
                f"{i * layer_step} B (layer {i} of {list(names)})"
            )
        if problems:
            raise ExternalLayoutError(
                f"layer {name!r}: shape {tuple(t.shape)}, strides {tuple(t.stride())} is a "
                f"{what} view but {'; '.join(problems)}; a {what} buffer must {must}"
            )
    return _byte_rows(first, config.num_blocks, row, row)
