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
Where the engine offers its own block copies (vLLM's ``set_host_xfer_buffer_ops``) and
they can copy this cache's blocks, the mirror is the engine's layout again and those
copies replace kvbridge's (``engine_copies``); the call points stay the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kvbridge.connector.common.config import ConfigError, parse_buffer_device
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.worker.staging.engine_copies import CopyBlocksOp, EngineCopies
from kvbridge.layouts.allocation import KVCacheBuffers, UnitSlot

logger = logging.getLogger(__name__)

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
    engine_copies: Callable[[KVCacheBuffers], EngineCopies | str] | None = None,
) -> HostStage | None:
    """The worker's host stage, or None when NIXL moves the cache itself. ``forced``
    overrides the choice (True: stage even a cache in host memory). ``engine_copies``:
    the engine's copies for a cache, or why they cannot serve it (see
    :func:`~kvbridge.connector.worker.staging.engine_copies.engine_copies_for`). Which
    copies run is logged once: here for kvbridge's, in :meth:`HostStage.use_engine_op`
    for the engine's."""
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
    chosen = engine_copies(buffers) if engine_copies is not None else "the engine offers no copies"
    if isinstance(chosen, EngineCopies):
        return HostStage(buffers, metrics, engine_copies=chosen)
    logger.info(
        "kvbridge host staging (kv_buffer_device=%r): blocks copied by kvbridge (%s)",
        kv_buffer_device,
        chosen,
    )
    return HostStage(buffers, metrics)


class HostStage:
    """The pinned host mirror of ``device_buffers``, and the copies between the two.

    With ``engine_copies`` the mirror has the engine's layout, and once the engine hands
    over its copy operation (:meth:`use_engine_op`) that operation replaces kvbridge's
    copies; :attr:`copy_path` says which copies run."""

    def __init__(
        self,
        device_buffers: KVCacheBuffers,
        metrics: ConnectorMetrics,
        *,
        engine_copies: EngineCopies | None = None,
    ) -> None:
        self.device_buffers = device_buffers
        self._metrics = metrics
        self._engine = engine_copies
        if engine_copies is not None:
            self.host_buffers = engine_copies.host_buffers
        else:
            pin = device_buffers.device.type == "cuda"
            self.host_buffers = KVCacheBuffers(
                device_buffers.config, device_buffers.format, "cpu", pin_memory=pin
            )
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

    @property
    def copy_path(self) -> str:
        """``"vllm"`` while the engine's operation copies the blocks, else ``"kvbridge"``."""
        engine = self._engine
        return engine.name if engine is not None and engine.op is not None else "kvbridge"

    def use_engine_op(self, op: CopyBlocksOp) -> str:
        """The engine's block-copy operation (vLLM: ``set_host_xfer_buffer_ops``): used
        from now on when it can copy this cache's blocks; the copy path, logged once."""
        if self._engine is not None:
            self._engine.op = op
            logger.info(
                "kvbridge host staging: blocks copied by %s's copy operation (%d layers)",
                self._engine.name,
                len(self.device_buffers.config.layer_names),
            )
        return self.copy_path

    def to_host(self, group_id: int, block_ids: np.ndarray) -> int:
        """Copy blocks of one group from the cache to the mirror; the bytes copied."""
        if self._engine is not None and self._engine.op is not None:
            return self._engine.to_host(group_id, block_ids, self._metrics)
        pairs = self._slots[group_id]
        moved = _copy_blocks(self.device_buffers, self.host_buffers, pairs, block_ids)
        self._metrics.staged_to_host_bytes += moved
        return moved

    def to_device(self, group_id: int, block_ids: np.ndarray) -> int:
        """Copy blocks of one group from the mirror into the cache; the bytes copied."""
        if self._engine is not None and self._engine.op is not None:
            return self._engine.to_device(group_id, block_ids, self._metrics)
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
        if device.type == "cuda":  # the copies ran on this thread's stream: wait for it only
            torch.cuda.current_stream(device).synchronize()
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
