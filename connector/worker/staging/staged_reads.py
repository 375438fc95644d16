"""Loads through staging slots: engine-packed remote pages larger than the local blocks.

Such a page (``GroupPlan.split_from``) cannot be cut into local blocks by byte ranges, so
it lands whole (or its slice of the heads) in a staging slot
(``kvbridge.connector.worker.staging.arenas``): read by decode (pull,
:meth:`StagedReads.post_round`), or written by prefill into the slots decode leased for the round
(push, :meth:`StagedReads.lease_round` and ``kvbridge.connector.worker.decode.transfers``). The
engine then writes the tokens a load needs into its blocks (:meth:`Repacker.split`) and the slots go
back. A load moves in rounds of as many slots as are free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.transfer.transport import (
    DescList,
    PostFailedError,
    TransferEngine,
    XferHandle,
)
from kvbridge.connector.worker.device_order import DeviceOrder
from kvbridge.connector.worker.staging.arenas import StagingPool, StagingPools, slot_offsets
from kvbridge.handshake.plan_model import GroupPlan
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.digest import row_sums
from kvbridge.layouts.errors import KVBridgeError


class Repacker(Protocol):
    """The engine's way back to its own page order after a load of whole remote pages
    (engine-packed formats, ``CacheFormat.block_packing``; see kvbridge.handshake.packed_plan).
    On a GPU its kernels must queue on the caller's current stream: kvbridge orders them
    with an event on that stream (kvbridge.connector.worker.device_order)."""

    def merge(self, group_id: int, block_ids: np.ndarray, remote_block_size: int) -> None:
        """Local blocks ``block_ids`` each hold whole, smaller remote pages side by side."""

    def split(
        self,
        group_id: int,
        pages: Sequence[torch.Tensor],
        remote_block_size: int,
        slots: np.ndarray,
        heads: tuple[int, int] | None = None,
        layers: Sequence[str] = (),
    ) -> None:
        """``pages[i]`` holds ``n`` larger remote pages of the group's layer ``i`` (uint8,
        ``[n, page_bytes]``); write token ``t`` of page ``j`` to local slot
        ``slots[j, t]`` (block id x block size + offset), skipping slots ``< 0``.
        ``layers``: the group's layers the pages are for, in order, when a pipeline
        stage's source holds only some of them (``GroupPlan.layers``); () every layer.

        ``heads`` ``(first, count)``: the pages hold only local heads ``first .. first +
        count - 1`` (tensor parallelism, when the local heads come from several remote
        ranks, each staged on its own); write just those heads of each token and leave
        the others as they are. None: the pages hold every local head."""


@dataclass
class Staged:
    """Remote pages of one group that go through staging slots."""

    group: GroupPlan
    remote_blocks: np.ndarray  # remote logical blocks not staged yet
    lo: int  # tokens [lo, end) are written to local blocks
    end: int
    local_ids: np.ndarray  # local block ids by logical block
    remote_ids: np.ndarray  # remote block ids by logical block - remote_first
    remote_first: int


# a verified load's staged pages as they landed: (group, stream) -> remote logical block ->
# row sum (kvbridge.layouts.digest)
StagedSums = dict[tuple[int, int], dict[int, int]]


@dataclass
class StageBatch:
    staged: Staged | None  # None: a packed read's landing pages (decode.packed_reads)
    remote_blocks: np.ndarray
    pool: StagingPool
    slots: np.ndarray
    handles: list[XferHandle] = field(default_factory=list)


class StagedReads:
    """Posts staging rounds and hands arrived pages to the engine's repacker."""

    def __init__(
        self,
        engine: TransferEngine,
        pools: StagingPools,
        buffers: KVCacheBuffers,
        metrics: ConnectorMetrics,
        repacker: Repacker | None,
        order: DeviceOrder | None = None,
    ) -> None:
        """``order``: fences the engine's split kernels before their slots go back (the
        next round's READs land in them)."""
        self._engine = engine
        self._pools = pools
        self._buffers = buffers
        self._metrics = metrics
        self._repacker = repacker
        self._order = order or DeviceOrder(buffers.device)

    @property
    def num_leased_bytes(self) -> int:
        """Staging bytes out of the pool (rounds in flight, or held for push rounds)."""
        return self._pools.num_leased_bytes

    def lease_round(self, queue: list[Staged], max_pages: int | None = None) -> StageBatch | None:
        """The next remote pages of ``queue[0]`` (at most ``max_pages``) with as many free
        slots as there are for them; None when no slot is free (wait for another round)."""
        staged = queue[0]
        pool = self._pools.pool(staged.group.staging_bytes)
        want = int(staged.remote_blocks.size)
        slots = pool.lease(want if max_pages is None else min(want, max_pages))
        if slots.size == 0:
            return None
        blocks, staged.remote_blocks = (
            staged.remote_blocks[: slots.size],
            staged.remote_blocks[slots.size :],
        )
        if staged.remote_blocks.size == 0:
            queue.pop(0)
        return StageBatch(staged=staged, remote_blocks=blocks, pool=pool, slots=slots)

    def post_round(
        self,
        queue: list[Staged],
        remote_lists: Mapping[tuple[int, int], DescList],
        leased: Callable[[StageBatch], None],
    ) -> int:
        """Read the next remote pages of ``queue[0]`` into as many slots as are free (none
        free: 0 bytes, wait for another load's round), from the peer's prepared lists
        (``remote_lists``, by group and stream). ``leased(batch)`` gets the round before
        its first READ is posted, so that whoever holds it holds the slots and every READ
        posted, also when a later post raises. Returns the round's bytes."""
        batch = self.lease_round(queue)
        if batch is None:
            return 0
        leased(batch)
        staged, g = batch.staged, batch.staged.group
        rrows = staged.remote_ids[batch.remote_blocks - staged.remote_first]
        num_bytes = 0
        for i, (stream, offset) in enumerate(zip(g.streams, slot_offsets(g), strict=True)):
            local = batch.pool.local_list(offset, stream.length)
            remote = remote_lists[(g.group_id, i)]
            try:
                handle = self._engine.read(local, batch.slots, remote, rrows)
            except PostFailedError as exc:  # part of it may run: held with the round
                batch.handles.append(exc.handle)
                raise
            batch.handles.append(handle)
            num_bytes += int(batch.slots.size) * stream.length
            self._metrics.descriptors_posted += handle.num_descs
        return num_bytes

    def split(self, batch: StageBatch, sums: StagedSums | None = None) -> None:
        """A round arrived: the engine writes its tokens into local blocks; slots return.
        ``sums`` (a verified load): first the row sum of each page as it landed, per
        stream and remote logical block (``kvbridge.layouts.digest.row_sums``)."""
        for h in batch.handles:
            self._engine.release(h)
        batch.handles.clear()
        staged, g = batch.staged, batch.staged.group
        local_bs = self._buffers.config.groups[g.group_id].spec.block_size
        tokens = batch.remote_blocks[:, None] * g.split_from + np.arange(g.split_from)
        wanted = (tokens >= staged.lo) & (tokens < staged.end)
        logical = np.where(wanted, tokens // local_bs, 0)
        if logical.max() >= staged.local_ids.size:
            batch.pool.give_back(batch.slots)
            raise KVBridgeError(
                f"group {g.group_id}: token {int(tokens[wanted].max())} has no local block "
                f"({staged.local_ids.size} given)"
            )
        slots = np.where(wanted, staged.local_ids[logical] * local_bs + tokens % local_bs, -1)
        pages, offset = [], 0
        for stream in g.streams:
            pages.append(batch.pool.pages(batch.slots, offset, stream.local_chunk_bytes))
            offset += stream.local_chunk_bytes
        if sums is not None:  # before the engine repacks them: the bytes as they landed
            every = np.arange(batch.slots.size)
            for i, (stream, page) in enumerate(zip(g.streams, pages, strict=True)):
                # the bytes moved: the stream's piece inside its part of the slot
                at = np.array([stream.local_offsets[0]], dtype=np.int64)
                got = row_sums(page, at, stream.length, every)
                sums.setdefault((g.group_id, i), {}).update(
                    zip(batch.remote_blocks.tolist(), got.tolist(), strict=True)
                )
        assert self._repacker is not None  # negotiation needs one for split plans
        spec = self._buffers.config.groups[g.group_id].spec
        try:
            if g.head_slice and g.head_slice[2] != getattr(spec, "num_kv_heads", 0):
                # this source holds some of the local heads (others come from other ranks)
                heads = (g.head_slice[0], g.head_slice[2])
                self._repacker.split(
                    g.group_id, pages, g.split_from, slots, heads=heads, layers=g.layers
                )
            else:
                self._repacker.split(g.group_id, pages, g.split_from, slots, layers=g.layers)
            # the split's kernels read the slots (on a GPU, queued): they finish before
            # the slots go back, where the next round's READs may land at once
            self._order.fence("staged split")
        finally:
            batch.pool.give_back(batch.slots)
        self._metrics.receiver_rewrites += int(np.unique(logical[wanted]).size)
        self._metrics.staging_rounds += 1

    def cancel(self, batch: StageBatch) -> None:
        """Release a round's reads and give its slots back: only for reads that ended
        (release is not cancel; the receiver's quarantine waits for them)."""
        for h in batch.handles:
            self._engine.release(h)
        batch.handles.clear()
        batch.pool.give_back(batch.slots)

    def close(self) -> None:
        self._pools.close()
