"""Notifications a worker sends to its peers, and the one place they reach NIXL.

A message to a peer worker waits here until that peer's handshake is through (NIXL must
have loaded its agent first); the worker flushes the queue once per progress round::

    queue_to(key, endpoint, msg)   peers.ensure(key): the handshake runs in the background
    flush()                        CONNECTING: keep it queued    CONNECTED: send(peer, msg)
                                   FAILED or forgotten: drop it (logged)
    send(peer, msg)                a send that fails forgets the peer (next use re-handshakes)
    send_raw(agent, msg)           encode, engine.send_notif; every notification passes here

The decode side's own messages go to the prefill ranks :mod:`kvbridge.connector.worker.routing`
names for a request: ``Done`` (the prefill may free) to each rank this rank reports to, and one
``Heartbeat`` (keep the leases) per prefill rank for the requests still waiting for blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import (
    Done,
    Heartbeat,
    Notification,
    encode_notification,
)
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.peers import Peer, PeerDirectory, PeerKey, PeerState
from kvbridge.connector.worker.routing import Route, Router
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)


class Outbox:
    """Queued notifications of one worker (rank ``router.rank``)."""

    def __init__(
        self,
        engine: TransferEngine,
        peers: PeerDirectory,
        router: Router,
        metrics: ConnectorMetrics,
        ensure_agent: Callable[[str], None] = lambda name: None,
    ) -> None:
        """``ensure_agent(name)``: called before each notification to add the recipient's
        NIXL agent if it is not yet (a requester of the description, added lazily)."""
        self._ensure_agent = ensure_agent
        self._engine = engine
        self._peers = peers
        self._router = router
        self._metrics = metrics
        self._queued: list[tuple[PeerKey, str, int, Notification]] = []

    def queue_done(self, params: KVTransferParams, *, ok: bool) -> None:
        """Tell every prefill rank this decode rank reports to that it may free."""
        route = self._route(params)
        for key, readers in route.notify if route else ():
            msg = Done(
                request_id=params.remote_request_id,
                ok=ok,
                readers=readers,
                reader_rank=self._router.rank,
            )
            self.queue_to(key, route.endpoints[key], msg)

    def queue_heartbeats(self, waiting: Iterable[tuple[str, KVTransferParams]]) -> None:
        """One ``Heartbeat`` per prefill rank for the requests still waiting for blocks."""
        by_peer: dict[PeerKey, tuple[tuple[str, int], list[str]]] = {}
        for _rid, params in waiting:
            route = self._route(params)
            if route is None:
                continue
            for key, _readers in route.notify:
                entry = by_peer.setdefault(key, (route.endpoints[key], []))
                entry[1].append(params.remote_request_id)
        for key, (endpoint, ids) in by_peer.items():
            self.queue_to(key, endpoint, Heartbeat(request_ids=ids))
            self._metrics.heartbeats_sent += 1

    def queue_to(self, key: PeerKey, endpoint: tuple[str, int], msg: object) -> None:
        host, port = endpoint
        self._peers.ensure(key, host, port)
        self._queued.append((key, host, port, msg))  # type: ignore[arg-type]

    def flush(self) -> None:
        keep = []
        for key, host, port, msg in self._queued:
            peer = self._peers.get(key)
            if peer is None or peer.state is PeerState.FAILED:
                logger.warning("dropping %s for unreachable peer %s", type(msg).__name__, key)
                continue
            if peer.state is PeerState.CONNECTING:
                keep.append((key, host, port, msg))
                continue
            self.send(peer, msg)
        self._queued = keep

    def send(self, peer: Peer, msg: object) -> bool:
        if not self.send_raw(peer.agent, msg):
            self._peers.drop(peer.key, "notification failed: peer unreachable")
            return False
        return True

    def send_raw(self, agent: str, msg: object) -> bool:
        self._ensure_agent(agent)
        try:
            self._engine.send_notif(agent, encode_notification(msg))  # type: ignore[arg-type]
            self._metrics.notifications_sent += 1
            return True
        except KVBridgeError as exc:
            logger.warning("notification to %s failed: %s", agent, exc)
            return False

    def _route(self, params: KVTransferParams) -> Route | None:
        try:
            return self._router.route(params)
        except KVBridgeError as exc:
            logger.warning("no route to prefill %s: %s", params.remote_engine_id, exc)
            return None
