"""Engine caches that keep, per layer, each head's blocks apart (vLLM's LHBNC).

vLLM's ``LHBNC`` is the stride permutation ``[L, H, B, N, C]`` of its logical
``[L, B, H, N, C]``: a layer tensor holds head 0's blocks, then head 1's, ...; K and V
interleave in the content axis ``C = 2 * head_size``::

    layer l:  [ head 0: blk 0 | blk 1 | ... | blk n-1 ][ head 1: blk 0 | ... ] ...
                        |<run>|                          run = block_size * C * itemsize

One block of one layer is ``H`` runs, ``n * run`` bytes apart. kvbridge describes every
(layer, head) as a region of its own whose unit per block is one run
(``CacheFormat.heads = HeadOrder.OUTER``), so a block moves as ``L * H`` descriptors per
block on this side (fewer when consecutive blocks join into one run); a head's tokens
are in order inside its run, so a block size change or a tensor-parallel head slice
needs no rewrite on this side.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.arrangement import HeadOrder
from kvbridge.layouts.errors import ExternalLayoutError
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import AttentionSpec, KVCacheKind


def heads_outer_kernel_block(
    sizes: list[int], strides: list[int], spec: AttentionSpec, num_blocks: int
) -> int | None:
    """The kernel block size when a layer's memory order (``external._physical``) is a
    dense ``[H, kernel_blocks, kb, C]`` with ``C = 2 * head_size`` (K|V interleaved) and
    ``H = num_kv_heads > 1``; else None (not this layout)."""
    heads = spec.num_kv_heads
    if spec.kind is KVCacheKind.MLA or heads <= 1 or len(sizes) != 4:
        return None
    h, nk, kb, width = sizes
    dense = [nk * kb * width, kb * width, width, 1]
    fits = (
        h == heads
        and width == 2 * spec.head_size
        and spec.block_size % kb == 0
        and nk * kb == num_blocks * spec.block_size
    )
    return kb if fits and strides == dense else None


def adopt_heads_outer(
    config: KVCacheConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    kernel_block_size: int,
    block_packing: str = "",
) -> KVCacheBuffers:
    """:class:`KVCacheBuffers` over heads-outer layer tensors (checked by
    ``external.describe_layer``): per layer a ``(heads, num_blocks, run)`` byte view;
    each distinct tensor registered once (vLLM's hybrid groups share them)."""
    fmt = CacheFormat(
        layout=KVLayout.HND,
        kernel_block_size=kernel_block_size,
        block_packing=block_packing,
        heads=HeadOrder.OUTER,
    )
    layer_bytes: dict[str, torch.Tensor] = {}
    for g in config.groups:
        spec = g.spec
        assert isinstance(spec, AttentionSpec)
        heads = spec.num_kv_heads
        run = config.page_size_bytes // heads
        for name in g.layer_names:
            t = tensors[name]
            rows = torch.empty(0, dtype=torch.uint8, device=t.device)
            start = t.storage_offset() * t.element_size()
            shape = (heads, config.num_blocks, run)
            rows.set_(t.untyped_storage(), start, shape, (config.num_blocks * run, run, 1))
            layer_bytes[name] = rows
    if not layer_bytes:
        raise ExternalLayoutError("a heads-outer cache without attention layers")
    unique = {(t.data_ptr(), t.numel()): t for t in layer_bytes.values()}
    device = next(iter(layer_bytes.values())).device
    return KVCacheBuffers.adopt(config, fmt, list(unique.values()), layer_bytes, device=device)
