"""The NIXL descriptor lists a plan's streams move through: a peer's (remote, per peer) and
this worker's (local, prepared once and shared by every peer).

A plan names, per KV-cache group, its piece streams: one block-sized piece per block and
stream, at an offset inside the block. A stream's list holds one descriptor per block of
the region it lies in, so a transfer picks its rows by block index (NIXL coalesces
adjacent ones). A reader's plan has the remote side on the peer's blocks; a writer (a
pushing prefill) reads the same plan with the sides swapped, and for the groups its peer
stages, the remote side lies on the peer's staging slots (row = slot id). With packed
transfers on both sides (equal gather pages) the peer's gather arena is listed too, under
``GATHER_LIST``.
"""

from __future__ import annotations

import numpy as np

from kvbridge.connector.transfer.transport import DescList, TransferEngine
from kvbridge.connector.worker.staging.arenas import slot_offsets, slot_region
from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.plan_model import GroupPlan, PieceStream, TransferPlan
from kvbridge.layouts.descriptors import block_descriptors, descriptor_table
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.region import KVRegion

# Peer.remote_lists key of a peer's gather arena, in pages (packed reads; streams are
# keyed by (group id, stream index) >= 0)
GATHER_LIST = (-1, 0)

RemoteLists = dict[tuple[int, int], DescList]


class PlanLists:
    """Builds the lists of plans between this worker (``local``) and its peers."""

    def __init__(self, engine: TransferEngine, local: PeerLayout, *, writer: bool) -> None:
        """``writer``: this worker writes into its peers (their blocks are the plan's
        local side)."""
        self._engine = engine
        self._local = local
        self._writer = writer
        self._local_lists: dict[tuple, DescList] = {}

    def remote(
        self, agent: str, layout: PeerLayout, plan: TransferPlan, lists: RemoteLists
    ) -> KVRegion | None:
        """Prepare the peer's lists for ``plan`` into ``lists`` (the caller releases what
        is there when this raises); returns a region of the peer's that a probe may READ
        (None: the plan moves nothing)."""
        first: KVRegion | None = None
        for g in plan.groups:
            for i, stream in enumerate(g.streams):
                region, offsets = self._their_rows(layout, g, i)
                table = block_descriptors(
                    region, np.arange(region.num_blocks), offsets=offsets, length=stream.length
                )
                lists[(g.group_id, i)] = self._engine.prep_remote(
                    agent, table, memory_kind=region.memory_kind
                )
                first = first or region
        if self.packs(layout):
            gather = layout.gather
            assert gather is not None
            lists[GATHER_LIST] = self._engine.prep_remote(
                agent, descriptor_table(gather), memory_kind=gather.memory_kind
            )
        return first

    def packs(self, layout: PeerLayout) -> bool:
        """Packed transfers with this peer (reads from it, or pushes to it): both of us
        have a gather arena, in equal pages."""
        ours, theirs = self._local.gather, layout.gather
        if ours is None or theirs is None:
            return False
        return ours.block_bytes == theirs.block_bytes

    def _their_rows(
        self, layout: PeerLayout, group: GroupPlan, i: int
    ) -> tuple[KVRegion, np.ndarray]:
        """The peer's region and piece offsets of stream ``i``: its blocks, or, for a
        writer of pages the peer stages, its staging slots (row = slot id)."""
        stream = group.streams[i]
        if self._writer and group.split_from:
            if layout.staging is None:  # negotiation refuses such a push: a bug if here
                raise KVBridgeError(f"group {group.group_id}: the reader has no staging slots")
            region = slot_region(layout.staging, group.staging_bytes)
            return region, np.array([slot_offsets(group)[i]], dtype=np.int64)
        if self._writer:
            return layout.regions[stream.local_region].region, group.local_offsets(stream)
        return layout.regions[stream.remote_region].region, group.remote_offsets(stream)

    def _mine(self, group: GroupPlan, stream: PieceStream) -> tuple[int, np.ndarray]:
        """This worker's region index and piece offsets of a stream."""
        if self._writer:
            return stream.remote_region, group.remote_offsets(stream)
        return stream.local_region, group.local_offsets(stream)

    def local(self, group: GroupPlan, stream: PieceStream) -> DescList:
        """This worker's descriptor list for a plan's stream, prepared once and shared."""
        # the attributes the offsets derive from (no array built per call: a hot path)
        if self._writer:
            side = (
                stream.remote_region,
                stream.remote_offsets,
                group.remote_chunks_per_block,
                stream.remote_chunk_starts,
            )
            chunk_bytes = stream.remote_chunk_bytes
        else:
            side = (stream.local_region, stream.local_offsets, group.local_chunks_per_block)
            chunk_bytes = stream.local_chunk_bytes
        key = (group.group_id, *side, chunk_bytes, stream.length)
        dl = self._local_lists.get(key)
        if dl is None:
            index, offsets = self._mine(group, stream)
            region = self._local.regions[index].region
            table = block_descriptors(
                region, np.arange(region.num_blocks), offsets=offsets, length=stream.length
            )
            dl = self._engine.prep_local(table)
            self._local_lists[key] = dl
        return dl

    def close(self) -> None:
        """Release the local lists (gate held)."""
        for dl in self._local_lists.values():
            dl.release()
        self._local_lists.clear()
