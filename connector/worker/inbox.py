"""The notifications that reach a worker from its peers, handed to the part that acts on them.

Drained once per progress round; each is decoded (a bad one is counted and dropped) and
routed by type, replies leaving through the :class:`~kvbridge.connector.worker.outbox.Outbox`::

    Prepare    -> sender: a Prepared now, or once the request is added (send_replies)
    Done       -> pusher (a decode that gave up: stop writing) and sender
    Heartbeat  -> sender (extend the leases)
    Prepared   -> receiver
    Push       -> pusher; refused with a Pushed in pull mode
    Pushed     -> receiver
    PushStatus -> pusher: a round it no longer runs is answered (failed) again

Handshake requests reach the worker another way: :mod:`kvbridge.connector.worker.side_channel`.
"""

from __future__ import annotations

import logging

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import (
    NOT_RUNNING,
    Done,
    Heartbeat,
    Notification,
    NotificationError,
    Prepare,
    Prepared,
    Push,
    Pushed,
    PushStatus,
    decode_notification,
)
from kvbridge.connector.transfer.errors import TransferError
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.boundary import Boundary
from kvbridge.connector.worker.decode.receiver import Receiver
from kvbridge.connector.worker.outbox import Outbox
from kvbridge.connector.worker.prefill.pushes import Pusher
from kvbridge.connector.worker.prefill.sender import Sender

logger = logging.getLogger(__name__)


class Inbox:
    """Routes one worker's incoming notifications; ``pusher`` is None in pull mode."""

    def __init__(
        self,
        engine: TransferEngine,
        outbox: Outbox,
        metrics: ConnectorMetrics,
        *,
        sender: Sender,
        receiver: Receiver,
        pusher: Pusher | None,
        boundary: Boundary,
    ) -> None:
        self._boundary = boundary
        self._engine = engine
        self._outbox = outbox
        self._metrics = metrics
        self._sender = sender
        self._receiver = receiver
        self._pusher = pusher

    def handle_notifications(self) -> int:
        """Read and route what came since the last call; returns how many claims
        (``Prepare``) it answered ok: their readers' READs follow. Each message is its own
        failure boundary (``boundary``): one that raises fails its own request's claim,
        push or load, and the rest of the batch is still handled."""
        answered = 0
        try:
            notifs = self._engine.get_notifs()
        except TransferError as exc:
            logger.warning("reading notifications failed: %s", exc)
            return 0
        for agent, messages in notifs.items():
            for raw in messages:
                self._metrics.notifications_received += 1
                try:
                    msg = decode_notification(raw)
                except NotificationError as exc:
                    self._metrics.bad_notifications += 1
                    logger.warning("notification from %s dropped: %s", agent, exc)
                    continue
                answered += (
                    self._boundary.run(
                        type(msg).__name__,
                        lambda m=msg, a=agent: self._route(m, a),  # type: ignore[misc]
                        lambda reason, m=msg, a=agent: self._failed(m, a, reason),  # type: ignore[misc]
                        peer=agent,
                    )
                    or 0
                )
        return answered

    def _route(self, msg: Notification, agent: str) -> int:
        """Act on one message; 1 if it was a claim answered ok."""
        if isinstance(msg, Prepare):
            reply = self._sender.on_prepare(msg, agent)
            if reply is not None:  # else answered once the request is added
                self._outbox.send_raw(agent, reply)
                return int(reply.ok)
        elif isinstance(msg, Done):
            # a decode that gave up: stop writing. Done(ok=True) comes after every round's
            # answer, so no WRITE of it runs (a round whose WRITE carried its answer may
            # not be polled here yet: the next step finds it done)
            if self._pusher is not None and not msg.ok:
                self._pusher.cancel(msg.request_id, agent)
            if not self._sender.on_done(msg, agent):
                self._metrics.bad_notifications += 1
        elif isinstance(msg, Heartbeat):
            self._sender.on_heartbeat(msg)
        elif isinstance(msg, Prepared):
            self._receiver.on_prepared(msg, agent)
        elif isinstance(msg, Push):
            self._on_push(msg, agent)
        elif isinstance(msg, Pushed):
            self._receiver.on_pushed(msg, agent)
        elif isinstance(msg, PushStatus):
            self._on_push_status(msg, agent)
        return 0

    def _failed(self, msg: Notification, agent: str, reason: str) -> None:
        """A message raised while handled: fail what it belongs to, and only that."""
        if isinstance(msg, Prepare):  # the claim is refused (a hold it got runs out)
            self._outbox.send_raw(
                agent, Prepared(request_id=msg.request_id, ok=False, reason=reason, claim=msg.claim)
            )
        elif isinstance(msg, Push):
            if self._pusher is None:
                self._outbox.send_raw(
                    agent,
                    Pushed(request_id=msg.request_id, ok=False, reason=reason, round=msg.round),
                )
            else:  # answered once any WRITE it posted ended
                self._pusher.fail_round(msg, agent, reason)
        elif isinstance(msg, Prepared | Pushed):
            self._receiver.fail_remote(msg.request_id, agent, reason)
        # Done, Heartbeat, PushStatus: the hold they were about ends with its lease

    def send_replies(self) -> int:
        """Answer the Prepare messages that came before their request was added; returns
        how many it answered ok."""
        answered = 0
        for agent, reply in self._sender.take_replies():
            self._outbox.send_raw(agent, reply)
            answered += reply.ok
        return answered

    def _on_push_status(self, msg: PushStatus, agent: str) -> None:
        """Decode asks about a push round whose answer it never got (lost or unreadable):
        a round this prefill no longer runs is over (no WRITE of it can run: a round is
        forgotten only once they all ended), so it is answered failed again; a round that
        still runs is answered when it ends."""
        if self._pusher is None or not self._pusher.runs(msg.request_id, agent, msg.round):
            reason = f"push round {msg.round} of {msg.request_id!r} {NOT_RUNNING}"
            self._outbox.send_raw(
                agent, Pushed(request_id=msg.request_id, ok=False, reason=reason, round=msg.round)
            )

    def _on_push(self, msg: Push, agent: str) -> None:
        if self._pusher is None:
            reason = "this prefill runs in pull mode (extra.transfer_mode); decode must read"
            self._outbox.send_raw(agent, Pushed(request_id=msg.request_id, ok=False, reason=reason))
            return
        self._pusher.on_push(msg, agent)
