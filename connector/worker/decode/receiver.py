"""Decode side: turn LoadSpecs into NIXL READs (or Push requests), report loads done or failed.

A load reads from one prefill rank, or from several under tensor parallelism (each holds
some of this decode rank's KV heads; ``kvbridge.connector.worker.routing``). Each source moves
through the states of ``kvbridge.connector.worker.decode.inflight``::

    pull  WAITING_PEER --> PREPARING (a sender rewrite is due) --> READING --> done
    push  WAITING_PEER --> PUSHED <--> STAGING (push rounds, decode.transfers) --> done
               `--- handshake failed / Prepared or Pushed not ok / TransferError /
                    deadline / the READ outlived the claimed hold --> failed

and the load fails as soon as one source fails. Receiver rewrites (merge after load) run
when every source's reads completed; then every prefill rank the route names is told
``Done`` so it frees its blocks.

Every pull source claims its blocks (``kvbridge.connector.worker.decode.claims``): when
no rewrite is due the READ goes out with the claim, not after its answer, and the source
is done only once the answer came and the READs ended within the hold prefill promised.
What the receiver's own kernels wrote (rewrites, merges, the host mirror copied in) is
marked with an event on their stream, and the load is reported by the first step that
finds the mark complete (``kvbridge.connector.worker.device_order``): no host wait.

Engine-packed remote pages larger than the local blocks (``GroupPlan.split_from``) land
whole in staging slots, in rounds of as many slots as are free: read by decode
(``kvbridge.connector.worker.decode.transfers``), or written by prefill into the slots each Push
round names (``kvbridge.connector.worker.decode.transfers``); after each round the engine splits
the loaded tokens into its blocks and the slots go back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvbridge.connector.common.config import DEFAULT_MAX_QUARANTINED_MIB, DEFAULT_STAGING_MIB
from kvbridge.connector.common.metadata import LoadFailure, LoadSpec
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import (
    Done,
    GroupRewrite,
    Prepared,
    Pushed,
    WireArrangement,
)
from kvbridge.connector.transfer.errors import PeerDisconnectedError, TransferError
from kvbridge.connector.transfer.transport import TransferEngine, XferHandle
from kvbridge.connector.worker.decode.claims import Claims, Writers
from kvbridge.connector.worker.decode.inflight import (
    Load,
    LoadState,
    LoadTimeline,
    PushEndpoint,
    Source,
    describe_source,
    failure,
    outside,
)
from kvbridge.connector.worker.decode.landing import Landing, Verifier
from kvbridge.connector.worker.decode.packed_reads import PackedReads
from kvbridge.connector.worker.decode.quarantine import Quarantine, Round
from kvbridge.connector.worker.decode.transfers import PullReads, PushRounds
from kvbridge.connector.worker.device_order import DeviceOrder, Mark
from kvbridge.connector.worker.peers import Peer, PeerDirectory, PeerKey, PeerState
from kvbridge.connector.worker.routing import Router
from kvbridge.connector.worker.staging.arenas import StagingPools
from kvbridge.connector.worker.staging.host_stage import HostStage
from kvbridge.connector.worker.staging.staged_reads import Repacker, StageBatch, StagedReads
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)

# (peer, (host, port), message): queue a notification for a peer, connected or not yet
Notify = Callable[[PeerKey, tuple[str, int], object], None]


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
        staging: StagingPools | None = None,
        router: Router | None = None,
        notify: Notify | None = None,
        push: PushEndpoint | None = None,
        stage: HostStage | None = None,
        order: DeviceOrder | None = None,
        verifier: Verifier | None = None,
        max_quarantined_bytes: int = DEFAULT_MAX_QUARANTINED_MIB << 20,
        fail_early: bool = False,
        packed: PackedReads | None = None,
    ) -> None:
        """``staging``: the slots larger remote pages land in (default: a pool of
        ``DEFAULT_STAGING_MIB`` registered on first use). ``push``: ask prefill to write
        (push mode) instead of reading (pull). ``stage``: reads land in this host mirror
        of ``buffers`` (host staging) and are copied into ``buffers`` once the load is
        complete. ``verifier``: picks the loads that prove what they moved and checks them
        (``extra.verify``); ``max_quarantined_bytes``: ``extra.max_quarantined_mib``.
        ``fail_early`` (``failure_policy: fail``): a load that fails while transfers of
        its may still land is also reported at once, as failing (the engine ends the
        request and keeps its blocks until the failure itself is reported). ``packed``:
        moves many small rows as one packed range (``extra.gather_mib``, pull and push)."""
        self._engine = engine
        staging = staging or StagingPools(engine, DEFAULT_STAGING_MIB << 20, buffers.device)
        order = order or DeviceOrder(buffers.device)
        self._staged = StagedReads(engine, staging, buffers, metrics, repacker, order)
        self._packed = packed
        self._reads = PullReads(engine, peers, buffers, self._staged, metrics, packed)
        self._rounds = (
            PushRounds(self._staged, buffers, push, send, clock=clock, packed=packed)
            if push is not None
            else None
        )
        self._peers = peers
        self._quarantine = Quarantine(
            engine,
            self._staged,
            metrics,
            overdue_s=timeout_s,
            clock=clock,
            max_peer_bytes=max_quarantined_bytes,
        )
        self._verifier = verifier
        self._writers = Writers(peers, send, self._quarantine)
        self._metrics = metrics
        self._send = send
        self._notify = notify or self._notify_now
        self._router = router or Router(0, 1, 1)
        self._timeout_s = timeout_s
        self._clock = clock
        self._claims = Claims(send, metrics, clock, rank=self._router.engine_rank)
        self._landing = Landing(
            buffers,
            metrics,
            order,
            stage=stage,
            repacker=repacker,
        )
        self._loads: dict[str, Load] = {}
        self._by_remote: dict[str, str] = {}  # remote request id -> local request id
        self._done: set[str] = set()
        # landed loads not reported yet: their kernels may still run on the device
        self._landed: list[tuple[Load, Mark | None]] = []
        self._failed: list[LoadFailure] = []
        self._fail_early = fail_early
        self._failing: list[LoadFailure] = []

    @property
    def num_inflight(self) -> int:
        """Loads in flight (landed ones included until reported), and failed loads whose
        READs may still run (held back)."""
        return len(self._loads) + len(self._landed) + self._quarantine.num_held

    @property
    def num_active(self) -> int:
        """Loads in flight or landed and not yet reported (quarantined ones left out)."""
        return len(self._loads) + len(self._landed)

    @property
    def num_held(self) -> int:
        """Failed loads not yet reported: a READ of theirs may still write their blocks."""
        return self._quarantine.num_held

    @property
    def num_leased_staging_bytes(self) -> int:
        return self._staged.num_leased_bytes

    def add(self, spec: LoadSpec) -> None:
        if spec.request_id in self._loads:
            logger.warning("load %s already in flight; ignoring the duplicate", spec.request_id)
            return
        p = spec.params
        if p.remote_request_id in self._by_remote or self._quarantine.holds_remote(
            p.remote_request_id
        ):
            # the same prefill request twice at once (resubmitted params): its answers and
            # Done carry no load of ours, so the second load reads nothing and tells
            # prefill nothing (that would end the first one's hold)
            self._failed.append(
                failure(spec, f"prefill request {p.remote_request_id!r} is already loading here")
            )
            self._metrics.transfer_failures += 1
            return
        try:
            route = self._router.route(p)
        except KVBridgeError as exc:
            self._failed.append(failure(spec, f"no route to the prefill ranks: {exc}"))
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
            verify=self._verifier is not None and self._verifier.wants(),
        )
        self._by_remote[p.remote_request_id] = spec.request_id

    def loading_remote(self, remote_request_id: str) -> bool:
        """A load of ours reads (or was pushed) prefill's request ``remote_request_id``,
        or failed and may still be written: a ``Done`` for it is that load's to send."""
        return remote_request_id in self._by_remote or self._quarantine.holds_remote(
            remote_request_id
        )

    def abort(self, request_id: str) -> bool:
        """Cancel a load; True if it was in flight or is held (it is then reported as
        failed, and prefill told, once nothing can write its blocks)."""
        load = self._loads.get(request_id)
        if load is None:
            return self._quarantine.holds(request_id)
        self._finish_failed(load, "aborted by the engine", early=False)
        return True

    def _awaiting(
        self, request_id: str, state: LoadState, agent: str, push_round: int = 0
    ) -> tuple[Load, Source] | None:
        """The load and source waiting in ``state`` (push: for ``push_round``) for ``agent``'s
        answer about the remote request (None: nobody waits for it)."""
        rid = self._by_remote.get(request_id)
        load = self._loads.get(rid) if rid else None
        for src in load.sources if load is not None else ():
            if state is LoadState.PREPARING and src.state is LoadState.READING:
                if not src.claim_sent:
                    continue  # no claim in flight: an answer to nothing
            elif src.state is not state:
                continue
            if not agent or self._agent_of(src.key) == agent:
                if state is not LoadState.PUSHED or src.round == push_round:
                    return load, src
        return None

    def on_prepared(self, msg: Prepared, agent: str = "") -> None:
        """Prefill answered a claim: post the READs (a rewrite was due), or extend what
        we know of the hold under READs already posted."""
        found = self._claimant(msg, agent)
        if found is None:
            self._claims.stray_answer(msg, agent)
            return
        load, src = found
        if src.state is LoadState.PREPARING:  # where a packed read's rows lie (-1: none)
            src.packed_at, src.packed_bytes = msg.packed_at, msg.packed_bytes
        if not msg.ok:
            self._claims.settle(src, ended=False, answered=msg.claim)
            self._finish_failed(load, f"prefill could not prepare the blocks: {msg.reason}")
            return
        untrusted = self._claims.answered(src, msg)
        if untrusted:
            self._finish_failed(load, untrusted)
            return
        if src.state is LoadState.PREPARING:
            self._post(load, src)
        elif src.reads_done:
            self._fail(load, self._claims.reads_ended(src))

    def _claimant(self, msg: Prepared, agent: str) -> tuple[Load, Source] | None:
        """The load and source with a claim in flight that ``msg`` (from ``agent``)
        answers; None: no claim in flight is this one."""
        rid = self._by_remote.get(msg.request_id)
        load = self._loads.get(rid) if rid else None
        for src in load.sources if load is not None else ():
            if src.state not in (LoadState.PREPARING, LoadState.READING):
                continue
            if Claims.answers(src, msg) and (not agent or self._agent_of(src.key) == agent):
                return load, src
        return None

    def on_pushed(self, msg: Pushed, agent: str = "") -> None:
        """Prefill wrote a round of a load into our blocks and slots (or says why not)."""
        found = self._awaiting(msg.request_id, LoadState.PUSHED, agent, msg.round)
        if found is None:
            if not self._quarantine.answered((agent, msg.request_id, msg.round)):
                self._metrics.bad_notifications += 1
            return
        assert self._rounds is not None  # PUSHED sources exist in push mode only
        load, src = found
        try:
            self._rounds.answered(load, src, msg, self._ready_peer(src))
        except (KVBridgeError, RuntimeError) as exc:  # RuntimeError: torch (our copies)
            self._finish_failed(load, str(exc))

    def step(self) -> None:
        """Advance every load: peers that became ready, reads that completed, deadlines."""
        if self._packed is not None:
            self._packed.drain()  # landings whose scatter finished go back
        for load in [ld for ld in self._loads.values() if self._writers.writer_gone(ld)]:
            self._finish_failed(load, "the prefill writing this load was found gone")
        for peer in self._peers.poll():
            if peer.state is PeerState.READY:
                continue
            # FAILED: unreachable, it frees by lease. INCOMPATIBLE: told Done(ok=False) at
            # once, so it frees the request's blocks now. REFUSED (over the quarantine
            # cap): no new load starts from it; loads already reading from it go on
            for load in [ld for ld in self._loads.values() if ld.source(peer.key)]:
                src = load.source(peer.key)
                started = src is not None and src.state is not LoadState.WAITING_PEER
                if peer.state is PeerState.REFUSED and started:
                    continue
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
                elif src.state is LoadState.STAGING:  # push: slots may be free now
                    self._next_round(load, src)
                # reads just posted are polled at once: CPU-to-CPU reads (UCX over cma)
                # complete inside the post, and waiting for the engine's next step cost
                # a whole step (bench_e2e: ~2 ms of a 2.3 ms load)
                if src.state is LoadState.READING and load.spec.request_id in self._loads:
                    if not src.reads_done:
                        self._poll_reads(load, src)
                    if load.spec.request_id in self._loads and not src.reads_done:
                        peer = self._ready_peer(src)
                        self._fail(load, self._claims.refresh(load, src, peer, now))
                if (
                    load.spec.request_id in self._loads
                    and now <= load.deadline
                    and src.state in (LoadState.PREPARING, LoadState.READING)
                    and self._claims.resend_due(src, now, Claims.numbered(self._ready_peer(src)))
                ):
                    self._fail(load, self._claims.again(load, src, self._ready_peer(src), now))
            if load.spec.request_id not in self._loads:
                continue
            if all(s.state is LoadState.DONE for s in load.sources):
                load.timeline.arrived = load.timeline.arrived or self._clock()
                self._complete(load)
            elif now > load.deadline:
                states = ", ".join(f"{s.key}: {describe_source(s, now)}" for s in load.sources)
                self._finish_failed(
                    load,
                    f"load timed out: not complete within {self._timeout_s:.1f} s ({states})",
                )
        self._quarantine.step()
        self._writers.probe(self._loads.values(), now)
        self._report_landed()

    def take_results(self) -> tuple[set[str], list[LoadFailure], list[LoadFailure]]:
        """Loads (done, failed, failing) since the last call: failed loads have nothing
        left that can write their blocks; failing ones (``fail_early``) may, and are
        reported failed once nothing can. Landed loads whose kernels finished are
        reported here too, when a deferred round did not step (no NIXL call needed)."""
        self._report_landed()
        done, failed, failing = self._done, self._failed, self._failing
        self._done, self._failed, self._failing = set(), [], []
        return done, failed, failing

    # -- internals ----------------------------------------------------------------------

    def _agent_of(self, key: PeerKey) -> str:
        peer = self._peers.get(key)
        return peer.agent if peer is not None else ""

    def _start(self, load: Load, src: Source, peer: Peer) -> None:
        assert peer.plan is not None
        load.timeline.started = load.timeline.started or self._clock()
        bad = outside(load.spec.params, peer)
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
        if self._rounds is not None:
            self._ask_push(load, src, peer, rewrites)
            return
        src.rewrites = rewrites
        try:
            packs = self._packed is not None and self._packed.lease(load, src, peer)
        except KVBridgeError as exc:  # rows the params cannot name: this load only
            self._finish_failed(load, f"could not plan the read: {exc}")
            return
        if not self._first_claim(load, src, peer):
            if self._packed is not None:
                self._packed.held(src)  # nothing posted: the landing goes back
            return
        # a rewrite is due, a sender that rewrites on save may hold the blocks in another
        # reader's format, or it packs the rows: read once prefill answered; else at once
        if rewrites or packs or (peer.layout is not None and peer.layout.rewrites_on_save):
            src.state = LoadState.PREPARING
            return
        self._post(load, src)

    def _first_claim(self, load: Load, src: Source, peer: Peer) -> bool:
        """The claim before any READ; False: the load failed, or waits for the peer."""
        if self._claims.send(load, src, peer):
            return True
        if src.handshaken_again:
            self._finish_failed(load, f"prefill {peer.key} unreachable for a claim (Prepare)")
            return False
        if self._ready_peer(src) is not None:  # a local failure: the peer was kept
            self._finish_failed(load, f"the claim (Prepare) to prefill {peer.key} failed to send")
            return False
        # The agent we knew is gone (the send dropped it) and nothing was posted to it. A
        # prefill restarted under the same engine id and address answers there with a new
        # agent: handshake again and claim from it (once). One that does not hold this
        # request refuses the claim; a dead one fails the handshake, and so the load.
        src.handshaken_again = True
        src.state = LoadState.WAITING_PEER
        self._peers.ensure(src.key, *load.route.endpoints[src.key], for_read=True)
        logger.warning(
            "load %s: prefill %s unreachable for a claim; handshaking again (restarted?)",
            load.spec.request_id,
            peer.key,
        )
        return False

    def _ask_push(self, load: Load, src: Source, peer: Peer, rewrites: list[GroupRewrite]) -> None:
        """Push mode: name our blocks (and slots, round by round) to prefill; it writes
        and answers each round with ``Pushed``."""
        assert self._rounds is not None
        load.started = load.started or self._clock()
        src.plan = peer.plan  # what prefill writes by, and landing rewrites by
        try:
            self._rounds.ask(load, src, peer, rewrites)
        except KVBridgeError as exc:
            self._finish_failed(load, str(exc))
            return
        load.timeline.posted = load.timeline.posted or self._clock()

    def _next_round(self, load: Load, src: Source) -> None:
        assert self._rounds is not None
        try:
            self._rounds.next_round(load, src, self._ready_peer(src))
        except KVBridgeError as exc:
            self._finish_failed(load, str(exc))

    def _ready_peer(self, src: Source) -> Peer | None:
        """The source's peer, connected (READY, or REFUSED: over the quarantine cap it
        starts no new load, but the loads already under way from it go on)."""
        peer = self._peers.get(src.key)
        ready = peer is not None and peer.state in (PeerState.READY, PeerState.REFUSED)
        return peer if ready else None

    def _post(self, load: Load, src: Source) -> None:
        peer = self._ready_peer(src)
        if peer is None or peer.plan is None:
            self._finish_failed(load, f"peer {src.key} went away before the read")
            return
        src.state = LoadState.READING
        src.plan = peer.plan  # landing rewrites by it, whatever becomes of the peer
        load.started = load.started or self._clock()
        load.timeline.posted = load.timeline.posted or load.started
        try:
            self._reads.post(load, src, peer)
        except KVBridgeError as exc:
            self._finish_failed(load, f"could not post the read: {exc}")

    def _poll_reads(self, load: Load, src: Source) -> None:
        try:
            done = self._reads.poll(load, src, self._ready_peer(src))
        except PeerDisconnectedError as exc:  # the peer is gone: every load from it fails
            self._finish_failed(load, f"read from {src.key} failed: {exc}")
            self._peers.drop(src.key, f"transfer failed: {exc}")
            return
        except TransferError as exc:  # this transfer failed: this load only
            self._finish_failed(load, f"read from {src.key} failed: {exc}")
            return
        except KVBridgeError as exc:  # staging or splitting: this load only
            self._finish_failed(load, f"could not stage the remote pages: {exc}")
            return
        if done:
            src.reads_done = self._clock()  # before our copies: the hold counts to here
            if src.landing is not None and self._packed is not None:
                try:
                    self._packed.land(load, src)
                except (KVBridgeError, RuntimeError) as exc:  # RuntimeError: torch
                    self._finish_failed(load, f"could not place the packed rows: {exc}")
                    return
            self._release_source(load, src)
            self._fail(load, self._claims.reads_ended(src))

    def _complete(self, load: Load) -> None:
        """Every source's transfers ended: finish the blocks (landing) by the plans the
        sources were posted with, report; a load landing cannot finish fails."""
        # verified before any rewrite of ours touches the landed bytes (a source without
        # a plan is landing's to refuse, below)
        if load.verify and all(src.plan is not None for src in load.sources):
            assert self._verifier is not None
            mismatch = self._verifier.check(load)
            if mismatch:
                self._finish_failed(load, mismatch)
                return
        try:
            mark = self._landing.finish(load)
        except KVBridgeError as exc:
            self._finish_failed(load, f"could not land the load: {exc}")
            return
        self._notify_done(load, ok=True)  # our kernels write our blocks only: prefill may free
        self._forget(load)
        self._landed.append((load, mark))
        self._report_landed()

    def _report_landed(self) -> None:
        """Report the landed loads whose kernels finished (no mark, or a completed one;
        no wait on the host: an incomplete mark is looked at again by the next call). A
        load's figures count up to here, the device's time included."""
        waiting: list[tuple[Load, Mark | None]] = []
        for load, mark in self._landed:
            if mark is not None and not mark.done():
                waiting.append((load, mark))
                continue
            now = self._clock()
            self._metrics.transfers += 1
            self._metrics.bytes_read += load.num_bytes
            self._metrics.transfer_seconds += now - load.started
            load.timeline.record(load.spec.request_id, now, self._metrics)
            self._done.add(load.spec.request_id)
        self._landed = waiting

    def _release_source(self, load: Load, src: Source) -> None:
        """A source whose transfers ended: handles and its staging round go back."""
        for h in src.handles:
            self._engine.release(h)
        src.handles.clear()
        if src.batch is not None:
            self._staged.cancel(src.batch)
            src.batch = None
        src.staged.clear()

    def _notify_done(self, load: Load, *, ok: bool) -> None:
        rid = load.spec.params.remote_request_id
        for key, readers in load.route.notify:
            peer = self._peers.get(key)
            if peer is not None and peer.state is PeerState.FAILED:
                continue  # unreachable: it frees by lease (a new handshake would not help)
            msg = Done(
                request_id=rid,
                ok=ok,
                readers=readers,
                reader_rank=self._router.engine_rank,
                claims=self._claims_of(load, key),
            )
            self._notify(key, load.route.endpoints[key], msg)

    def _claims_of(self, load: Load, key: PeerKey) -> list[int]:
        """The claims our Done to prefill rank ``key`` ends: the numbers of the claims
        this load sent it (push: 0, the claim prefill made for our Push); none for a rank
        we only notify."""
        src = load.source(key)
        if src is None:
            return []
        return [0] if self._rounds is not None else list(src.claim_ids)

    def _notify_now(self, key: PeerKey, endpoint: tuple[str, int], msg: object) -> None:
        peer = self._peers.get(key)
        if peer is not None and peer.state in (PeerState.READY, PeerState.REFUSED):
            self._send(peer, msg)  # a refused peer still hears Done: it frees, or stops

    def _finish_failed(
        self, load: Load, reason: str, *, notify: bool = True, early: bool = True
    ) -> None:
        """Fail ``load``. Releasing a handle does not stop a READ in flight, nor can we
        stop prefill's WRITEs of a Push round it has not answered; so the READs, staging
        rounds and unanswered push rounds go to the quarantine, and the engine hears of
        the failure only when none of them can still land. Prefill gets ``Done(ok=False)``
        then too (pull: it keeps the blocks until our READs ended), or at once when a push
        round is unanswered (it stops writing, answers once its WRITEs ended). With
        ``fail_early`` (and ``early``: not the engine's own abort) the engine also hears at
        once that the load is failing, so it can end the request while it keeps the
        blocks."""
        handles: dict[PeerKey, list[XferHandle]] = {}
        batches: list[StageBatch] = []
        rounds: set[Round] = set()
        rid = load.spec.params.remote_request_id
        for src in load.sources:
            if src.state is LoadState.PUSHED and src.round_agent not in self._writers.gone | {""}:
                rounds.add((src.round_agent, rid, src.round))
            landing = self._packed.held(src) if self._packed is not None else None
            if landing is not None:  # its READ may still land: held with its pages
                src.handles = [h for h in src.handles if h not in landing.handles]
                batches.append(landing)
            handles[src.key] = list(src.handles)
            src.handles.clear()
            if src.batch is not None:
                batches.append(src.batch)
                src.batch = None
            src.staged.clear()
        self._forget(load)
        self._metrics.transfer_failures += 1
        logger.warning("load %s failed: %s", load.spec.request_id, reason)
        told = notify and bool(rounds)
        if told:
            self._notify_done(load, ok=False)  # the cancel: prefill stops, then answers

        def end() -> None:
            if notify and not told:
                self._notify_done(load, ok=False)
            self._failed.append(failure(load.spec, reason))

        held = self._quarantine.hold(load.spec.request_id, rid, handles, batches, end, rounds)
        if held and early and self._fail_early:
            self._failing.append(failure(load.spec, reason))

    def _fail(self, load: Load, reason: str) -> None:
        """Fail ``load`` when there is a ``reason`` (a step that may fail it said why)."""
        if reason:
            self._finish_failed(load, reason)

    def _forget(self, load: Load) -> None:
        for src in load.sources:
            self._claims.settle(src, ended=True)
        self._loads.pop(load.spec.request_id, None)
        self._by_remote.pop(load.spec.params.remote_request_id, None)

    def close(self) -> None:
        for load in list(self._loads.values()):
            self._finish_failed(load, "connector shut down")
        self._quarantine.close()
        self._staged.close()
        if self._packed is not None:
            self._packed.close()
