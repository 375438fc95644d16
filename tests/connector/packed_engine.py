"""A stand-in engine for engine-packed pages in connector tests.

``ENGINE_ORDER`` pages are plain per-layer HND pages under a ``block_packing`` name::

    page of B tokens:  [ K: heads x B x head_size | V: heads x B x head_size ]
    or, K|V interleaved (``SideFormat.kv_interleaved``, vLLM 0.32's shape), each head
    one run:           [ heads x B x (K | V) ]

The name alone makes kvbridge move them whole (a real engine's order, e.g. vLLM's CPU
attention, cannot be cut by byte ranges), while the bytes stay readable token-major
(``read_group_token_major``), so tests compare decode's blocks with prefill's exactly.
:class:`HndRepacker` is the engine's side: it merges smaller pages side by side into a
block and writes the tokens of larger staged pages into blocks, as vLLM's repacker does
with its kernel (tested against vLLM in tests/connector/vllm).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import AttentionSpec

ENGINE_ORDER = "engine-order"
PACKED = CacheFormat(layout=KVLayout.HND, block_packing=ENGINE_ORDER)


class HndRepacker:
    """:class:`kvbridge.connector.worker.staging.staged_reads.Repacker` for :data:`PACKED`
    caches."""

    def __init__(self, buffers: KVCacheBuffers) -> None:
        assert buffers.format.block_packing == ENGINE_ORDER and not buffers.format.cross_layer
        self._buffers = buffers

    def _spec(self, group_id: int) -> AttentionSpec:
        spec = self._buffers.config.groups[group_id].spec
        assert isinstance(spec, AttentionSpec)
        return spec

    def merge(self, group_id: int, block_ids: np.ndarray, remote_block_size: int) -> None:
        spec, b = self._spec(group_id), remote_block_size
        heads, r = spec.num_kv_heads, spec.block_size // remote_block_size
        parts, width = spec.num_kv_parts, spec.part_head_size  # K, V or interleaved K|V
        ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64))
        for name in self._buffers.config.groups[group_id].layer_names:
            rows = self._buffers.layer_bytes(name)
            small = rows.index_select(0, ids).view(spec.dtype)
            small = small.reshape(-1, r, parts, heads, b, width)
            merged = small.permute(0, 2, 3, 1, 4, 5).contiguous()  # [n, P, H, r * b, W]
            rows[ids] = merged.view(torch.uint8).reshape(ids.numel(), -1)

    def split(
        self,
        group_id: int,
        pages: Sequence[torch.Tensor],
        remote_block_size: int,
        slots: np.ndarray,
        heads: tuple[int, int] | None = None,
        layers: Sequence[str] = (),
    ) -> None:
        spec, b = self._spec(group_id), remote_block_size
        parts, width, size = spec.num_kv_parts, spec.part_head_size, spec.block_size
        first, count = heads or (0, spec.num_kv_heads)  # the pages hold just these heads
        flat = np.asarray(slots, dtype=np.int64).reshape(-1)
        keep = torch.from_numpy(flat >= 0)
        where = torch.from_numpy(flat[flat >= 0])
        names = tuple(layers) or self._buffers.config.groups[group_id].layer_names
        for name, layer_pages in zip(names, pages, strict=True):
            n = layer_pages.shape[0]
            elems = layer_pages.contiguous().view(spec.dtype).reshape(n, parts, count, b, width)
            tokens = elems.permute(0, 3, 1, 2, 4).reshape(n * b, parts, count, width)[keep]
            for part, view in enumerate(self._buffers.attention_views(name)):
                by_token = view[:, 0].permute(0, 2, 1, 3)  # [blocks, B, H, D], same memory
                by_token[where // size, where % size, first : first + count] = tokens[:, part]
