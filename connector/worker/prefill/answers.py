"""Prefill's answers to Push rounds, delivered however long decode takes to be known here.

Decode keeps a round's blocks until prefill's ``Pushed`` comes, so an answer must not be
lost because this worker has not (or no longer) loaded decode's NIXL agent: it waits for
our own handshake with decode (the Push names its side channel) and, if that peer failed,
handshakes again, up to ``ANSWER_ATTEMPTS`` times::

    send(push, answer) -> decode known (READY / INCOMPATIBLE): notify now
                          the send failed, decode not known gone (a local failure): keep
                          it, send it again at the next flush (decode holds the round's
                          blocks until it comes; a healthy decode is never given up)
                          unknown or FAILED: handshake, keep it; CONNECTING: keep it
                          still failing after ANSWER_ATTEMPTS: logged and dropped (a
                          decode that answers no handshake is gone and holds nothing)

A load pushed in one round of one WRITE carries its answer instead
(:func:`carried_answer`): the ``Pushed(ok=True)`` is that WRITE's NIXL completion
notification. NIXL's UCX backend sends it when the post or a poll here finds the WRITE's
data complete (``Pusher.poll_posted`` polls at the end of the posting round), and decode
sees the data once it arrives; no separate send follows. Exactly once still holds: the
Pusher sends no other answer for a round whose carrying WRITE completed, and answers
``ok=False`` as before when it failed. Not for a staged load's rounds: decode asks the next
round as soon as it has an answer, which may be before a poll here saw this one done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.connector.common.notifications import (
    GroupDigest,
    NotificationError,
    Push,
    Pushed,
    asked_key,
    encode_notification,
)
from kvbridge.connector.worker.peers import PeerDirectory, PeerKey, PeerState

logger = logging.getLogger(__name__)

ANSWER_ATTEMPTS = 3  # handshakes tried to deliver a Pushed to a decode we lost


def carried_answer(
    msg: Push, *, num_bytes: int, num_rows: int, digests: list[GroupDigest], packed: bool = False
) -> bytes:
    """The encoded ``Pushed(ok=True)`` a round's only WRITE carries as its completion
    notification (``num_descs``: the rows asked for, before any merging), or b"" when it
    does not fit a notification (many digests): then it is sent once the WRITE is done."""
    answer = Pushed(
        request_id=msg.request_id,
        ok=True,
        num_bytes=num_bytes,
        num_descs=num_rows,
        round=msg.round,
        digests=digests,
        packed=packed,
        asked=asked_key(msg),
    )
    try:
        return encode_notification(answer)
    except NotificationError:
        return b""


@dataclass
class _Answer:
    """A Pushed waiting for decode's agent to be known here (our handshake with it)."""

    key: PeerKey
    endpoint: tuple[str, int] | None
    agent: str
    answer: Pushed
    attempts: int = 0  # handshakes started for it
    local_failures: int = 0  # sends that failed with decode not known gone


class Answers:
    """The Pushed answers a prefill worker still has to deliver."""

    def __init__(
        self,
        targets: PeerDirectory,
        reply: Callable[[str, Pushed], bool],
        gone: Callable[[str], bool] = lambda agent: False,
    ) -> None:
        """``gone(agent)``: the transport reported that agent disconnected (its
        process died or the connection failed: ``TransferEngine.peer_gone``)."""
        self._gone = gone
        self._targets = targets
        self._reply = reply
        self._outgoing: list[_Answer] = []

    def send(self, msg: Push, agent: str, answer: Pushed) -> None:
        """Decode holds the round's blocks until this answer comes: it is sent once our
        handshake with decode (which loads its agent here) is through."""
        key = (msg.reader_engine_id, msg.reader_rank)
        usable = bool(msg.reader_host) and 0 < msg.reader_port < 65536
        endpoint = (msg.reader_host, msg.reader_port) if usable else None
        self._outgoing.append(_Answer(key, endpoint, agent, answer))
        self.flush()

    def owes(self, request_id: str, agent: str, round_: int) -> bool:
        """An answer to that round is still waiting here to be delivered."""
        return any(
            o.agent == agent and o.answer.request_id == request_id and o.answer.round == round_
            for o in self._outgoing
        )

    def flush(self) -> None:
        """Send the answers whose decode is known here; handshake (again) with the
        others first, up to ``ANSWER_ATTEMPTS`` times (a decode that answers no
        handshake is gone: it holds nothing any more)."""
        keep = []
        for out in self._outgoing:
            peer = self._targets.get(out.key)
            if peer is not None and peer.state is PeerState.CONNECTING:
                keep.append(out)
                continue
            ready = peer is not None and peer.state is not PeerState.FAILED
            if ready and self._reply(out.agent, out.answer):
                continue
            if ready and not self._gone(out.agent):
                # a failure of ours (the send), not decode's: it still holds the round's
                # blocks and slots, so the answer goes out again at the next flush
                out.local_failures += 1
                if out.local_failures in (1, 100) or out.local_failures % 10_000 == 0:
                    logger.warning(
                        "answer to push round %d of %s not sent (%d tries); decode %s is "
                        "not known gone: sending it again",
                        out.answer.round,
                        out.answer.request_id,
                        out.local_failures,
                        out.key,
                    )
                keep.append(out)
                continue
            if out.endpoint is not None and out.attempts < ANSWER_ATTEMPTS:
                out.attempts += 1
                self._targets.ensure(out.key, *out.endpoint)  # handshakes a failed one again
                keep.append(out)
                continue
            logger.warning(
                "answer to push round %d of %s lost: decode %s unreachable (%s) after %d "
                "handshake(s); a live decode would hold the round's blocks",
                out.answer.round,
                out.answer.request_id,
                out.key,
                peer.reason if peer is not None else "no address",
                out.attempts,
            )
        self._outgoing = keep
