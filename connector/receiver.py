"""Decode side: turn LoadSpecs into NIXL READs, and report loads done or failed.

One load moves through::

    WAITING_PEER --(peer ready)--> PREPARING --(Prepared)--> READING --(all DONE)--> done
         |                        (skipped when the plan needs no sender rewrite)
         `--- handshake failed / Prepared(ok=False) / TransferError / deadline --> failed

Receiver rewrites (merge after load) run as soon as the reads complete; then prefill is
told ``Done`` so it frees its blocks.

Engine-packed remote pages larger than the local blocks (``GroupPlan.split_from``) are read
whole into staging slots, in rounds of as many slots as are free; after each round the
engine splits the loaded tokens into its blocks and the slots go back.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from connector.errors import TransferError
from connector.metadata import LoadFailure, LoadSpec
from connector.metrics import ConnectorMetrics
from connector.notifications import Done, GroupRewrite, Prepare, Prepared, WireArrangement
from connector.peers import Peer, PeerDirectory, PeerKey, PeerState
from connector.staging import StagingPool, StagingPools
from connector.transport import TransferEngine, XferHandle, XferState
from handshake.plan_model import GroupPlan, TransferPlan
from layouts.allocation import KVCacheBuffers
from layouts.errors import KVBridgeError
from layouts.specs import KVCacheKind, SlidingWindowSpec
from layouts.transforms import rewrite_group


class Repacker(Protocol):
    """The engine's way back to its own page order after a load of whole remote pages
    (engine-packed formats, ``CacheFormat.block_packing``; see handshake.packed_plan)."""

    def merge(self, group_id: int, block_ids: np.ndarray, remote_block_size: int) -> None:
        """Local blocks ``block_ids`` each hold whole, smaller remote pages side by side."""

    def split(
        self,
        group_id: int,
        pages: Sequence[torch.Tensor],
        remote_block_size: int,
        slots: np.ndarray,
    ) -> None:
        """``pages[i]`` holds ``n`` larger remote pages of the group's layer ``i`` (uint8,
        ``[n, page_bytes]``); write token ``t`` of page ``j`` to local slot
        ``slots[j, t]`` (block id x block size + offset), skipping slots ``< 0``."""


logger = logging.getLogger(__name__)


class LoadState(enum.Enum):
    WAITING_PEER = "waiting_peer"
    PREPARING = "preparing"
    READING = "reading"


@dataclass
class Load:
    spec: LoadSpec
    key: PeerKey
    deadline: float
    state: LoadState = LoadState.WAITING_PEER
    handles: list[XferHandle] = field(default_factory=list)
    touched: dict[int, np.ndarray] = field(default_factory=dict)  # group -> local block ids
    num_bytes: int = 0
    started: float = 0.0
    staged: list[Staged] = field(default_factory=list)  # remote pages still to stage
    batch: StageBatch | None = None  # the staging round in flight


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


@dataclass
class StageBatch:
    staged: Staged
    remote_blocks: np.ndarray
    pool: StagingPool
    slots: np.ndarray
    handles: list[XferHandle] = field(default_factory=list)


class Receiver:
    """Owns the in-flight loads of a decode worker."""

    def __init__(
        self,
        engine: TransferEngine,
        peers: PeerDirectory,
        buffers: KVCacheBuffers,
        metrics: ConnectorMetrics,
        send: Callable[[Peer, object], bool],
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        repacker: Repacker | None = None,
        staging_bytes: int = 64 << 20,
    ) -> None:
        self._engine = engine
        self._repacker = repacker
        self._staging = StagingPools(engine, staging_bytes, device=buffers.device)
        self._peers = peers
        self._buffers = buffers
        self._metrics = metrics
        self._send = send
        self._timeout_s = timeout_s
        self._clock = clock
        self._loads: dict[str, Load] = {}
        self._by_remote: dict[str, str] = {}  # remote request id -> local request id
        self._done: set[str] = set()
        self._failed: list[LoadFailure] = []

    @property
    def num_inflight(self) -> int:
        return len(self._loads)

    def add(self, spec: LoadSpec) -> None:
        if spec.request_id in self._loads:
            logger.warning("load %s already in flight; ignoring the duplicate", spec.request_id)
            return
        p = spec.params
        key = (p.remote_engine_id, p.remote_rank)
        self._peers.ensure(key, p.remote_host, p.remote_port)
        self._loads[spec.request_id] = Load(
            spec=spec, key=key, deadline=self._clock() + self._timeout_s
        )
        self._by_remote[p.remote_request_id] = spec.request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a load; True if it was in flight (it is then reported as failed)."""
        load = self._loads.get(request_id)
        if load is None:
            return False
        self._finish_failed(load, "aborted by the engine")
        return True

    def on_prepared(self, msg: Prepared) -> None:
        rid = self._by_remote.get(msg.request_id)
        load = self._loads.get(rid) if rid else None
        if load is None or load.state is not LoadState.PREPARING:
            self._metrics.bad_notifications += 1
            return
        if not msg.ok:
            self._finish_failed(load, f"prefill could not prepare the blocks: {msg.reason}")
            return
        self._post(load)

    def step(self) -> None:
        """Advance every load: peers that became ready, reads that completed, deadlines."""
        for peer in self._peers.poll():
            for load in [ld for ld in self._loads.values() if ld.key == peer.key]:
                if peer.state is PeerState.FAILED:
                    self._finish_failed(load, peer.reason)
        now = self._clock()
        for load in list(self._loads.values()):
            if load.state is LoadState.WAITING_PEER:
                peer = self._peers.get(load.key)
                if peer is not None and peer.state is PeerState.READY:
                    self._start(load, peer)
            elif load.state is LoadState.READING:
                self._poll_reads(load)
            if load.spec.request_id in self._loads and now > load.deadline:
                self._finish_failed(
                    load,
                    f"load from {load.key} timed out: not complete within "
                    f"{self._timeout_s:.1f} s (state {load.state.value})",
                )

    def take_results(self) -> tuple[set[str], list[LoadFailure]]:
        done, failed = self._done, self._failed
        self._done, self._failed = set(), []
        return done, failed

    # -- internals ----------------------------------------------------------------------

    def _start(self, load: Load, peer: Peer) -> None:
        assert peer.plan is not None
        rewrites = [
            GroupRewrite(
                group_id=gid, src=WireArrangement.of(rw.src), dst=WireArrangement.of(rw.dst)
            )
            for gid, rw in peer.plan.sender_rewrites().items()
        ]
        if rewrites:
            msg = Prepare(request_id=load.spec.params.remote_request_id, rewrites=rewrites)
            if self._send(peer, msg):
                load.state = LoadState.PREPARING
            else:
                self._finish_failed(load, f"prefill {peer.key} unreachable for Prepare")
            return
        self._post(load)

    def _post(self, load: Load) -> None:
        peer = self._peers.get(load.key)
        if peer is None or peer.plan is None or peer.state is not PeerState.READY:
            self._finish_failed(load, f"peer {load.key} went away before the read")
            return
        load.state = LoadState.READING
        load.started = self._clock()
        try:
            for g in peer.plan.groups:
                self._post_group(load, peer, g)
            if load.staged:
                self._stage_next(load)
        except KVBridgeError as exc:
            self._finish_failed(load, f"could not post the read: {exc}")

    def _post_group(self, load: Load, peer: Peer, g: GroupPlan) -> None:
        spec, params = load.spec, load.spec.params
        lids = np.asarray(spec.local_block_ids[g.group_id], dtype=np.int64)
        rids = np.asarray(params.remote_block_ids[g.group_id], dtype=np.int64)
        rfirst = params.remote_first_block[g.group_id] if params.remote_first_block else 0
        start, end = spec.start_token, spec.end_token
        if g.kind is KVCacheKind.STATE:
            if end <= start:
                return
            local_bs = self._buffers.config.groups[g.group_id].spec.block_size
            lblock, rblock = end // local_bs - 1, end // params.remote_block_size - 1
            if not 0 <= rblock - rfirst < rids.size or not 0 <= lblock < lids.size:
                raise KVBridgeError(
                    f"state for token {end} needs remote block {rblock} (have "
                    f"{rfirst}..{rfirst + rids.size - 1}) and local block {lblock}"
                )
            for i, stream in enumerate(g.streams):
                m = stream.num_pieces
                lrows = (lids[lblock] * m + np.arange(m)).astype(np.int64)
                rrows = (rids[rblock - rfirst] * m + np.arange(m)).astype(np.int64)
                self._read(load, peer, g, i, lrows, rrows)
            load.touched[g.group_id] = lids[lblock : lblock + 1]
            return
        lo = start
        local_spec = self._buffers.config.groups[g.group_id].spec
        if isinstance(local_spec, SlidingWindowSpec):
            lo = max(start, end - local_spec.sliding_window)
        if g.split_from:
            blocks = g.chunks_for_tokens(lo, end)  # one chunk per remote block
            if blocks.size and (blocks[0] < rfirst or blocks[-1] - rfirst >= rids.size):
                raise KVBridgeError(
                    f"group {g.group_id}: tokens [{lo}, {end}) need remote blocks "
                    f"{blocks[0]}..{blocks[-1]} but prefill sent "
                    f"{rfirst}..{rfirst + rids.size - 1}"
                )
            if blocks.size:
                load.staged.append(Staged(g, blocks, lo, end, lids, rids, rfirst))
            return
        chunks = g.chunks_for_tokens(lo, end)
        if chunks.size == 0:
            return
        for i, stream in enumerate(g.streams):
            lrows, rrows = g.indices(stream, chunks, lids, rids, remote_first_block=rfirst)
            self._read(load, peer, g, i, lrows, rrows)
        load.touched[g.group_id] = np.unique(lids[chunks // g.local_chunks_per_block])

    def _read(self, load: Load, peer: Peer, g: GroupPlan, i: int, lrows, rrows) -> None:
        stream = g.streams[i]
        local = self._peers.local_list(g, stream)
        remote = peer.remote_lists[(g.group_id, i)]
        handle = self._engine.read(local, lrows, remote, rrows)
        load.handles.append(handle)
        load.num_bytes += int(lrows.size) * stream.length
        self._metrics.descriptors_posted += int(lrows.size)

    def _poll_reads(self, load: Load) -> None:
        try:
            pending = [h for h in load.handles if self._engine.poll(h) is XferState.PENDING]
            batch = load.batch
            if batch and all(self._engine.poll(h) is XferState.DONE for h in batch.handles):
                self._split(load, batch)
            if load.batch is None and load.staged:
                self._stage_next(load)
        except TransferError as exc:
            peer = self._peers.get(load.key)
            self._finish_failed(load, f"read failed: {exc}")
            if peer is not None:
                self._peers.drop(peer.key, f"transfer failed: {exc}")
            return
        except KVBridgeError as exc:  # staging or splitting: this load only
            self._finish_failed(load, f"could not stage the remote pages: {exc}")
            return
        if pending or load.batch or load.staged:
            return
        self._release_handles(load)
        plan = self._plan(load)
        if plan is not None:
            for g in plan.groups:
                if g.receiver and g.group_id in load.touched:
                    stats = rewrite_group(
                        self._buffers,
                        g.group_id,
                        load.touched[g.group_id],
                        g.receiver.src,
                        g.receiver.dst,
                    )
                    self._metrics.receiver_rewrites += stats.num_blocks
                if g.repack_from and g.group_id in load.touched:
                    assert self._repacker is not None  # negotiation needs one for repacks
                    ids = load.touched[g.group_id]
                    self._repacker.merge(g.group_id, ids, g.repack_from)
                    self._metrics.receiver_rewrites += int(ids.size)
        self._metrics.transfers += 1
        self._metrics.bytes_read += load.num_bytes
        self._metrics.transfer_seconds += self._clock() - load.started
        self._notify_done(load, ok=True)
        self._forget(load)
        self._done.add(load.spec.request_id)

    def _stage_next(self, load: Load) -> None:
        """Post the next staging round of ``load``: as many remote pages as slots are free
        (none free: wait for another load's round to finish)."""
        staged = load.staged[0]
        g = staged.group
        peer = self._peers.get(load.key)
        if peer is None or peer.state is not PeerState.READY:
            raise KVBridgeError(f"peer {load.key} went away before the read")
        pool = self._staging.pool(g.staging_bytes)
        slots = pool.lease(int(staged.remote_blocks.size))
        if slots.size == 0:
            return
        blocks, staged.remote_blocks = (
            staged.remote_blocks[: slots.size],
            staged.remote_blocks[slots.size :],
        )
        if staged.remote_blocks.size == 0:
            load.staged.pop(0)
        batch = StageBatch(staged=staged, remote_blocks=blocks, pool=pool, slots=slots)
        load.batch = batch
        rrows = staged.remote_ids[blocks - staged.remote_first]
        offset = 0
        for i, stream in enumerate(g.streams):
            local = pool.local_list(offset, stream.length)
            remote = peer.remote_lists[(g.group_id, i)]
            batch.handles.append(self._engine.read(local, slots, remote, rrows))
            load.num_bytes += int(slots.size) * stream.length
            self._metrics.descriptors_posted += int(slots.size)
            offset += stream.length

    def _split(self, load: Load, batch: StageBatch) -> None:
        """A staging round arrived: the engine writes its tokens into local blocks."""
        for h in batch.handles:
            self._engine.release(h)
        batch.handles.clear()
        staged, g = batch.staged, batch.staged.group
        local_bs = self._buffers.config.groups[g.group_id].spec.block_size
        tokens = batch.remote_blocks[:, None] * g.split_from + np.arange(g.split_from)
        wanted = (tokens >= staged.lo) & (tokens < staged.end)
        logical = np.where(wanted, tokens // local_bs, 0)
        if logical.max() >= staged.local_ids.size:
            raise KVBridgeError(
                f"group {g.group_id}: token {int(tokens[wanted].max())} has no local block "
                f"({staged.local_ids.size} given)"
            )
        slots = np.where(wanted, staged.local_ids[logical] * local_bs + tokens % local_bs, -1)
        pages, offset = [], 0
        for stream in g.streams:
            pages.append(batch.pool.pages(batch.slots, offset, stream.length))
            offset += stream.length
        batch.pool.give_back(batch.slots)
        load.batch = None
        assert self._repacker is not None  # negotiation needs one for split plans
        self._repacker.split(g.group_id, pages, g.split_from, slots)
        self._metrics.receiver_rewrites += int(np.unique(logical[wanted]).size)

    def _plan(self, load: Load) -> TransferPlan | None:
        peer = self._peers.get(load.key)
        return peer.plan if peer is not None else None

    def _release_handles(self, load: Load) -> None:
        for h in load.handles:
            self._engine.release(h)
        load.handles.clear()
        if load.batch is not None:  # releasing in-flight reads cancels them
            for h in load.batch.handles:
                self._engine.release(h)
            load.batch.pool.give_back(load.batch.slots)
            load.batch = None
        load.staged.clear()

    def _notify_done(self, load: Load, *, ok: bool) -> None:
        peer = self._peers.get(load.key)
        if peer is not None and peer.state is PeerState.READY:
            self._send(peer, Done(request_id=load.spec.params.remote_request_id, ok=ok))

    def _finish_failed(self, load: Load, reason: str) -> None:
        self._release_handles(load)  # releasing an in-flight handle cancels it
        self._notify_done(load, ok=False)
        self._forget(load)
        self._metrics.transfer_failures += 1
        spec = load.spec
        self._failed.append(
            LoadFailure(
                request_id=spec.request_id,
                reason=reason,
                invalid_block_ids=_invalid_blocks(spec),
                num_valid_tokens=spec.start_token,
            )
        )
        logger.warning("load %s failed: %s", spec.request_id, reason)

    def _forget(self, load: Load) -> None:
        self._loads.pop(load.spec.request_id, None)
        self._by_remote.pop(load.spec.params.remote_request_id, None)

    def close(self) -> None:
        for load in list(self._loads.values()):
            self._finish_failed(load, "connector shut down")
        self._staging.close()


def _invalid_blocks(spec: LoadSpec) -> tuple[tuple[int, ...], ...]:
    """Local blocks that would have received data (start..end), per group."""
    out = []
    for ids in spec.local_block_ids:
        out.append(tuple(ids))
    return tuple(out)
