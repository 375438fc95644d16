"""How a load's bytes arrive on decode: READs we post (pull, :class:`PullReads`), or rounds
we ask prefill to write (push, :class:`PushRounds`).

**Pull**: post a source's READs, poll them, stage larger pages in rounds.

::

    post   every group's rows (worker.rows) -> one READ per piece stream
           staged groups -> the first round into free staging slots (staging.staged_reads)
    poll   round arrived -> the engine splits it, the slots go back -> the next round
           every READ and round done -> the source is done

Failures are raised (:class:`~kvbridge.connector.transfer.errors.TransferError` for NIXL, else
:class:`KVBridgeError`); the receiver fails the load.

**Push**: ask prefill to write a load, round by round.

::

    round 0  Push(our block ids, rewrites, staged=[first pages -> slots we leased])
             prefill WRITEs every group we do not stage into our blocks, and the named
             pages into our staging slots          <-- Pushed(round 0, bytes)
             the engine splits the staged pages into our blocks; the slots go back
    round k  Push(round k, staged=[next pages -> free slots])  <-- Pushed(round k) ...
             no slot free: the source waits (STAGING) for another load to give some back

Every round's ``Push`` carries the whole load's block ids, so each round takes only as many
staged pages as keep its message under the notification limit; a round that cannot fit
(or cannot be sent) fails its load by name, never the peer.

Without staged groups (``GroupPlan.split_from``) a load is round 0 alone. Prefill answers
every round exactly once, once every WRITE it posted for the round ended: written,
refused, or cancelled by our ``Done(ok=False)``. A load that fails before that answer
(abort, failure, deadline) hands the round to the quarantine
(``kvbridge.connector.worker.decode.quarantine``): its blocks and slots stay out of the
engine's hands until the answer comes (a WRITE already posted cannot be cancelled), or
until prefill is found gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import numpy as np

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import (
    MAX_NOTIFICATION_BYTES,
    GroupRewrite,
    NotificationError,
    Push,
    Pushed,
    StagedPages,
    asked_key,
    encode_notification,
)
from kvbridge.connector.transfer.transport import PostFailedError, TransferEngine, XferState
from kvbridge.connector.worker.decode.inflight import Load, LoadState, PushEndpoint, Source
from kvbridge.connector.worker.decode.packed_reads import PackedReads
from kvbridge.connector.worker.peers import Peer, PeerDirectory
from kvbridge.connector.worker.staging.staged_reads import StageBatch, StagedReads
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
        packed: PackedReads | None = None,
    ) -> None:
        self._engine = engine
        self._peers = peers
        self._buffers = buffers
        self._staged = staged
        self._metrics = metrics
        self._packed = packed

    def post(self, load: Load, src: Source, peer: Peer) -> None:
        """Post every READ of ``src`` and its first staging round (packed: the one READ of
        prefill's packed range, when it packed)."""
        assert peer.plan is not None
        if src.landing is not None and self._packed is not None:
            if self._packed.post(load, src, peer):
                return
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
            load.kernels = True  # before the call: one that raises may have queued some
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
        try:
            handle = self._engine.read(local, lrows, remote, rrows)
        except PostFailedError as exc:  # part of it may run: held like any READ posted
            src.handles.append(exc.handle)
            raise
        src.handles.append(handle)
        load.num_bytes += int(lrows.size) * stream.length
        self._metrics.descriptors_posted += handle.num_descs  # a merged run counts once

    def _stage_next(self, load: Load, src: Source, peer: Peer | None) -> None:
        if peer is None:
            raise KVBridgeError(f"peer {src.key} went away before the read")

        def leased(batch: StageBatch) -> None:
            src.batch = batch  # held by the source (and a failure's quarantine) from here

        load.num_bytes += self._staged.post_round(src.staged, peer.remote_lists, leased)


logger = logging.getLogger(__name__)

MAX_PAGES_PER_ROUND = 1024  # pages of one round, if its Push fits the notification limit
# what one staged page may add to a Push: a block id and a slot id, MessagePack integers of
# at most 9 bytes each
PAGE_BYTES = 18


class PushRounds:
    """The Push rounds of one decode worker, and the slots of rounds left unanswered."""

    def __init__(
        self,
        staged: StagedReads,
        buffers: KVCacheBuffers,
        endpoint: PushEndpoint,
        send: Callable[[Peer, object], bool],
        *,
        clock: Callable[[], float] = time.monotonic,
        packed: PackedReads | None = None,
    ) -> None:
        """``packed``: asks prefill to write a load's rows packed into our gather arena."""
        self._packed = packed
        self._staged = staged
        self._buffers = buffers
        self._endpoint = endpoint
        self._send = send
        self._clock = clock

    def ask(self, load: Load, src: Source, peer: Peer, rewrites: list[GroupRewrite]) -> None:
        """Send round 0. Raises :class:`KVBridgeError` naming why prefill could not be
        asked (the load fails)."""
        assert peer.plan is not None
        by_group = {}
        try:
            for g in peer.plan.groups:  # the blocks that will receive data (and checks)
                found = by_group[g.group_id] = load.rows(
                    g, self._buffers.config.groups[g.group_id].spec
                )
                if found.staged is not None:
                    src.staged.append(found.staged)
                elif found.touched is not None:
                    load.touch(g.group_id, found.touched)
        except KVBridgeError as exc:
            raise KVBridgeError(f"could not plan the push: {exc}") from None
        packs = self._packed is not None and self._packed.lease(load, src, peer, by_group)
        spec = load.spec
        src.push = Push(
            request_id=spec.params.remote_request_id,
            reader_engine_id=self._endpoint.engine_id,
            reader_rank=self._endpoint.rank,
            reader_host=self._endpoint.host,
            reader_port=self._endpoint.port,
            block_ids=[list(ids) for ids in spec.local_block_ids],
            start_token=spec.start_token,
            end_token=spec.end_token,
            rewrites=rewrites,
            plan_digest=peer.plan.digest,
            timeout_s=1.0,  # each round sets its own
            verify=load.verify,  # round 0's answer brings the digests of what it wrote
            skipped_groups=peer.plan.skipped_groups(),
            packed_at=self._packed.landing_at(src) if packs and self._packed else -1,
            packed_bytes=src.packed.num_bytes if packs and src.packed else 0,
        )
        try:
            encode_notification(src.push)  # too many blocks for one notification: this load
        except NotificationError as exc:
            if self._packed is not None:
                self._packed.held(src)  # never asked for: the landing is free
            raise KVBridgeError(f"cannot ask {peer.key} to push: {exc}") from None
        src.round = 0
        self.next_round(load, src, peer)

    def next_round(self, load: Load, src: Source, peer: Peer | None) -> None:
        """Ask round ``src.round`` with as many staged pages as slots are free; a later
        round with none free waits (STAGING) and is asked again by the receiver's step."""
        assert src.push is not None
        if peer is None:
            raise KVBridgeError(f"peer {src.key} went away between two push rounds")
        # prefill starts no write after this (and answers once those it started ended)
        timeout = max(load.deadline - self._clock(), 0.001)
        batch = None
        if src.staged:
            fits = self._pages_that_fit(src, timeout, peer)
            batch = self._staged.lease_round(src.staged, min(fits, MAX_PAGES_PER_ROUND))
        if batch is None and src.round > 0:
            src.state = LoadState.STAGING
            return
        pages = []
        if batch is not None:
            pages = [
                StagedPages(
                    group_id=batch.staged.group.group_id,
                    blocks=batch.remote_blocks.tolist(),
                    slots=batch.slots.tolist(),
                )
            ]
        msg = msgspec.structs.replace(src.push, round=src.round, staged=pages, timeout_s=timeout)
        try:
            encode_notification(msg)  # the bound above is conservative: never taken here
        except NotificationError as exc:
            if batch is not None:
                self._staged.cancel(batch)
            raise KVBridgeError(f"push round {src.round} for {peer.key}: {exc}") from None
        if not self._send(peer, msg):
            if batch is not None:
                self._staged.cancel(batch)  # never asked for: the slots are free
            raise KVBridgeError(f"push round {src.round} not sent to prefill {peer.key}")
        src.batch, src.state = batch, LoadState.PUSHED
        src.round_agent = peer.agent
        src.push_asked = asked_key(msg)

    def _pages_that_fit(self, src: Source, timeout: float, peer: Peer) -> int:
        """How many staged pages this round's ``Push`` has room for under the limit;
        raises :class:`KVBridgeError` (the load fails) when not even one fits."""
        assert src.push is not None and src.staged
        group_id = src.staged[0].group.group_id
        empty = StagedPages(group_id=group_id, blocks=[], slots=[])
        bare = msgspec.structs.replace(src.push, round=src.round, staged=[empty], timeout_s=timeout)
        room = MAX_NOTIFICATION_BYTES - len(msgspec.msgpack.encode(bare)) - 8  # list headers
        fits = room // PAGE_BYTES
        if fits < 1:
            raise KVBridgeError(
                f"push round {src.round} for {peer.key}: the Push names too many blocks to "
                f"add one staged page under the {MAX_NOTIFICATION_BYTES}-byte notification "
                f"limit"
            )
        return fits

    def answered(self, load: Load, src: Source, msg: Pushed, peer: Peer | None) -> None:
        """Prefill answered the round in flight: split its pages, then ask the next round
        or mark the source DONE. Raises :class:`KVBridgeError` when the load fails."""
        batch, src.batch = src.batch, None
        src.round_agent = ""  # answered: no WRITE of the round runs any more
        if src.landing is not None and self._packed is not None:  # a packed round 0
            self._packed.pushed(load, src, ok=msg.ok, packed=msg.packed, num_bytes=msg.num_bytes)
        elif msg.ok and msg.packed:
            raise KVBridgeError(f"prefill {src.key} wrote packed rows this load named no room for")
        if not msg.ok:
            if batch is not None:
                self._staged.cancel(batch)  # prefill released its writes before answering
            raise KVBridgeError(f"prefill {src.key} could not push the blocks: {msg.reason}")
        if msg.asked and src.push_asked and msg.asked != src.push_asked:
            if batch is not None:
                self._staged.cancel(batch)  # its WRITEs ended: only the slots go back
            raise KVBridgeError(
                f"prefill {src.key} answered push round {msg.round} as it read it, which is "
                f"not the round sent (the Push changed on the way: version skew or a bug); "
                f"what it wrote is not trusted"
            )
        load.num_bytes += msg.num_bytes
        if msg.round == 0 and load.verify:
            src.digests = list(msg.digests)  # [] when prefill digested no group
        if batch is not None:
            load.kernels = True  # before the call: one that raises may have queued some
            self._staged.split(batch, src.staged_sums if load.verify else None)
        src.round += 1
        if src.staged:
            self.next_round(load, src, peer)
        else:
            src.state = LoadState.DONE
