"""Host staging: a KV cache in GPU memory moved through a pinned host mirror.

Where direct VRAM access is slow or absent for the transport, ``kv_buffer_device: "cpu"``
with a CUDA cache registers a host copy of the cache with NIXL instead of the cache
itself. The mirror has the cache's shape (same groups, format and block ids), so plans,
descriptors and leases are unchanged; only the bytes take one more hop::

    prefill:  forward -> device blocks --(rewrite on device)--> to_host --> mirror
                                                                           | NIXL READ/WRITE
    decode:   mirror --> to_device --> device blocks --(merge on device)--> forward

The sender copies a request's blocks out when they are kept (after any rewrite on save)
and again after a rewrite a reader asks for; the receiver copies them in once every read
(or push) of the load is in, before its own rewrites. Consecutive block ids are one copy
per run; between a GPU and the host, many small runs instead go through one gather (or
scatter) on the GPU per slot and batch of at most ``COPY_BUDGET_BYTES``, one copy across,
and a memcpy per row on the host side. A copy ends with the device's stream synchronised:
NIXL must see the bytes, and the mirror's block may be written again once its load is
reported.

:func:`stages_through_host` reads ``kv_buffer_device`` against where the cache lives.
"""

from __future__ import annotations

import numpy as np
import torch

from kvbridge.connector.common.config import ConfigError, parse_buffer_device
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.layouts.allocation import KVCacheBuffers, UnitSlot

COPY_BUDGET_BYTES = 64 << 20  # bytes of scattered rows gathered per copy across
MAX_RUN_COPIES = 32  # GPU <-> host: up to this many runs, one copy per run
LARGE_RUN_BYTES = 1 << 20  # GPU <-> host: runs this large on average are copied as they are


def stages_through_host(kv_buffer_device: str, cache_device: torch.device) -> bool:
    """True when the cache must be staged through host memory.

    ``"auto"`` moves the cache where it lives. ``"cpu"`` with a CUDA cache stages through a
    pinned host mirror; ``"cuda"``/``"cuda:N"`` with a CUDA cache moves VRAM directly (the
    index, if given, must be the cache's). A CUDA buffer for a cache in host memory is a
    configuration error."""
    if kv_buffer_device == "auto":
        return False
    wanted = parse_buffer_device(kv_buffer_device)
    if wanted.type == "cpu":
        return cache_device.type != "cpu"
    if cache_device.type != "cuda":
        raise ConfigError(
            f"kv_buffer_device={kv_buffer_device!r} but the KV cache lives in {cache_device} "
            f"memory; use 'cpu' or 'auto'"
        )
    if wanted.index is not None and wanted.index != (cache_device.index or 0):
        raise ConfigError(
            f"kv_buffer_device={kv_buffer_device!r} but the KV cache lives on {cache_device}; "
            f"NIXL registers the cache's own memory (use 'cuda', 'auto' or 'cpu')"
        )
    return False


def host_stage_for(
    kv_buffer_device: str,
    buffers: KVCacheBuffers,
    metrics: ConnectorMetrics,
    *,
    forced: bool | None = None,
    repacks: bool = False,
) -> HostStage | None:
    """The worker's host stage, or None when NIXL moves the cache itself. ``forced``
    overrides the choice (True: stage even a cache in host memory)."""
    staged = stages_through_host(kv_buffer_device, buffers.device)
    if forced is not None:
        staged = forced
    if not staged:
        return None
    if repacks:
        raise ConfigError(
            f"kv_buffer_device={kv_buffer_device!r} stages the cache through host memory, "
            f"which engine-packed pages (a repacker) do not support; move the cache's own "
            f"memory (kv_buffer_device 'auto')"
        )
    return HostStage(buffers, metrics)


