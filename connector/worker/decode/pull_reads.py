"""Decode side of pull mode: post a source's READs, poll them, stage larger pages in rounds.

::

    post   every group's rows (worker.load_rows) -> one READ per piece stream
           staged groups -> the first round into free staging slots (staging.staged_reads)
    poll   round arrived -> the engine splits it, the slots go back -> the next round
           every READ and round done -> the source is done

Failures are raised (:class:`~kvbridge.connector.transfer.errors.TransferError` for NIXL, else
:class:`KVBridgeError`); the receiver fails the load.
"""

from __future__ import annotations

import numpy as np

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.transfer.transport import TransferEngine, XferState
from kvbridge.connector.worker.decode.load_records import Load, Source
from kvbridge.connector.worker.peers import Peer, PeerDirectory
from kvbridge.connector.worker.staging.staged_reads import StagedReads
from kvbridge.handshake.plan_model import GroupPlan
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError


class PullReads:
    """The READs of one decode worker's pull loads."""

    def __init__(
        self,
        engine: TransferEngine,
        peers: PeerDirectory,
        buffers: KVCacheBuffers,
        staged: StagedReads,
        metrics: ConnectorMetrics,
    ) -> None:
        self._engine = engine
        self._peers = peers
        self._buffers = buffers
        self._staged = staged
        self._metrics = metrics

    def post(self, load: Load, src: Source, peer: Peer) -> None:
        """Post every READ of ``src`` and its first staging round."""
        assert peer.plan is not None
        for g in peer.plan.groups:
            found = load.rows(g, self._buffers.config.groups[g.group_id].spec)
            if found.staged is not None:
                src.staged.append(found.staged)
                continue
            for i, lrows, rrows in found.rows:
                self._read(load, src, peer, g, i, lrows, rrows)
            if found.touched is not None:
                load.touch(g.group_id, found.touched)
        if src.staged:
            self._stage_next(load, src, peer)

    def poll(self, load: Load, src: Source, peer: Peer | None) -> bool:
        """Advance ``src``'s READs and rounds; True when all of them are done."""
        pending = [h for h in src.handles if self._engine.poll(h) is XferState.PENDING]
        batch = src.batch
        if batch and all(self._engine.poll(h) is XferState.DONE for h in batch.handles):
            src.batch = None
            self._staged.split(batch, src.staged_sums if load.verify else None)
        if src.batch is None and src.staged:
            self._stage_next(load, src, peer)
        return not (pending or src.batch or src.staged)

    def _read(
        self,
        load: Load,
        src: Source,
        peer: Peer,
        g: GroupPlan,
        i: int,
        lrows: np.ndarray,
        rrows: np.ndarray,
    ) -> None:
        stream = g.streams[i]
        local = self._peers.local_list(g, stream)
        remote = peer.remote_lists[(g.group_id, i)]
        handle = self._engine.read(local, lrows, remote, rrows)
        src.handles.append(handle)
        load.num_bytes += int(lrows.size) * stream.length
        self._metrics.descriptors_posted += handle.num_descs  # a merged run counts once

    def _stage_next(self, load: Load, src: Source, peer: Peer | None) -> None:
        if peer is None:
            raise KVBridgeError(f"peer {src.key} went away before the read")
        src.batch, num_bytes = self._staged.post_round(src.staged, peer.remote_lists)
        load.num_bytes += num_bytes
