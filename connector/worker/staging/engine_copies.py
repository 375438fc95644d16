"""Host staging through the engine's own block copies (vLLM's ``copy_kv_blocks``).

vLLM hands a connector that stages through host memory one copy operation
(``KVConnectorBase_V1.set_host_xfer_buffer_ops``)::

    op(src_caches, dst_caches, src_block_ids, dst_block_ids, "h2d" | "d2h")
      for each layer name: dst_caches[name][dst_ids] = src_caches[name][src_ids]

(``vllm.distributed.kv_transfer.kv_connector.utils.copy_kv_blocks``: the platform's
``insert_blocks_to_device`` / ``swap_out_blocks_to_host``, plain indexing on dim 0). That
is a correct block copy exactly when dim 0 of every layer's tensor is its kernel-block
axis: ``t[k]`` holds kernel block ``k`` of that layer and nothing else. vLLM 0.32's
per-layer views are logical ``[kernel blocks, H, N, C]`` for every ``KVCacheLayout``
(the strides carry the layout), so the op serves all of them; a tensor whose dim 0 is
something else (a ``[2, blocks, ...]`` K/V split), a layer that is not one tensor, or a
kernel-block count that does not fit the pool falls back to kvbridge's copies.

The mirror is the engine's cache laid out again in host memory, byte for byte: one host
allocation per device storage, and per layer a host tensor with the device tensor's
shape, strides and offset (what vLLM's NixlConnector allocates for its host buffer).
kvbridge describes that mirror with the same adoption code as the cache, so plans,
descriptors and leases do not change; manager block ``b`` is kernel blocks
``b*r .. b*r+r-1`` in the op's block-id lists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Literal

import numpy as np
import torch

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.external import ExternalLayoutError, adopt_kv_caches
from kvbridge.layouts.layout import KVPacking
from kvbridge.layouts.specs import AttentionSpec

# vLLM's CopyBlocksOp: (src caches, dst caches, src block ids, dst block ids, direction);
# on a GPU it must queue on the caller's current stream, which is all kvbridge waits for
CopyBlocksOp = Callable[
    [dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int], Literal["h2d", "d2h"]],
    None,
]


class EngineCopies:
    """The engine-shaped host mirror of a cache, and the engine's op copying blocks
    between the two once the engine hands it over (:attr:`op`; vLLM does so right after
    ``register_kv_caches``). Build it with :func:`engine_copies_for`."""

    name = "vllm"

    def __init__(
        self,
        device_buffers: KVCacheBuffers,
        device_caches: Mapping[str, torch.Tensor],
        host_caches: Mapping[str, torch.Tensor],
        host_buffers: KVCacheBuffers,
        kernel_ratio: Mapping[int, int],
    ) -> None:
        self.op: CopyBlocksOp | None = None
        self.device_buffers = device_buffers
        self.host_buffers = host_buffers
        self._ratio = dict(kernel_ratio)
        groups = device_buffers.config.groups
        self._device = {g.group_id: {n: device_caches[n] for n in g.layer_names} for g in groups}
        self._host = {g.group_id: {n: host_caches[n] for n in g.layer_names} for g in groups}

    def kernel_block_ids(self, group_id: int, block_ids: np.ndarray) -> list[int]:
        """The op's block ids (dim 0 of the layer tensors) of manager blocks ``block_ids``."""
        ids = np.unique(self.device_buffers.check_block_ids(block_ids))
        r = self._ratio[group_id]
        return (ids[:, None] * r + np.arange(r)).reshape(-1).tolist()

    def to_host(self, group_id: int, block_ids: np.ndarray, metrics: ConnectorMetrics) -> int:
        ids = self.kernel_block_ids(group_id, block_ids)
        moved = self._copy(self._device[group_id], self._host[group_id], ids, "d2h")
        metrics.staged_to_host_bytes += moved
        return moved

    def to_device(self, group_id: int, block_ids: np.ndarray, metrics: ConnectorMetrics) -> int:
        ids = self.kernel_block_ids(group_id, block_ids)
        moved = self._copy(self._host[group_id], self._device[group_id], ids, "h2d")
        metrics.staged_to_device_bytes += moved
        return moved

    def _copy(
        self,
        src: dict[str, torch.Tensor],
        dst: dict[str, torch.Tensor],
        ids: list[int],
        direction: Literal["h2d", "d2h"],
    ) -> int:
        assert self.op is not None, "the engine's copy operation has not been handed over"
        if not ids:
            return 0
        self.op(src, dst, ids, ids, direction)
        device = self.device_buffers.device
        if device.type == "cuda":  # NIXL must see the bytes; the cache's next reader too
            torch.cuda.current_stream(device).synchronize()  # the op's stream, not the device
        return len(ids) * sum(_kernel_block_bytes(t) for t in src.values())


