"""Decode side: turn LoadSpecs into NIXL READs, and report loads done or failed.

One load moves through::

    WAITING_PEER --(peer ready)--> PREPARING --(Prepared)--> READING --(all DONE)--> done
         |                        (skipped when the plan needs no sender rewrite)
         `--- handshake failed / Prepared(ok=False) / TransferError / deadline --> failed

Receiver rewrites (merge after load) run as soon as the reads complete; then prefill is
told ``Done`` so it frees its blocks.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from connector.metadata import LoadFailure, LoadSpec
from connector.metrics import ConnectorMetrics
from connector.notifications import Done, GroupRewrite, Prepare, Prepared, WireArrangement
from connector.peers import Peer, PeerDirectory, PeerKey, PeerState
from connector.transport import TransferEngine, XferHandle, XferState
from handshake.plan_model import GroupPlan, TransferPlan
from layouts.allocation import KVCacheBuffers
from layouts.errors import KVBridgeError
from layouts.specs import KVCacheKind, SlidingWindowSpec
from layouts.transforms import rewrite_group

# (group id, local block ids, remote block size): the engine repacks local blocks that
# each received whole, smaller remote pages (engine-packed formats, see handshake.plan)
Repacker = Callable[[int, np.ndarray, int], None]

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
    ) -> None:
        self._engine = engine
        self._repacker = repacker
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
        except KVBridgeError as exc:
            peer = self._peers.get(load.key)
            self._finish_failed(load, f"read failed: {exc}")
            if peer is not None:
                self._peers.drop(peer.key, f"transfer failed: {exc}")
            return
        if pending:
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
                    self._repacker(g.group_id, ids, g.repack_from)
                    self._metrics.receiver_rewrites += int(ids.size)
        self._metrics.transfers += 1
        self._metrics.bytes_read += load.num_bytes
        self._metrics.transfer_seconds += self._clock() - load.started
        self._notify_done(load, ok=True)
        self._forget(load)
        self._done.add(load.spec.request_id)

    def _plan(self, load: Load) -> TransferPlan | None:
        peer = self._peers.get(load.key)
        return peer.plan if peer is not None else None

    def _release_handles(self, load: Load) -> None:
        for h in load.handles:
            self._engine.release(h)
        load.handles.clear()

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


def _invalid_blocks(spec: LoadSpec) -> tuple[tuple[int, ...], ...]:
    """Local blocks that would have received data (start..end), per group."""
    out = []
    for ids in spec.local_block_ids:
        out.append(tuple(ids))
    return tuple(out)
