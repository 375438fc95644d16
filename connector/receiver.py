"""Decode side: turn LoadSpecs into NIXL READs (or Push requests), report loads done or failed.

A load reads from one prefill rank, or from several under tensor parallelism (each holds
some of this decode rank's KV heads; ``connector.routing``). Each source moves through::

    pull  WAITING_PEER --(peer ready)--> PREPARING --(Prepared)--> READING --(all DONE)--> done
               |                   (skipped when the plan needs no sender rewrite)
    push  WAITING_PEER --(peer ready)--> PUSHED --(Pushed: prefill wrote our blocks)--> done
               |
               `--- handshake failed / Prepared or Pushed not ok / TransferError /
                    deadline --> failed

and the load fails as soon as one source fails. Receiver rewrites (merge after load) run
when every source's reads completed; then every prefill rank the route names is told
``Done`` so it frees its blocks.

Engine-packed remote pages larger than the local blocks (``GroupPlan.split_from``) are read
whole into staging slots, in rounds of as many slots as are free; after each round the
engine splits the loaded tokens into its blocks and the slots go back.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from connector.errors import TransferError
from connector.host_stage import HostStage
from connector.load_rows import GroupRows, group_rows
from connector.load_timeline import LoadTimeline
from connector.metadata import LoadFailure, LoadSpec
from connector.metrics import ConnectorMetrics
from connector.notifications import (
    Done,
    GroupRewrite,
    NotificationError,
    Prepare,
    Prepared,
    Push,
    Pushed,
    WireArrangement,
    encode_notification,
)
from connector.params import KVTransferParams
from connector.peers import Peer, PeerDirectory, PeerKey, PeerState
from connector.routing import Route, Router
from connector.staged_reads import Repacker, StageBatch, Staged, StagedReads
from connector.staging import StagingPools
from connector.transport import TransferEngine, XferHandle, XferState
from handshake.plan_model import GroupPlan
from layouts.allocation import KVCacheBuffers
from layouts.errors import KVBridgeError
from layouts.transforms import rewrite_group

logger = logging.getLogger(__name__)

# (peer, (host, port), message): queue a notification for a peer, connected or not yet
Notify = Callable[[PeerKey, tuple[str, int], object], None]


class LoadState(enum.Enum):
    WAITING_PEER = "waiting_peer"
    PREPARING = "preparing"
    READING = "reading"
    PUSHED = "pushed"  # push mode: asked prefill to write, waiting for Pushed
    DONE = "done"


@dataclass(frozen=True)
class PushEndpoint:
    """Push mode: where prefill finds this decode rank (its own handshake listener)."""

    engine_id: str
    rank: int
    host: str
    port: int


@dataclass
class Source:
    """One prefill rank a load reads from."""

    key: PeerKey
    state: LoadState = LoadState.WAITING_PEER
    handles: list[XferHandle] = field(default_factory=list)
    staged: list[Staged] = field(default_factory=list)  # remote pages still to stage
    batch: StageBatch | None = None  # the staging round in flight


@dataclass
class Load:
    spec: LoadSpec
    route: Route
    deadline: float
    sources: list[Source]
    timeline: LoadTimeline
    touched: dict[int, np.ndarray] = field(default_factory=dict)  # group -> local block ids
    num_bytes: int = 0
    started: float = 0.0

    def source(self, key: PeerKey) -> Source | None:
        return next((s for s in self.sources if s.key == key), None)


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
        wall_clock: Callable[[], float] = time.time,
        repacker: Repacker | None = None,
        staging_bytes: int = 64 << 20,
        router: Router | None = None,
        notify: Notify | None = None,
        push: PushEndpoint | None = None,
        stage: HostStage | None = None,
    ) -> None:
        """``push``: ask prefill to write (push mode) instead of reading (pull).
        ``stage``: reads land in this host mirror of ``buffers`` (host staging) and are
        copied into ``buffers`` once the load is complete."""
        self._engine = engine
        self._stage = stage
        self._push = push
        self._repacker = repacker
        self._staged = StagedReads(
            engine,
            StagingPools(engine, staging_bytes, device=buffers.device),
            buffers,
            metrics,
            repacker,
        )
        self._peers = peers
        self._buffers = buffers
        self._metrics = metrics
        self._send = send
        self._notify = notify or self._notify_now
        self._router = router or Router(0, 1, 1)
        self._timeout_s = timeout_s
        self._clock = clock
        self._wall_clock = wall_clock
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
        try:
            route = self._router.route(p)
        except KVBridgeError as exc:
            self._failed.append(_failure(spec, f"no route to the prefill ranks: {exc}"))
            self._metrics.transfer_failures += 1
            return
        for key in route.reads:
            self._peers.ensure(key, *route.endpoints[key], for_read=True)
        self._loads[spec.request_id] = Load(
            spec=spec,
            route=route,
            deadline=self._clock() + self._timeout_s,
            sources=[Source(key=key) for key in route.reads],
            timeline=LoadTimeline(added=self._clock()),
        )
        self._by_remote[p.remote_request_id] = spec.request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a load; True if it was in flight (it is then reported as failed)."""
        load = self._loads.get(request_id)
        if load is None:
            return False
        self._finish_failed(load, "aborted by the engine")
        return True

    def _awaiting(
        self, request_id: str, state: LoadState, agent: str
    ) -> tuple[Load, Source] | None:
        """The load and source waiting in ``state`` for ``agent``'s answer about the
        remote request (None: nobody waits for it, a bad notification)."""
        rid = self._by_remote.get(request_id)
        load = self._loads.get(rid) if rid else None
        if load is not None:
            for src in load.sources:
                if src.state is state and (not agent or self._agent_of(src.key) == agent):
                    return load, src
        self._metrics.bad_notifications += 1
        return None

    def on_prepared(self, msg: Prepared, agent: str = "") -> None:
        found = self._awaiting(msg.request_id, LoadState.PREPARING, agent)
        if found is None:
            return
        load, src = found
        if not msg.ok:
            self._finish_failed(load, f"prefill could not prepare the blocks: {msg.reason}")
            return
        self._post(load, src)

    def on_pushed(self, msg: Pushed, agent: str = "") -> None:
        """Prefill wrote its part of a load into our blocks (or says why not)."""
        found = self._awaiting(msg.request_id, LoadState.PUSHED, agent)
        if found is None:
            return
        load, src = found
        if not msg.ok:
            self._finish_failed(load, f"prefill {src.key} could not push the blocks: {msg.reason}")
            return
        load.num_bytes += msg.num_bytes
        src.state = LoadState.DONE

    def step(self) -> None:
        """Advance every load: peers that became ready, reads that completed, deadlines."""
        for peer in self._peers.poll():
            if peer.state is PeerState.READY:
                continue
            # FAILED: unreachable, it frees by lease. INCOMPATIBLE: told Done(ok=False) at
            # once, so it frees the request's blocks now
            for load in [ld for ld in self._loads.values() if ld.source(peer.key)]:
                self._finish_failed(load, peer.reason)
        now = self._clock()
        for load in list(self._loads.values()):
            for src in load.sources:
                if load.spec.request_id not in self._loads:
                    break
                if src.state is LoadState.WAITING_PEER:
                    peer = self._peers.get(src.key)
                    if peer is not None and peer.state is PeerState.READY:
                        self._start(load, src, peer)
                # reads just posted are polled at once: CPU-to-CPU reads (UCX over cma)
                # complete inside the post, and waiting for the engine's next step cost
                # a whole step (bench_e2e: ~2 ms of a 2.3 ms load)
                if src.state is LoadState.READING and load.spec.request_id in self._loads:
                    self._poll_reads(load, src)
            if load.spec.request_id not in self._loads:
                continue
            if all(s.state is LoadState.DONE for s in load.sources):
                load.timeline.arrived = load.timeline.arrived or self._clock()
                self._complete(load)
            elif now > load.deadline:
                states = ", ".join(f"{s.key}: {s.state.value}" for s in load.sources)
                self._finish_failed(
                    load,
                    f"load timed out: not complete within {self._timeout_s:.1f} s ({states})",
                )

    def take_results(self) -> tuple[set[str], list[LoadFailure]]:
        done, failed = self._done, self._failed
        self._done, self._failed = set(), []
        return done, failed

    # -- internals ----------------------------------------------------------------------

    def _agent_of(self, key: PeerKey) -> str:
        peer = self._peers.get(key)
        return peer.agent if peer is not None else ""

    def _start(self, load: Load, src: Source, peer: Peer) -> None:
        assert peer.plan is not None
        load.timeline.started = load.timeline.started or self._clock()
        bad = _outside(load.spec.params, peer)
        if bad:
            # params no prefill issued (unsigned deployments): never read, never Prepare,
            # and no Done either: the request id in them may be another request's
            self._finish_failed(load, bad, notify=False)
            return
        rewrites = [
            GroupRewrite(
                group_id=gid, src=WireArrangement.of(rw.src), dst=WireArrangement.of(rw.dst)
            )
            for gid, rw in peer.plan.sender_rewrites().items()
        ]
        params = load.spec.params
        if self._push is not None:
            self._ask_push(load, src, peer, rewrites)
            return
        # A read that needs no rewrite goes straight to the blocks, unless prefill's first
        # lease may be running out: then claim them first (an empty Prepare), so a block
        # whose lease ran out is never read as if it were still the request's.
        claim = bool(params.expires_at) and self._wall_clock() > params.expires_at - CLAIM_MARGIN_S
        # a sender that rewrites on save may hold the blocks in another reader's format
        claim = claim or bool(peer.layout and peer.layout.rewrites_on_save)
        if rewrites or claim:
            msg = Prepare(request_id=params.remote_request_id, rewrites=rewrites)
            if self._send(peer, msg):
                src.state = LoadState.PREPARING
            else:
                self._finish_failed(load, f"prefill {peer.key} unreachable for Prepare")
            return
        self._post(load, src)

    def _ask_push(self, load: Load, src: Source, peer: Peer, rewrites: list[GroupRewrite]) -> None:
        """Push mode: name our blocks to prefill; it writes and answers ``Pushed``."""
        assert self._push is not None and peer.plan is not None
        spec = load.spec
        try:
            for g in peer.plan.groups:  # the blocks that will receive data (and checks)
                found = self._rows(load, g)
                if found.touched is not None:
                    self._touch(load, g.group_id, found.touched)
        except KVBridgeError as exc:
            self._finish_failed(load, f"could not plan the push: {exc}")
            return
        if not load.started:
            load.started = self._clock()
        # prefill starts no write after this; we keep the blocks PUSH_MARGIN_S longer
        left = load.deadline - self._clock() - PUSH_MARGIN_S
        msg = Push(
            request_id=spec.params.remote_request_id,
            reader_engine_id=self._push.engine_id,
            reader_rank=self._push.rank,
            reader_host=self._push.host,
            reader_port=self._push.port,
            block_ids=[list(ids) for ids in spec.local_block_ids],
            start_token=spec.start_token,
            end_token=spec.end_token,
            rewrites=rewrites,
            plan_digest=peer.plan.digest,
            timeout_s=max(left, 0.001),
        )
        try:
            encode_notification(msg)  # too many blocks for one notification: this load only
        except NotificationError as exc:
            self._finish_failed(load, f"cannot ask {peer.key} to push: {exc}")
            return
        if not self._send(peer, msg):
            self._finish_failed(load, f"prefill {peer.key} unreachable for Push")
            return
        src.state = LoadState.PUSHED
        load.timeline.posted = load.timeline.posted or self._clock()

    def _rows(self, load: Load, g: GroupPlan) -> GroupRows:
        spec, params = load.spec, load.spec.params
        return group_rows(
            g,
            self._buffers.config.groups[g.group_id].spec,
            np.asarray(spec.local_block_ids[g.group_id], dtype=np.int64),
            np.asarray(params.remote_block_ids[g.group_id], dtype=np.int64),
            params.remote_first_block[g.group_id] if params.remote_first_block else 0,
            spec.start_token,
            spec.end_token,
        )

    def _post(self, load: Load, src: Source) -> None:
        peer = self._peers.get(src.key)
        if peer is None or peer.plan is None or peer.state is not PeerState.READY:
            self._finish_failed(load, f"peer {src.key} went away before the read")
            return
        src.state = LoadState.READING
        if not load.started:
            load.started = self._clock()
        load.timeline.posted = load.timeline.posted or load.started
        try:
            for g in peer.plan.groups:
                self._post_group(load, src, peer, g)
            if src.staged:
                self._stage_next(load, src)
        except KVBridgeError as exc:
            self._finish_failed(load, f"could not post the read: {exc}")

    def _post_group(self, load: Load, src: Source, peer: Peer, g: GroupPlan) -> None:
        found = self._rows(load, g)
        if found.staged is not None:
            src.staged.append(found.staged)
            return
        for i, lrows, rrows in found.rows:
            self._read(load, src, peer, g, i, lrows, rrows)
        if found.touched is not None:
            self._touch(load, g.group_id, found.touched)

    @staticmethod
    def _touch(load: Load, group_id: int, ids: np.ndarray) -> None:
        before = load.touched.get(group_id)
        load.touched[group_id] = np.unique(ids if before is None else np.concatenate([before, ids]))

    def _read(
        self, load: Load, src: Source, peer: Peer, g: GroupPlan, i: int, lrows, rrows
    ) -> None:
        stream = g.streams[i]
        local = self._peers.local_list(g, stream)
        remote = peer.remote_lists[(g.group_id, i)]
        handle = self._engine.read(local, lrows, remote, rrows)
        src.handles.append(handle)
        load.num_bytes += int(lrows.size) * stream.length
        self._metrics.descriptors_posted += handle.num_descs  # a merged run counts once

    def _poll_reads(self, load: Load, src: Source) -> None:
        try:
            pending = [h for h in src.handles if self._engine.poll(h) is XferState.PENDING]
            batch = src.batch
            if batch and all(self._engine.poll(h) is XferState.DONE for h in batch.handles):
                self._split(load, src, batch)
            if src.batch is None and src.staged:
                self._stage_next(load, src)
        except TransferError as exc:
            peer = self._peers.get(src.key)
            self._finish_failed(load, f"read from {src.key} failed: {exc}")
            if peer is not None:
                self._peers.drop(peer.key, f"transfer failed: {exc}")
            return
        except KVBridgeError as exc:  # staging or splitting: this load only
            self._finish_failed(load, f"could not stage the remote pages: {exc}")
            return
        if pending or src.batch or src.staged:
            return
        self._release_source(src)
        src.state = LoadState.DONE

    def _complete(self, load: Load) -> None:
        """Every source's reads are in: rewrite or repack what the plan asks, report."""
        if self._stage is not None:
            for group_id, ids in load.touched.items():
                self._stage.to_device(group_id, ids)
        peer = self._peers.get(load.sources[0].key) if load.sources else None
        plan = peer.plan if peer is not None else None
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
        load.timeline.record(load.spec.request_id, self._clock(), self._metrics)
        self._notify_done(load, ok=True)
        self._forget(load)
        self._done.add(load.spec.request_id)

    def _stage_next(self, load: Load, src: Source) -> None:
        peer = self._peers.get(src.key)
        if peer is None or peer.state is not PeerState.READY:
            raise KVBridgeError(f"peer {src.key} went away before the read")
        src.batch, num_bytes = self._staged.post_round(src.staged, peer)
        load.num_bytes += num_bytes

    def _split(self, load: Load, src: Source, batch: StageBatch) -> None:
        src.batch = None
        self._staged.split(batch)

    def _release_source(self, src: Source) -> None:
        for h in src.handles:
            self._engine.release(h)
        src.handles.clear()
        if src.batch is not None:  # releasing in-flight reads cancels them
            self._staged.cancel(src.batch)
            src.batch = None
        src.staged.clear()

    def _notify_done(self, load: Load, *, ok: bool) -> None:
        rid = load.spec.params.remote_request_id
        for key, readers in load.route.notify:
            peer = self._peers.get(key)
            if peer is not None and peer.state is PeerState.FAILED:
                continue  # unreachable: it frees by lease (a new handshake would not help)
            msg = Done(request_id=rid, ok=ok, readers=readers, reader_rank=self._router.rank)
            self._notify(key, load.route.endpoints[key], msg)

    def _notify_now(self, key: PeerKey, endpoint: tuple[str, int], msg: object) -> None:
        peer = self._peers.get(key)
        if peer is not None and peer.state is PeerState.READY:
            self._send(peer, msg)

    def _finish_failed(self, load: Load, reason: str, *, notify: bool = True) -> None:
        for src in load.sources:  # releasing an in-flight handle cancels it
            self._release_source(src)
        if notify:
            self._notify_done(load, ok=False)
        self._forget(load)
        self._metrics.transfer_failures += 1
        self._failed.append(_failure(load.spec, reason))
        logger.warning("load %s failed: %s", load.spec.request_id, reason)

    def _forget(self, load: Load) -> None:
        self._loads.pop(load.spec.request_id, None)
        self._by_remote.pop(load.spec.params.remote_request_id, None)

    def close(self) -> None:
        for load in list(self._loads.values()):
            self._finish_failed(load, "connector shut down")
        self._staged.close()


CLAIM_MARGIN_S = 10.0  # read without asking only while prefill's first lease has this left
PUSH_MARGIN_S = 1.0  # decode keeps a push's blocks this long after prefill's last start


def _outside(params: KVTransferParams, peer: Peer) -> str:
    """Why ``params`` name blocks ``peer`` does not have ('' when they all exist)."""
    assert peer.plan is not None and peer.layout is not None
    regions = peer.layout.regions
    for g in peer.plan.groups:
        ids = params.remote_block_ids[g.group_id]
        limit = min((regions[s.remote_region].region.num_blocks for s in g.streams), default=0)
        if ids and (min(ids) < 0 or max(ids) >= limit):
            return (
                f"kv_transfer_params name remote blocks {min(ids)}..{max(ids)} of group "
                f"{g.group_id}, outside the {limit} blocks {peer.key} advertised: not issued "
                f"by that prefill; nothing read"
            )
    return ""


def _failure(spec: LoadSpec, reason: str) -> LoadFailure:
    """The load failed: every local block that would have received data is invalid."""
    return LoadFailure(
        request_id=spec.request_id,
        reason=reason,
        invalid_block_ids=tuple(tuple(ids) for ids in spec.local_block_ids),
        num_valid_tokens=spec.start_token,
    )
