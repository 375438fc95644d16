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
is done only once the answer came and the READs ended within the hold prefill promised
(``kvbridge.connector.worker.decode.pull_sources``). How a load ends, landed or failed
and held until nothing of it can land, is ``kvbridge.connector.worker.decode.outcomes``:
what the receiver's own kernels wrote (rewrites, merges, the host mirror copied in) is
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
    NOT_RUNNING,
    GroupRewrite,
    Prepared,
    Pushed,
    WireArrangement,
)
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.boundary import Boundary
from kvbridge.connector.worker.decode.claims import Claims, Writers
from kvbridge.connector.worker.decode.inflight import (
    Load,
    LoadState,
    LoadTimeline,
    PushEndpoint,
    Source,
    describe_source,
    outside,
)
from kvbridge.connector.worker.decode.landing import Landing, Verifier
from kvbridge.connector.worker.decode.outcomes import Notify, Outcomes
from kvbridge.connector.worker.decode.packed_reads import PackedReads
from kvbridge.connector.worker.decode.pull_sources import PullSources, bound_peer, restarted
from kvbridge.connector.worker.decode.quarantine import Quarantine
from kvbridge.connector.worker.decode.transfers import PullReads, PushRounds
from kvbridge.connector.worker.device_order import DeviceOrder
from kvbridge.connector.worker.digests import version_refusal
from kvbridge.connector.worker.peers import Peer, PeerDirectory, PeerKey, PeerState
from kvbridge.connector.worker.routing import Router
from kvbridge.connector.worker.staging.arenas import StagingPools
from kvbridge.connector.worker.staging.host_stage import HostStage
from kvbridge.connector.worker.staging.staged_reads import Repacker, StagedReads
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)


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
        boundary: Boundary | None = None,
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
        moves many small rows as one packed range (``extra.gather_mib``, pull and push).
        ``boundary``: each load's step is its own failure boundary (what it raises fails
        that load alone)."""
        self._boundary = boundary or Boundary(metrics)
        staging = staging or StagingPools(engine, DEFAULT_STAGING_MIB << 20, buffers.device)
        order = order or DeviceOrder(buffers.device)
        self._staged = StagedReads(engine, staging, buffers, metrics, repacker, order)
        self._packed = packed
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
        writers = Writers(peers, send, self._quarantine)
        self._writers = writers
        self._metrics = metrics
        self._send = send
        self._router = router or Router(0, 1, 1)
        self._timeout_s = timeout_s
        self._clock = clock
        self._claims = Claims(send, metrics, clock, rank=self._router.engine_rank)
        self._verifier = verifier
        self._outcomes = Outcomes(
            metrics,
            peers,
            notify or self._notify_now,
            self._quarantine,
            writers,
            Landing(buffers, metrics, order, stage=stage, repacker=repacker),
            self._forget,
            router=self._router,
            pushed=push is not None,
            verifier=verifier,
            packed=packed,
            fail_early=fail_early,
            clock=clock,
        )
        self._pull = PullSources(
            engine,
            peers,
            PullReads(engine, peers, buffers, self._staged, metrics, packed),
            self._staged,
            self._claims,
            self._outcomes,
            lambda load: load.spec.request_id in self._loads,
            packed=packed,
            clock=clock,
        )
        self._loads: dict[str, Load] = {}
        self._by_remote: dict[str, str] = {}  # remote request id -> local request id

    @property
    def num_inflight(self) -> int:
        """Loads in flight (landed ones included until reported), and failed loads whose
        READs may still run (held back)."""
        return len(self._loads) + self._outcomes.num_landed + self._quarantine.num_held

    @property
    def num_active(self) -> int:
        """Loads in flight or landed and not yet reported (quarantined ones left out)."""
        return len(self._loads) + self._outcomes.num_landed

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
            self._outcomes.refused(
                spec, f"prefill request {p.remote_request_id!r} is already loading here"
            )
            return
        try:
            route = self._router.route(p)
        except KVBridgeError as exc:
            self._outcomes.refused(spec, f"no route to the prefill ranks: {exc}")
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

    def refuse(self, spec: LoadSpec, reason: str) -> None:
        """Adding the load raised (the boundary logged why): it fails, held while any
        transfer of it may run, or at once when it never got into the table."""
        load = self._loads.get(spec.request_id)
        if load is not None and load.spec is spec:
            self._outcomes.fail(load, reason)
        elif load is None:
            if self._by_remote.get(spec.params.remote_request_id) == spec.request_id:
                del self._by_remote[spec.params.remote_request_id]
            self._outcomes.refused(spec, reason)

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
        self._outcomes.fail(load, "aborted by the engine", early=False)
        return True

    def _awaiting(self, request_id: str, agent: str, push_round: int) -> tuple[Load, Source] | None:
        """The load and source waiting (PUSHED) for ``agent``'s answer to ``push_round`` of
        the remote request (None: nobody waits for it)."""
        rid = self._by_remote.get(request_id)
        load = self._loads.get(rid) if rid else None
        for src in load.sources if load is not None else ():
            if src.state is LoadState.PUSHED and src.round == push_round:
                if not agent or src.round_agent == agent:
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
        self._pull.answered(load, src, msg)

    def _claimant(self, msg: Prepared, agent: str) -> tuple[Load, Source] | None:
        """The load and source with a claim in flight that ``msg`` (from ``agent``)
        answers; None: no claim in flight is this one."""
        rid = self._by_remote.get(msg.request_id)
        load = self._loads.get(rid) if rid else None
        for src in load.sources if load is not None else ():
            if src.state not in (LoadState.PREPARING, LoadState.READING):
                continue
            if Claims.answers(src, msg) and (not agent or src.agent == agent):
                return load, src
        return None

    def fail_remote(self, remote_request_id: str, agent: str, reason: str) -> None:
        """A message about prefill's request ``remote_request_id`` from ``agent`` could
        not be handled: the load it belongs to fails (held while transfers of it run)."""
        rid = self._by_remote.get(remote_request_id)
        load = self._loads.get(rid) if rid else None
        if load is not None and any(
            not agent or s.agent == agent or s.round_agent == agent for s in load.sources
        ):
            self._outcomes.fail(load, reason)

    def on_pushed(self, msg: Pushed, agent: str = "") -> None:
        """Prefill wrote a round of a load into our blocks and slots (or says why not)."""
        found = self._awaiting(msg.request_id, agent, msg.round)
        if found is None:
            if not self._quarantine.answered((agent, msg.request_id, msg.round)):
                # a reply to a PushStatus asked while the round's own answer was on its way
                # (a frozen prefill answers both once it runs again): expected, not bad
                if msg.ok or not msg.reason.endswith(NOT_RUNNING):
                    self._metrics.bad_notifications += 1
            return
        assert self._rounds is not None  # PUSHED sources exist in push mode only
        load, src = found
        rounds = self._rounds

        def answer() -> None:
            try:
                rounds.answered(load, src, msg, bound_peer(self._peers, src))
            except KVBridgeError as exc:  # refused, or not the round sent: this load
                self._outcomes.fail(load, str(exc))

        # anything else it raises (torch, our copies): the boundary fails the load
        self._boundary.run("push answer", answer, lambda reason: self._fail_live(load, reason))

    def step(self) -> None:
        """Advance every load: peers that became ready, reads that completed, deadlines."""
        if self._packed is not None:
            self._packed.drain()  # landings whose scatter finished go back
        for load in [ld for ld in self._loads.values() if self._writers.writer_gone(ld)]:
            self._outcomes.fail(load, "the prefill writing this load was found gone")
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
                self._outcomes.fail(load, peer.reason)
        now = self._clock()
        for load in list(self._loads.values()):
            self._boundary.run(
                "load step",
                lambda ld=load: self._advance(ld, now),  # type: ignore[misc]
                lambda reason, ld=load: self._fail_live(ld, reason),  # type: ignore[misc]
            )
        self._quarantine.step()
        self._writers.probe(self._loads.values(), now)
        self._outcomes.report_landed()

    def _advance(self, load: Load, now: float) -> None:
        for src in load.sources:
            if src.state not in (LoadState.WAITING_PEER, LoadState.DONE):
                why = restarted(self._peers, src)
                if why:
                    self._outcomes.fail(load, why)
                    return
        for src in load.sources:
            if load.spec.request_id not in self._loads:
                return
            if src.state is LoadState.WAITING_PEER:
                peer = self._peers.get(src.key)
                if peer is not None and peer.state is PeerState.READY:
                    self._start(load, src, peer)
            elif src.state is LoadState.STAGING:  # push: slots may be free now
                self._next_round(load, src)
            self._pull.advance(load, src, now)  # pull: READs polled, claims kept alive
        if load.spec.request_id not in self._loads:
            return
        if all(s.state is LoadState.DONE for s in load.sources):
            load.timeline.arrived = load.timeline.arrived or self._clock()
            self._outcomes.complete(load)
        elif now > load.deadline:
            states = ", ".join(f"{s.key}: {describe_source(s, now)}" for s in load.sources)
            self._outcomes.fail(
                load, f"load timed out: not complete within {self._timeout_s:.1f} s ({states})"
            )

    def _fail_live(self, load: Load, reason: str) -> None:
        """A load whose step raised fails (held while its transfers may run), unless it
        already ended."""
        if self._loads.get(load.spec.request_id) is load:
            self._outcomes.fail(load, reason)

    def take_results(self) -> tuple[set[str], list[LoadFailure], list[LoadFailure]]:
        """Loads (done, failed, failing) since the last call (``Outcomes.take``)."""
        return self._outcomes.take()

    # -- internals ----------------------------------------------------------------------

    def _start(self, load: Load, src: Source, peer: Peer) -> None:
        assert peer.plan is not None
        load.timeline.started = load.timeline.started or self._clock()
        bad = outside(load.spec.params, peer)
        if bad:
            # params no prefill issued (unsigned deployments): never read, never Prepare,
            # and no Done either: the request id in them may be another request's
            self._outcomes.fail(load, bad, notify=False)
            return
        if load.verify and peer.layout is not None:  # digests of two definitions differ
            refused = version_refusal(
                peer.layout.digest_version, f"prefill {peer.key[0]} rank {peer.key[1]}"
            )
            if refused:
                self._outcomes.fail(load, f"verify: {refused}")
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
        self._pull.start(load, src, peer, rewrites)

    def _ask_push(self, load: Load, src: Source, peer: Peer, rewrites: list[GroupRewrite]) -> None:
        """Push mode: name our blocks (and slots, round by round) to prefill; it writes
        and answers each round with ``Pushed``."""
        assert self._rounds is not None
        load.started = load.started or self._clock()
        src.plan = peer.plan  # what prefill writes by, and landing rewrites by
        src.agent = peer.agent  # ... and the incarnation that owes every round
        try:
            self._rounds.ask(load, src, peer, rewrites)
        except KVBridgeError as exc:
            self._outcomes.fail(load, str(exc))
            return
        load.timeline.posted = load.timeline.posted or self._clock()

    def _next_round(self, load: Load, src: Source) -> None:
        assert self._rounds is not None
        try:
            self._rounds.next_round(load, src, bound_peer(self._peers, src))
        except KVBridgeError as exc:
            self._outcomes.fail(load, str(exc))

    def _notify_now(self, key: PeerKey, endpoint: tuple[str, int], msg: object) -> None:
        peer = self._peers.get(key)
        if peer is not None and peer.state in (PeerState.READY, PeerState.REFUSED):
            self._send(peer, msg)  # a refused peer still hears Done: it frees, or stops

    def _forget(self, load: Load) -> None:
        for src in load.sources:
            self._claims.settle(src, ended=True)
        self._loads.pop(load.spec.request_id, None)
        self._by_remote.pop(load.spec.params.remote_request_id, None)

    def close(self) -> None:
        for load in list(self._loads.values()):
            self._outcomes.fail(load, "connector shut down")
        self._quarantine.close()
        self._staged.close()
        if self._packed is not None:
            self._packed.close()