def engine_copies_for(
    device_caches: Mapping[str, torch.Tensor], device_buffers: KVCacheBuffers
) -> EngineCopies | str:
    """The engine-shaped mirror for this cache (the op comes later), or why the engine's
    op cannot copy its blocks (a sentence for the startup log; kvbridge's own copies and
    mirror serve then)."""
    config, fmt = device_buffers.config, device_buffers.format
    if fmt.block_packing:
        return f"engine-packed pages ({fmt.block_packing}) are not copied by the engine's op"
    ratios: dict[int, int] = {}
    for g in config.groups:
        spec = g.spec
        kb = fmt.kernel_block_size_for(spec.block_size) if isinstance(spec, AttentionSpec) else 0
        r = spec.block_size // kb if kb else 1
        ratios[g.group_id] = r
        for name in g.layer_names:
            t = device_caches.get(name)
            why = _why_not_blocks_first(t, config.num_blocks * r, spec.page_size_bytes // r, fmt)
            if why:
                return f"layer {name!r}: {why}"
    host_caches = host_twins({n: device_caches[n] for n in config.layer_names})
    try:
        host_buffers = adopt_kv_caches(
            config,
            host_caches,
            layout_hint=fmt.layout,
            packed_heads_major=fmt.packed_heads_major,
        )
    except ExternalLayoutError as exc:  # the cache was adopted; its twin must be too
        raise AssertionError(f"the host twin of an adopted cache is refused: {exc}") from exc
    assert host_buffers.format == fmt, (host_buffers.format, fmt)
    return EngineCopies(device_buffers, device_caches, host_caches, host_buffers, ratios)


def _why_not_blocks_first(
    t: object, num_kernel_blocks: int, kernel_block_bytes: int, fmt: CacheFormat
) -> str:
    """Why indexing dim 0 of ``t`` by kernel block id would not copy exactly those blocks
    ("" when it would)."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}, not one tensor"
    if t.dim() < 2 or t.shape[0] != num_kernel_blocks:
        return (
            f"shape {tuple(t.shape)}: dim 0 is not the {num_kernel_blocks} kernel blocks the "
            f"engine's op indexes"
        )
    if _kernel_block_bytes(t) != kernel_block_bytes:
        return (
            f"shape {tuple(t.shape)}: one index of dim 0 holds {_kernel_block_bytes(t)} B, "
            f"not one kernel block ({kernel_block_bytes} B)"
        )
    split = fmt.packing is KVPacking.KV_SPLIT and not fmt.cross_layer
    if split and t.stride(0) == max(t.stride()):
        return f"strides {tuple(t.stride())}: dim 0 is the K/V axis of a split cache"
    return ""


def _kernel_block_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def host_twins(caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per layer a host tensor with the device tensor's shape and strides, at the same
    byte offset in a host copy of its storage (layers that share device memory share host
    memory). Pinned when the cache is on a GPU."""
    spans: dict[int, tuple[int, int]] = {}  # storage address -> (first, end) byte used
    for t in caches.values():
        key, lo, hi = _byte_span(t)
        old = spans.get(key, (lo, hi))
        spans[key] = (min(old[0], lo), max(old[1], hi))
    pin = any(t.device.type == "cuda" for t in caches.values())
    hosts = {
        key: torch.zeros(hi - lo, dtype=torch.uint8, pin_memory=pin)
        for key, (lo, hi) in spans.items()
    }
    out = {}
    for name, t in caches.items():
        key, lo, _ = _byte_span(t)
        offset = lo - spans[key][0]
        assert offset % t.element_size() == 0, (name, offset, t.dtype)
        twin = torch.empty(0, dtype=t.dtype)
        twin.set_(
            hosts[key].untyped_storage(),
            offset // t.element_size(),
            tuple(t.shape),
            tuple(t.stride()),
        )
        out[name] = twin
    return out


def _byte_span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, end byte) of ``t`` inside its storage."""
    size = t.element_size()
    lo = t.storage_offset() * size
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return t.untyped_storage().data_ptr(), lo, lo + extent * size
