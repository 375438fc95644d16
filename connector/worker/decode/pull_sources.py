"""A pull source's life on decode: its claim, its READs, and the hold they must end within.

::

    start     lease a packed landing (extra.gather_mib) -> the first claim (Prepare)
              no rewrite due, not packed         -> the READs go out with the claim
              else                               -> PREPARING: read once prefill answered
    answered  Prepared: not ok / untrusted -> the load fails; PREPARING -> post the READs
    advance   each step: poll the READs (posted ones at once), refresh the claim while
              they run, send it again when its answer is overdue
    ended     READs done -> the packed rows into place, handles and staging slots back;
              done once prefill answered and the READs ended within the promised hold
              (``claims``)

Failures go through :class:`~kvbridge.connector.worker.decode.outcomes.Outcomes`: a
peer that disconnected is dropped (every load from it fails), anything else fails this
load only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvbridge.connector.common.notifications import GroupRewrite, Prepared
from kvbridge.connector.transfer.errors import PeerDisconnectedError, TransferError
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.decode.claims import Claims
from kvbridge.connector.worker.decode.inflight import Load, LoadState, Source
from kvbridge.connector.worker.decode.outcomes import Outcomes
from kvbridge.connector.worker.decode.packed_reads import PackedReads
from kvbridge.connector.worker.decode.transfers import PullReads
from kvbridge.connector.worker.peers import Peer, PeerDirectory, PeerKey, PeerState
from kvbridge.connector.worker.staging.staged_reads import StagedReads
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)


def ready_peer(peers: PeerDirectory, key: PeerKey) -> Peer | None:
    """The peer at ``key``, connected (READY, or REFUSED: over the quarantine cap it
    starts no new load, but the loads already under way from it go on)."""
    peer = peers.get(key)
    ready = peer is not None and peer.state in (PeerState.READY, PeerState.REFUSED)
    return peer if ready else None


def bound_peer(peers: PeerDirectory, src: Source) -> Peer | None:
    """``ready_peer`` of ``src``'s own incarnation: None also when the peer at its key is
    now another process (restarted under the same engine id and address)."""
    peer = ready_peer(peers, src.key)
    if peer is None or (src.agent and peer.agent != src.agent):
        return None
    return peer


def restarted(peers: PeerDirectory, src: Source) -> str:
    """Why ``src`` can no longer count on what its peer granted ('' when it can): the
    peer at its key is another NIXL agent than the one it claimed from or asked."""
    peer = peers.get(src.key)
    if not src.agent or peer is None or not peer.agent or peer.agent == src.agent:
        return ""
    return (
        f"prefill {src.key} restarted since this load began (agent {src.agent}, now "
        f"{peer.agent}): nothing the old process granted counts"
    )


class PullSources:
    """Claims and READs of the pull sources of one receiver's loads."""

    def __init__(
        self,
        engine: TransferEngine,
        peers: PeerDirectory,
        reads: PullReads,
        staged: StagedReads,
        claims: Claims,
        outcomes: Outcomes,
        live: Callable[[Load], bool],
        *,
        packed: PackedReads | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``live(load)``: the load is still in flight (a failure ends it)."""
        self._engine = engine
        self._peers = peers
        self._reads = reads
        self._staged = staged
        self._claims = claims
        self._outcomes = outcomes
        self._live = live
        self._packed = packed
        self._clock = clock

    def start(self, load: Load, src: Source, peer: Peer, rewrites: list[GroupRewrite]) -> None:
        """The peer is ready: claim, and read now or once prefill answered."""
        src.rewrites = rewrites
        try:
            packs = self._packed is not None and self._packed.lease(load, src, peer)
        except KVBridgeError as exc:  # rows the params cannot name: this load only
            self._outcomes.fail(load, f"could not plan the read: {exc}")
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

    def answered(self, load: Load, src: Source, msg: Prepared) -> None:
        """Prefill answered ``src``'s claim: post the READs (PREPARING), or extend what we
        know of the hold under READs already posted."""
        if src.state is LoadState.PREPARING:  # where a packed read's rows lie (-1: none)
            src.packed_at, src.packed_bytes = msg.packed_at, msg.packed_bytes
        if not msg.ok:
            self._claims.settle(src, ended=False, answered=msg.claim)
            self._outcomes.fail(load, f"prefill could not prepare the blocks: {msg.reason}")
            return
        untrusted = self._claims.answered(src, msg)
        if untrusted:
            self._outcomes.fail(load, untrusted)
            return
        if src.state is LoadState.PREPARING:
            self._post(load, src)
        elif src.reads_done:
            self._fail(load, self._claims.reads_ended(src))

    def advance(self, load: Load, src: Source, now: float) -> None:
        """One step of a source in flight: poll its READs, keep its claim alive."""
        # reads just posted are polled at once: CPU-to-CPU reads (UCX over cma) complete
        # inside the post, and waiting for the engine's next step cost a whole step
        # (bench_e2e: ~2 ms of a 2.3 ms load)
        if src.state is LoadState.READING and self._live(load):
            if not src.reads_done:
                self._poll_reads(load, src)
            if self._live(load) and not src.reads_done:
                peer = bound_peer(self._peers, src)
                self._fail(load, self._claims.refresh(load, src, peer, now))
        if (
            self._live(load)
            and now <= load.deadline
            and src.state in (LoadState.PREPARING, LoadState.READING)
        ):
            peer = bound_peer(self._peers, src)
            if self._claims.resend_due(src, now, Claims.numbered(peer)):
                self._fail(load, self._claims.again(load, src, peer, now))

    def _first_claim(self, load: Load, src: Source, peer: Peer) -> bool:
        """The claim before any READ; False: the load failed, or waits for the peer."""
        src.agent = peer.agent  # the incarnation this source's claim and READs belong to
        if self._claims.send(load, src, peer):
            return True
        if src.handshaken_again:
            self._outcomes.fail(load, f"prefill {peer.key} unreachable for a claim (Prepare)")
            return False
        if ready_peer(self._peers, src.key) is not None:  # a local failure: the peer was kept
            self._outcomes.fail(load, f"the claim (Prepare) to prefill {peer.key} failed to send")
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

    def _post(self, load: Load, src: Source) -> None:
        peer = bound_peer(self._peers, src)
        if peer is None or peer.plan is None:
            self._outcomes.fail(load, f"peer {src.key} went away before the read")
            return
        src.state = LoadState.READING
        src.plan = peer.plan  # landing rewrites by it, whatever becomes of the peer
        load.started = load.started or self._clock()
        load.timeline.posted = load.timeline.posted or load.started
        try:
            self._reads.post(load, src, peer)
        except KVBridgeError as exc:
            self._outcomes.fail(load, f"could not post the read: {exc}")

    def _poll_reads(self, load: Load, src: Source) -> None:
        try:
            done = self._reads.poll(load, src, bound_peer(self._peers, src))
        except PeerDisconnectedError as exc:  # the peer is gone: every load from it fails
            self._outcomes.fail(load, f"read from {src.key} failed: {exc}")
            self._peers.drop(src.key, f"transfer failed: {exc}")
            return
        except TransferError as exc:  # this transfer failed: this load only
            self._outcomes.fail(load, f"read from {src.key} failed: {exc}")
            return
        except KVBridgeError as exc:  # staging or splitting: this load only
            self._outcomes.fail(load, f"could not stage the remote pages: {exc}")
            return
        if done:
            src.reads_done = self._clock()  # before our copies: the hold counts to here
            if src.landing is not None and self._packed is not None:
                try:
                    self._packed.land(load, src)
                except (KVBridgeError, RuntimeError) as exc:  # RuntimeError: torch
                    self._outcomes.fail(load, f"could not place the packed rows: {exc}")
                    return
            self._release(src)
            self._fail(load, self._claims.reads_ended(src))

    def _release(self, src: Source) -> None:
        """A source whose transfers ended: handles and its staging round go back."""
        for h in src.handles:
            self._engine.release(h)
        src.handles.clear()
        if src.batch is not None:
            self._staged.cancel(src.batch)
            src.batch = None
        src.staged.clear()

    def _fail(self, load: Load, reason: str) -> None:
        """Fail ``load`` when there is a ``reason`` (a step that may fail it said why)."""
        if reason:
            self._outcomes.fail(load, reason)
