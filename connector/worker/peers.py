"""Remote peers of a worker: handshakes and set-up in the background, plans and lists.

Nothing here that can wait on a peer runs on the engine's step: the handshake (a ZMQ
round trip) runs on a handshake thread, and everything that touches NIXL for a new peer
(adding its agent, preparing its descriptor lists, starting its connection) on the
worker's set-up thread (:mod:`kvbridge.connector.worker.peer_setup`), with the agent gate
held; :meth:`PeerDirectory.poll`, on the step, only applies what came back::

    ensure(key) --(handshake thread)--> HandshakeClient.get
                --(set-up thread)-----> negotiate, add agent, prep remote lists, connect
                --> queue --> poll() (step): Peer READY / INCOMPATIBLE / FAILED

:meth:`PeerDirectory.warm` does the same before any request names the peer (from
``extra.warm_peers``: listener addresses known at startup), so the first request to that
peer pays none of it. Every peer that becomes READY has its NIXL connection started
already (``make_connection``), not on its first transfer.

An INCOMPATIBLE peer answered but cannot be read from (its formats cannot be bridged):
its agent is kept for notifications only, so loads against it fail at once *and* tell it
to free the request's blocks (``Done(ok=False)``) instead of leaving them to the lease.
The next load to it handshakes again (the peer may have been reconfigured).

A peer is dropped (:meth:`PeerDirectory.drop`) when it died or restarted; its lists and
agent go on the set-up thread. Only a peer the transport confirmed gone
(``TransferEngine.peer_gone``: NIXL reported it disconnected) ends what waited for it
(``on_drop``). A peer that is merely unreachable keeps whatever of ours it may still
write. A peer may also be REFUSED by an admission check (decode's quarantine holds too
many of our blocks for it, ``decode.quarantine``): it keeps its agent (notifications still
go out) but no new load starts from it; the next ``poll`` after a load asks for it
(``ensure(for_read=True)``) returns it, so the load fails by name at once, and it is READY
again once the check admits it.

Each peer's state as an operator sees it (by address: ready, connecting, incompatible,
bad_secret, unreachable, ...) and failed handshakes by reason are in :attr:`PeerDirectory.book`
(:mod:`kvbridge.connector.worker.peer_health`), which logs a peer's first failure of a
kind at ERROR with the fix.
"""

from __future__ import annotations

import enum
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.connector.transfer.transport import DescList, TransferEngine
from kvbridge.connector.worker.peer_health import PeerBook, PeerHealth, classify
from kvbridge.connector.worker.peer_setup import PeerSetup
from kvbridge.connector.worker.plan_lists import PlanLists
from kvbridge.connector.worker.read_probe import ReadProbe
from kvbridge.handshake.client import HandshakeClient
from kvbridge.handshake.compat import check_compatible
from kvbridge.handshake.description import PeerLayout, parse_description
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.handshake.plan import negotiate
from kvbridge.handshake.plan_model import GroupPlan, PieceStream, TransferPlan
from kvbridge.handshake.tp_plan import reads_from
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)

PeerKey = tuple[str, int]  # (engine id, rank)


class PeerState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    INCOMPATIBLE = "incompatible"  # reachable, notifications only; reason says why
    REFUSED = "refused"  # ready, but no new load from it (an admission check; reason)
    FAILED = "failed"


@dataclass
class Peer:
    key: PeerKey
    host: str
    port: int
    state: PeerState = PeerState.CONNECTING
    reason: str = ""
    agent: str = ""
    description: WorkerDescription | None = None
    layout: PeerLayout | None = None
    plan: TransferPlan | None = None
    remote_lists: dict[tuple[int, int], DescList] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """Its listener's ``host:port`` (how :class:`PeerBook` names it)."""
        return f"{self.host}:{self.port}"


@dataclass
class _Prepared:
    """What the set-up thread made of a peer's description; :meth:`PeerDirectory.poll`
    applies it to the peer (or gives it back, when nobody waits for it any more)."""

    desc: WorkerDescription
    agent: str
    layout: PeerLayout | None = None
    plan: TransferPlan | None = None
    lists: dict[tuple[int, int], DescList] = field(default_factory=dict)
    incompatible: str = ""  # why it cannot be read from ('' : it can, or notifications only)