class HostStage:
    """The pinned host mirror of ``device_buffers``, and the copies between the two."""

    def __init__(self, device_buffers: KVCacheBuffers, metrics: ConnectorMetrics) -> None:
        self.device_buffers = device_buffers
        pin = device_buffers.device.type == "cuda"
        self.host_buffers = KVCacheBuffers(
            device_buffers.config, device_buffers.format, "cpu", pin_memory=pin
        )
        self._metrics = metrics
        # per group: (cache slot, mirror slot) pairs, built once (same config and format)
        self._slots = {
            g.group_id: list(
                zip(
                    device_buffers.unit_slots(g.group_id),
                    self.host_buffers.unit_slots(g.group_id),
                    strict=True,
                )
            )
            for g in device_buffers.config.groups
        }

    def to_host(self, group_id: int, block_ids: np.ndarray) -> int:
        """Copy blocks of one group from the cache to the mirror; the bytes copied."""
        pairs = self._slots[group_id]
        moved = _copy_blocks(self.device_buffers, self.host_buffers, pairs, block_ids)
        self._metrics.staged_to_host_bytes += moved
        return moved

    def to_device(self, group_id: int, block_ids: np.ndarray) -> int:
        """Copy blocks of one group from the mirror into the cache; the bytes copied."""
        pairs = [(h, d) for d, h in self._slots[group_id]]
        moved = _copy_blocks(self.host_buffers, self.device_buffers, pairs, block_ids)
        self._metrics.staged_to_device_bytes += moved
        return moved


def _copy_blocks(
    src: KVCacheBuffers,
    dst: KVCacheBuffers,
    slots: list[tuple[UnitSlot, UnitSlot]],
    block_ids: np.ndarray,
) -> int:
    """Copy ``block_ids``' rows of every (source, destination) slot pair."""
    ids = np.unique(src.check_block_ids(block_ids))
    if ids.size == 0:
        return 0
    starts = np.flatnonzero(np.diff(ids, prepend=ids[0] - 2) != 1)
    ends = np.append(starts[1:], ids.size)
    runs = list(zip(ids[starts].tolist(), (ids[ends - 1] + 1).tolist(), strict=True))
    moved = 0
    for s, d in slots:
        row_bytes = s.units.shape[1]
        if not _gathers(src.device, dst.device, len(runs), ids.size * row_bytes):
            for a, b in runs:
                d.units[a:b].copy_(s.units[a:b], non_blocking=True)
        elif s.units.device.type == "cpu":
            _scatter_to_device(s.units, d.units, ids)
        else:
            _gather_to_host(s.units, d.units, ids)
        moved += int(ids.size) * row_bytes
    for device in (src.device, dst.device):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return moved


def _gathers(src: torch.device, dst: torch.device, num_runs: int, num_bytes: int) -> bool:
    """Whether many small runs cross between a GPU and the host: then one gather (or
    scatter) kernel on the GPU side and one copy across beat a copy call per run. Host
    to host, copies per run are memcpy-fast (a CPU gather is 3-6x slower, measured)."""
    if src.type == dst.type:
        return False
    return num_runs > MAX_RUN_COPIES and num_bytes // num_runs < LARGE_RUN_BYTES


def _gather_to_host(src: torch.Tensor, dst: torch.Tensor, ids: np.ndarray) -> None:
    """Device rows -> host rows: gather on the device, one copy down, a copy per row."""
    batch = max(1, COPY_BUDGET_BYTES // max(1, src.shape[1]))
    for start in range(0, ids.size, batch):
        part = ids[start : start + batch]
        rows = src.index_select(0, torch.as_tensor(part, device=src.device)).to(dst.device)
        for k, b in enumerate(part.tolist()):
            dst[b].copy_(rows[k])


def _scatter_to_device(src: torch.Tensor, dst: torch.Tensor, ids: np.ndarray) -> None:
    """Host rows -> device rows: a copy per row into one pinned buffer, one copy up, a
    scatter on the device."""
    batch = max(1, COPY_BUDGET_BYTES // max(1, src.shape[1]))
    pin = dst.device.type == "cuda"
    for start in range(0, ids.size, batch):
        part = ids[start : start + batch]
        rows = torch.empty((part.size, src.shape[1]), dtype=src.dtype, pin_memory=pin)
        for k, b in enumerate(part.tolist()):
            rows[k].copy_(src[b])
        where = torch.as_tensor(part, device=dst.device)
        dst.index_copy_(0, where, rows.to(dst.device, non_blocking=True))
