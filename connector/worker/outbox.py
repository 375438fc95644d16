"""Notifications a worker sends to its peers, and the one place they reach NIXL.

A message to a peer worker waits here until that peer's handshake is through (NIXL must
have loaded its agent first); the worker flushes the queue once per progress round::

    queue_to(key, endpoint, msg)   peers.ensure(key): the handshake runs in the background
    flush()                        CONNECTING: keep it queued    CONNECTED: send(peer, msg)
                                   FAILED or forgotten: drop it (logged)
    send(peer, msg)                False: not sent; only a peer NIXL reported disconnected
                                   is forgotten (next use re-handshakes)
    send_raw(agent, msg)           to a requester's agent: waits here while the set-up
                                   thread adds the agent (ensure_agent False), sent by flush
    _deliver(agent, msg)           encode, engine.send_notif; every notification passes here

A message that cannot be encoded (over ``MAX_NOTIFICATION_BYTES``) or that NIXL refuses for
any other reason fails alone: the caller fails the load or push it belongs to, and the
peer stays (a healthy peer is never dropped for one of our messages). Only
``PeerDisconnectedError`` (its process died, or UCX failed the connection) drops the
peer, and only then do the transfers it owed count as ended (``decode.quarantine``).

The decode side's own messages go to the prefill ranks :mod:`kvbridge.connector.worker.routing`
names for a request: ``Done`` (the prefill may free) to each rank this rank reports to, and one
``Heartbeat`` (keep the leases) per prefill rank for the requests still waiting for blocks,
split into as many as keep each under the notification limit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import (
    Done,
    Heartbeat,
    Notification,
    NotificationError,
    encode_notification,
)
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.errors import PeerDisconnectedError
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
        ensure_agent: Callable[[str], bool] = lambda name: True,
    ) -> None:
        """``ensure_agent(name)``: called before each :meth:`send_raw` to add the
        recipient's NIXL agent if it is not yet (a requester of the description, added
        lazily on the set-up thread); False: not yet, the message waits."""
        self._ensure_agent = ensure_agent
        self._engine = engine
        self._peers = peers
        self._router = router
        self._metrics = metrics
        self._queued: list[tuple[PeerKey, str, int, Notification]] = []
        self._awaiting: list[tuple[str, object]] = []  # (agent being added, message)

    @property
    def num_queued(self) -> int:
        """Messages not sent yet: waiting for a peer's handshake or for its agent."""
        return len(self._queued) + len(self._awaiting)

    @property
    def num_awaiting(self) -> int:
        """Messages waiting for their recipient's agent to be added (set-up thread)."""
        return len(self._awaiting)

    def queue_done(self, params: KVTransferParams, *, ok: bool) -> None:
        """Tell every prefill rank this decode rank reports to that it may free."""
        route = self._route(params)
        for key, readers in route.notify if route else ():
            msg = Done(
                request_id=params.remote_request_id,
                ok=ok,
                readers=readers,
                reader_rank=self._router.engine_rank,
            )
            self.queue_to(key, route.endpoints[key], msg)

    def queue_heartbeats(self, waiting: Iterable[tuple[str, KVTransferParams]]) -> None:
        """``Heartbeat``s to each prefill rank for the requests still waiting for blocks:
        one, or as many as keep each under the notification limit."""
        by_peer: dict[PeerKey, tuple[tuple[str, int], list[str]]] = {}
        for _rid, params in waiting:
            route = self._route(params)
            if route is None:
                continue
            for key, _readers in route.notify:
                entry = by_peer.setdefault(key, (route.endpoints[key], []))
                entry[1].append(params.remote_request_id)
        for key, (endpoint, ids) in by_peer.items():
            for msg in split_heartbeat(ids):
                self.queue_to(key, endpoint, msg)
                self._metrics.heartbeats_sent += 1

    def queue_to(self, key: PeerKey, endpoint: tuple[str, int], msg: object) -> None:
        host, port = endpoint
        self._peers.ensure(key, host, port)
        self._queued.append((key, host, port, msg))  # type: ignore[arg-type]

    def flush(self) -> None:
        awaiting, self._awaiting = self._awaiting, []
        for agent, msg in awaiting:
            self.send_raw(agent, msg)
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
        """Send ``msg`` to ``peer``; False: it was not sent (the caller fails what it
        belongs to). The peer is dropped only when NIXL reported it disconnected."""
        try:
            self._deliver(peer.agent, msg)
        except PeerDisconnectedError as exc:
            self._peers.drop(peer.key, f"notification failed, peer disconnected: {exc}")
            return False
        except KVBridgeError as exc:
            self._not_sent(peer.agent, msg, exc)
            return False
        return True

    def send_raw(self, agent: str, msg: object) -> bool:
        """Send ``msg`` to a NIXL agent (no peer of the directory), or keep it until the
        agent is added (sent by a later :meth:`flush`; behind any message already waiting
        for it, so that each peer gets its messages in order); False: not sent."""
        if any(waiting == agent for waiting, _ in self._awaiting) or not self._ensure_agent(agent):
            self._awaiting.append((agent, msg))
            return True
        try:
            self._deliver(agent, msg)
        except KVBridgeError as exc:
            self._not_sent(agent, msg, exc)
            return False
        return True

    def _deliver(self, agent: str, msg: object) -> None:
        """Encode and send; raises ``NotificationError`` (too large, ours), or the
        transport's error (``PeerDisconnectedError``: the peer is gone)."""
        self._engine.send_notif(agent, encode_notification(msg))  # type: ignore[arg-type]
        self._metrics.notifications_sent += 1

    def _not_sent(self, agent: str, msg: object, exc: KVBridgeError) -> None:
        self._metrics.notifications_failed += 1
        where = "could not be encoded" if isinstance(exc, NotificationError) else "failed"
        logger.warning(
            "%s to %s %s (the message fails, the peer is kept): %s",
            type(msg).__name__,
            agent,
            where,
            exc,
        )

    def _route(self, params: KVTransferParams) -> Route | None:
        try:
            return self._router.route(params)
        except KVBridgeError as exc:
            logger.warning("no route to prefill %s: %s", params.remote_engine_id, exc)
            return None


def split_heartbeat(request_ids: list[str]) -> list[Heartbeat]:
    """``Heartbeat``s that together name every id, each under ``MAX_NOTIFICATION_BYTES``
    (halved until each fits: 1,400 ids of vLLM's length are about 70 KB). An id too long
    for a notification of its own is logged and left out: its lease runs out alone."""
    out: list[Heartbeat] = []
    todo = [request_ids]
    while todo:
        ids = todo.pop()
        msg = Heartbeat(request_ids=ids)
        try:
            encode_notification(msg)
        except NotificationError:
            if len(ids) == 1:
                logger.warning("request id of %d characters too long for a Heartbeat", len(ids[0]))
                continue
            half = len(ids) // 2
            todo += [ids[half:], ids[:half]]
            continue
        out.append(msg)
    return out