class PeerDirectory:
    """Peers by (engine id, rank); owns their remote descriptor lists."""

    def __init__(
        self,
        engine: TransferEngine,
        setup: PeerSetup,
        client: HandshakeClient,
        local_description: WorkerDescription,
        local_layout: PeerLayout,
        *,
        can_repack: bool = False,
        writer: bool = False,
        probe: ReadProbe | None = None,
    ) -> None:
        """``writer``: the peers are decode workers this (prefill) worker pushes to; a
        peer's plan is then the one that decode computes (decode's blocks are the plan's
        local side), and the lists are swapped: remote lists on decode's blocks (on its
        staging slots for the groups it stages), local ones on this worker's. ``probe``:
        READ each new peer once its set-up is through (a reader's, ``extra.read_probe``)."""
        self._engine = engine
        self._setup = setup
        self._can_repack = can_repack
        self._writer = writer
        self._probe = None if writer else probe
        self._client = client
        self._local_description = local_description
        self._local = local_layout
        self._peers: dict[PeerKey, Peer] = {}
        self._results: queue.SimpleQueue[tuple[Peer, _Prepared | KVBridgeError]] = (
            queue.SimpleQueue()
        )
        self._warmed: queue.SimpleQueue[tuple[str, int, _Prepared | KVBridgeError]] = (
            queue.SimpleQueue()
        )
        self._lists = PlanLists(engine, local_layout, writer=writer)
        self.handshakes = 0
        self.failures = 0
        self.book = PeerBook()  # each peer's state by address; failures by reason
        # called with a peer's agent once it is removed and the transport confirmed it
        # gone (transfers posted to it ended, notifications it owed never come)
        self.on_drop: list[Callable[[str], None]] = []
        # admission checks: check(agent) is '' or why no new load may start from it
        self.admission: list[Callable[[str], str]] = []
        self._surfaced: set[PeerKey] = set()  # REFUSED peers a load asked for since poll

    @property
    def num_connecting(self) -> int:
        """Handshakes in flight (their answers are applied by the next ``poll``)."""
        return sum(p.state is PeerState.CONNECTING for p in self._peers.values())

    def with_agent(self, agent: str) -> Peer | None:
        """The peer whose NIXL agent is ``agent`` (None: none has it now)."""
        return next((p for p in self._peers.values() if agent and p.agent == agent), None)

    def get(self, key: PeerKey) -> Peer | None:
        return self._peers.get(key)

    def ensure(self, key: PeerKey, host: str, port: int, *, for_read: bool = False) -> Peer:
        """The peer, starting its handshake in the background if it is new or failed (or,
        ``for_read``, incompatible last time: it may have been reconfigured since)."""
        peer = self._peers.get(key)
        if peer is not None and for_read and peer.state is PeerState.INCOMPATIBLE:
            self.drop(key, "handshaking again")
            peer = None
        if peer is not None and for_read and peer.state is PeerState.REFUSED:
            self._surfaced.add(key)  # the next poll returns it: the load fails by name
        if peer is not None and peer.state is not PeerState.FAILED:
            return peer
        peer = Peer(key=key, host=host, port=port)
        self._peers[key] = peer
        self.book.set(peer.address, PeerHealth.CONNECTING)
        self._setup.handshake(lambda: self._fetch(peer))
        return peer

    def warm(self, host: str, port: int) -> None:
        """Handshake with the listener at host:port in the background; :meth:`poll` then
        adds the peer it describes, READY with its lists and NIXL connection, unless a
        request already named it. A failure is logged: requests handshake as usual."""
        self._setup.handshake(lambda: self._fetch_warm(host, port))

    # -- on the handshake and set-up threads ------------------------------------------------

    def _fetch(self, peer: Peer) -> None:
        """Handshake thread: ask for the description, then set the peer up."""
        where = f"{peer.host}:{peer.port}"
        try:
            self._client.forget(*peer.key)
            desc = self._client.get(peer.key[0], peer.key[1], peer.host, peer.port)
        except Exception as exc:  # delivered to the step, which fails the loads
            self._results.put((peer, _failure(f"handshake with {where} failed: {exc}", exc)))
            return
        self._setup.nixl(lambda: self._results.put((peer, self._prepare(desc, where))))

    def _fetch_warm(self, host: str, port: int) -> None:
        try:
            desc = self._client.fetch(host, port)
        except Exception as exc:
            self._warmed.put((host, port, _failure(str(exc), exc)))
            return
        self._setup.nixl(lambda: self._warmed.put((host, port, self._prepare(desc, host))))

    def _prepare(self, desc: WorkerDescription, where: str) -> _Prepared | KVBridgeError:
        """Set-up thread, gate held: negotiate, add the agent, prepare the peer's lists
        and start the connection."""
        try:
            try:
                check_compatible(self._local_description, desc, peer=where)
                layout = parse_description(desc)
                reader, source = (layout, self._local) if self._writer else (self._local, layout)
                if not reads_from(reader, source):
                    # a prefill rank this decode rank only tells Done (an unread replica)
                    return _Prepared(desc, self._setup.load_agent(desc.nixl_metadata), layout)
                can_repack = layout.can_repack if self._writer else self._can_repack
                plan = negotiate(reader, source, can_repack=can_repack)
            except IncompatiblePeerError as exc:
                agent = self._setup.load_agent(desc.nixl_metadata)
                return _Prepared(desc, agent, incompatible=str(exc))
            prepared = _Prepared(desc, self._setup.load_agent(desc.nixl_metadata), layout, plan)
            try:
                first = self._lists.remote(prepared.agent, layout, plan, prepared.lists)
            except KVBridgeError:
                self._release(list(prepared.lists.values()), prepared.agent)
                raise
            self._wire_up(prepared.agent, desc)
            if self._probe is not None and first is not None:  # after this set-up: the
                # peer is ready meanwhile, and set-ups asked for before it are not held up
                probe, agent, name = self._probe, prepared.agent, f"{desc.engine_id} at {where}"
                self._setup.nixl(lambda: probe.probe(agent, first, where=name))
            return prepared
        except KVBridgeError as exc:
            return exc
        except Exception as exc:  # a bug: the peer fails by name instead of waiting forever
            logger.exception("setting up peer %s failed", where)
            return KVBridgeError(f"setting up the peer at {where} failed: {exc!r}")

    def _wire_up(self, agent: str, desc: WorkerDescription) -> None:
        """Start UCX's connection to the peer now (NIXL's ``make_connection`` returns at
        once): a first transfer on an unconnected endpoint stays pending until the
        *peer's* UCX worker answers the wire-up, and an engine whose threads are busy may
        answer late (docs/handover.md). The peer's listener does the same towards us."""
        try:
            self._engine.connect(agent)
        except KVBridgeError as exc:  # the first transfer connects instead
            logger.warning(
                "NIXL connection to %s rank %d not set up early: %s", desc.engine_id, desc.rank, exc
            )

    def _release(self, lists: list[DescList], agent: str) -> None:
        """Set-up thread, gate held: release a peer's lists and let go of its agent."""
        for dl in lists:
            dl.release()
        if agent:
            try:
                self._setup.unload_agent(agent)
            except KVBridgeError as exc:
                logger.warning("removing peer %s: %s", agent, exc)

    def _give_back(self, prepared: _Prepared) -> None:
        """A set-up nobody waits for any more (the peer was dropped, or a request got
        there before a warm-up): undone on the set-up thread."""
        lists = list(prepared.lists.values())
        self._setup.nixl(lambda: self._release(lists, prepared.agent), teardown=True)

    # -- on the step -----------------------------------------------------------------------

    def gone(self, agent: str) -> bool:
        """The transport confirmed ``agent`` gone (its process died, or the connection
        failed): nothing posted to it can still land."""
        return bool(agent) and self._engine.peer_gone(agent)

    def poll(self) -> list[Peer]:
        """Apply the set-ups that came back and the admission checks; returns peers whose
        state changed (and REFUSED peers a load asked for since the last poll). Never
        waits: what is not back yet stays CONNECTING."""
        changed = self._poll_warmed() + self._drop_removed()
        while True:
            try:
                peer, result = self._results.get_nowait()
            except queue.Empty:
                admitted = self._admit()
                return [p for p in changed if all(p is not a for a in admitted)] + admitted
            if self._peers.get(peer.key) is not peer or peer.state is not PeerState.CONNECTING:
                if isinstance(result, _Prepared):
                    self._give_back(result)
                continue
            if isinstance(result, KVBridgeError):
                self._fail(peer, str(result), classify(result.__cause__ or result))
            else:
                self._apply(peer, result)
            changed.append(peer)

    def _drop_removed(self) -> list[Peer]:
        """Peers whose agent another holder removed because NIXL reported it disconnected
        (``PeerSetup.unload_agent``): dropped, so that their next use handshakes again."""
        removed = [
            p
            for p in self._peers.values()
            if p.agent and p.state is not PeerState.FAILED and not self._setup.has_agent(p.agent)
        ]
        for peer in removed:
            self.drop(peer.key, f"its NIXL agent {peer.agent} was removed (disconnected)")
        return removed

    def _poll_warmed(self) -> list[Peer]:
        added = []
        while True:
            try:
                host, port, result = self._warmed.get_nowait()
            except queue.Empty:
                return added
            if isinstance(result, KVBridgeError):
                self.book.set(f"{host}:{port}", classify(result.__cause__ or result), str(result))
                continue
            key = (result.desc.engine_id, result.desc.engine_rank)
            if key in self._peers:  # a request got there first
                self._give_back(result)
                continue
            peer = Peer(key=key, host=host, port=port)
            self._peers[key] = peer
            self._apply(peer, result)
            added.append(peer)

    def _apply(self, peer: Peer, prepared: _Prepared) -> None:
        peer.agent, peer.description = prepared.agent, prepared.desc
        if prepared.incompatible:
            peer.state, peer.reason = PeerState.INCOMPATIBLE, prepared.incompatible
            self.failures += 1
            reason = f"cannot be read from (notifications only): {peer.reason}"
            self.book.set(peer.address, PeerHealth.INCOMPATIBLE, reason)
            return
        peer.layout, peer.plan, peer.remote_lists = prepared.layout, prepared.plan, prepared.lists
        peer.state = PeerState.READY
        self.handshakes += 1
        self.book.set(peer.address, PeerHealth.READY)
        if prepared.plan is None:
            logger.info("peer %s ready (notifications only: none of our heads)", peer.key)
        else:
            logger.info("peer %s ready:\n%s", peer.key, prepared.plan)

    def _refusal(self, agent: str) -> str:
        return next((why for check in self.admission if (why := check(agent))), "")

    def _admit(self) -> list[Peer]:
        """READY <-> REFUSED as the admission checks say; the peers that changed, and
        the REFUSED ones a load asked for since the last poll."""
        changed = []
        for peer in self._peers.values():
            if peer.state not in (PeerState.READY, PeerState.REFUSED):
                continue
            why = self._refusal(peer.agent)
            if why and peer.state is PeerState.READY:
                peer.state, peer.reason = PeerState.REFUSED, why
                self.book.set(peer.address, PeerHealth.REFUSED, why)
                logger.warning("peer %s: no new loads from it: %s", peer.key, why)
                changed.append(peer)
            elif not why and peer.state is PeerState.REFUSED:
                peer.state, peer.reason = PeerState.READY, ""
                self.book.set(peer.address, PeerHealth.READY)
                logger.info("peer %s admits loads again", peer.key)
                changed.append(peer)
            elif why and peer.key in self._surfaced:
                changed.append(peer)
        self._surfaced.clear()
        return changed

    def _fail(self, peer: Peer, reason: str, health: PeerHealth) -> None:
        peer.state, peer.reason = PeerState.FAILED, reason
        self.failures += 1
        self.book.set(peer.address, health, reason)  # at ERROR the first time, with the fix
        if peer.agent:
            self.drop(peer.key, reason)

    def drop(self, key: PeerKey, reason: str) -> None:
        """Forget a peer (dead or restarted): its agent and lists go (on the set-up
        thread); next use re-handshakes. Its transfers in flight are released there, which
        does not stop them: only when the transport confirmed the peer gone are
        ``on_drop``'s hooks told (what waited for it has ended); else they stay held by
        whoever waits for them (``decode.quarantine``)."""
        peer = self._peers.get(key)
        if peer is None:
            return
        lists, peer.remote_lists = list(peer.remote_lists.values()), {}
        agent, peer.agent = peer.agent, ""
        peer.state, peer.reason = PeerState.FAILED, reason
        self._client.forget(*key)
        if lists or agent:
            self._setup.nixl(lambda: self._release(lists, agent), teardown=True)
        for hook in self.on_drop if self.gone(agent) else ():
            hook(agent)

    def local_list(self, group: GroupPlan, stream: PieceStream) -> DescList:
        """This worker's descriptor list for a plan's stream, prepared once and shared."""
        return self._lists.local(group, stream)

    def close(self) -> None:
        """Drop every peer (their agents and lists go on the set-up thread, which the
        worker closes after this) and release the local lists (gate held)."""
        for key in list(self._peers):
            self.drop(key, "closed")
        self._lists.close()


def _failure(reason: str, cause: BaseException) -> KVBridgeError:
    """A failed handshake as the step gets it: ``cause`` says the peer's state
    (:func:`~kvbridge.connector.worker.peer_health.classify`)."""
    error = KVBridgeError(reason)
    error.__cause__ = cause
    return error
