"""Is prefill still holding what we read? Claims on its blocks (pull), and the liveness of
a prefill that owes us a push round (push).

**Claims** (:class:`Claims`): how long prefill promised to hold its blocks, on our clock.

Every pull source claims the blocks it reads (``Prepare`` with ``hold_s``: the rest of the
load's deadline). Prefill answers with the hold it guarantees as a *duration* on its own
clock (``Prepared.held_s``), never a wall-clock time the two hosts would have to agree
on. We count that duration from when we *sent* the claim, which is earlier than prefill's
answer, so we never assume more than prefill promised::

    sent at t0 --------- prefill answers held_s ---------> held until t0 + held_s (ours)
    READs posted at t0 (with the claim, when no rewrite is due) or after the answer
    READs still running at t0 + held_s / 2: claim again (the answer extends held_until)
    READs seen done at t:  t <= held_until  -> done
                           claim unanswered -> wait for it (the load's deadline bounds it)
                           otherwise        -> the blocks may have been given back: failed
    claim unanswered for RESEND_S: send it again (a new number), every RESEND_S

Claims are numbered (``Prepare.claim``, unique in this worker) and prefill echoes the
number in its answer, so an answer counts from the send time of *its own* claim: an old
answer that arrives late (to a claim sent again, or to a load that ended) is never taken
for the answer to a newer claim. The first answer to any of a source's claims in flight
settles them all; answers to the others come later and are dropped quietly (a late answer
to a load that ended is logged), never counted as bad notifications.

Why claims are sent again: a claim is idempotent on prefill (it extends the hold and
answers again), and a first notification on a fresh connection, or one held up by a
stalled peer, must not cost the load. Only to a prefill that echoes claim numbers
(``WorkerDescription.numbered_claims``): an unnumbered answer cannot say which claim it
answers.

A hold, once answered, ends no sooner on prefill's side: not at its lease end, not on an
engine abort, only when every reader said Done (``kvbridge.connector.worker.prefill
.sender``). So a READ that ended within the hold read the request's KV.

**Writers** (:class:`Writers`): is a prefill that owes us a push round still alive?

In push mode the WRITEs land in our memory and NIXL tells the side they land on nothing
when their writer dies: no handle of ours fails. A load waits for prefill's ``Pushed``
(live) or, failed, is held until it comes (``kvbridge.connector.worker.decode.quarantine``).
So every prefill that owes a round is asked about each round it owes (``PushStatus``) each
``PROBE_S``. A live one answers a round it no longer runs (``Pushed(ok=False)`` again: its
answer was lost or unreadable, and it forgets a round only once its WRITEs ended); to a
dead one (killed, its connection reset) NIXL reports it disconnected at once, the outbox
drops the peer, and :meth:`Writers.on_drop` ends what waited for it.
A probe that fails for another reason drops nothing: only a confirmed disconnect proves
that no WRITE of the prefill's can still land::

    owes a round --(every PROBE_S)--> PushStatus(round)  sent: alive (or frozen: it buffers)
                                                         no longer runs: Pushed(ok=False)
                                                         disconnected: dropped -> on_drop
    on_drop(agent)  held rounds: ended (nothing more lands from a dead process)
                    live loads it writes: failed by the receiver's next step

A frozen prefill accepts the probes (its kernel still acknowledges TCP): its loads wait
until it resumes or dies, measured in ``scripts/experiments/measure_frozen_peer.py``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import (
    Heartbeat,
    Prepare,
    Prepared,
    PushStatus,
    asked_key,
)
from kvbridge.connector.worker.decode.inflight import Load, LoadState, Source
from kvbridge.connector.worker.decode.quarantine import Quarantine
from kvbridge.connector.worker.peers import Peer, PeerDirectory

logger = logging.getLogger(__name__)

RESEND_S = 2.0  # a claim unanswered this long goes out again
CLAIM_IDS_KEPT = 64  # claim numbers a source names in its Done (its latest ones)
SETTLED_KEPT = 4096  # claims settled unanswered whose answers may still come


class Claims:
    """Sends claims and keeps, per source, the hold prefill promised."""

    def __init__(
        self,
        send: Callable[[Peer, object], bool],
        metrics: ConnectorMetrics,
        clock: Callable[[], float],
        *,
        rank: int = 0,
    ) -> None:
        """``rank``: this decode rank, named in every claim (with our NIXL agent, the
        reader prefill keeps the claim for)."""
        self._rank = rank
        self._send = send
        self._metrics = metrics
        self._clock = clock
        self._numbers = itertools.count(1)
        # claim number -> (sent at, its load ended before any answer): claims settled
        # without their own answer, whose answers may still come
        self._settled: dict[int, tuple[float, bool]] = {}

    def send(self, load: Load, src: Source, peer: Peer) -> bool:
        """Claim the blocks for the rest of the load's deadline (with the rewrites its
        plan wants); False when prefill is unreachable."""
        now = self._clock()
        number = next(self._numbers)
        ask = load.verify and src.digests is None
        packed = src.landing is not None  # a packed read: prefill names the rows as we do
        plan = peer.plan if peer is not None else None
        msg = Prepare(
            request_id=load.spec.params.remote_request_id,
            rewrites=src.rewrites,
            hold_s=max(load.deadline - now, 0.0),
            claim=number,
            reader_rank=self._rank,
            # a verified load asks for digests until an answer brought them
            verify=ask,
            plan_digest=plan.digest if (ask or packed) and plan is not None else "",
            start_token=load.spec.start_token if ask or packed else 0,
            end_token=load.spec.end_token if ask or packed else 0,
            skipped_groups=plan.skipped_groups() if plan is not None else [],
            packed=packed,
        )
        if not self._send(peer, msg):
            return False
        src.claim_ids = [*src.claim_ids[-(CLAIM_IDS_KEPT - 1) :], number]
        if src.claims:
            self._metrics.claims_resent += 1
        src.claims[number] = now
        src.asked[number] = asked_key(msg)
        src.claim_sent = src.claim_sent or now  # the first claim in flight
        src.claim_last = now
        self._metrics.claims_sent += 1
        return True

    def due(self, src: Source, now: float) -> bool:
        """READs still run past half the hold we know of and no claim is in flight."""
        if src.claim_sent or not src.held_until:
            return False
        return now >= src.held_until - src.held_s / 2

    @staticmethod
    def resend_due(src: Source, now: float, numbered: bool) -> bool:
        """A claim is in flight to a prefill that echoes claim numbers (``numbered``) and
        none went out for ``RESEND_S``."""
        return numbered and bool(src.claim_sent) and now - src.claim_last >= RESEND_S

    @staticmethod
    def answers(src: Source, msg: Prepared) -> bool:
        """``msg`` answers a claim of ``src`` in flight (unnumbered: any of them)."""
        return bool(src.claim_sent) and (msg.claim == 0 or msg.claim in src.claims)

    def answered(self, src: Source, msg: Prepared) -> str:
        """Fold prefill's ok answer in; '' or why the hold cannot be trusted."""
        if msg.held_s <= 0:
            return (
                f"prefill {src.key} did not say how long it holds the blocks (Prepared.held_s "
                f"is 0: a kvbridge older than this decode? upgrade prefill first)"
            )
        sent_key = src.asked.get(msg.claim, "")
        if msg.asked and sent_key and msg.asked != sent_key:
            return (
                f"prefill {src.key} answered claim {msg.claim} as it read it, which is not the "
                f"claim sent (the Prepare changed on the way: version skew or a bug); nothing "
                f"it prepared is trusted"
            )
        # an unnumbered answer (an older prefill, which is never sent a claim twice)
        # counts from the first claim in flight
        sent = src.claims.get(msg.claim, src.claim_sent)
        src.held_until = max(src.held_until, sent + msg.held_s)
        src.held_s = msg.held_s
        if src.digests is None and msg.reason:  # prefill could not digest: why
            src.digest_reason = msg.reason
        elif src.digests is None:  # what prefill digested (a verified load's first answer)
            src.digests = list(msg.digests)
        self.settle(src, ended=False, answered=msg.claim)
        return ""

    def settle(self, src: Source, *, ended: bool, answered: int = 0) -> None:
        """No claim of ``src`` is in flight any more: answered (``answered``: the one
        whose answer came), or its load ``ended``; answers to the others may still come."""
        for number, sent in src.claims.items():
            if number != answered:
                self._settled[number] = (sent, ended)
        while len(self._settled) > SETTLED_KEPT:
            del self._settled[next(iter(self._settled))]
        src.claims.clear()
        src.asked.clear()
        src.claim_sent = 0.0

    def late_answer(self, msg: Prepared) -> float | None:
        """An answer to a claim settled before: seconds since it was sent when its load
        ended without any answer (else 0.0: another claim's answer came first). None:
        no such claim (a bad notification)."""
        settled = self._settled.pop(msg.claim, None) if msg.claim else None
        if settled is None:
            return None
        sent, ended = settled
        return self._clock() - sent if ended else 0.0

    def claim(self, load: Load, src: Source, peer: Peer) -> str:
        """Claim the blocks: '' or why the load fails (prefill unreachable)."""
        if self.send(load, src, peer):
            return ""
        return f"prefill {peer.key} unreachable for a claim (Prepare)"

    def refresh(self, load: Load, src: Source, peer: Peer | None, now: float) -> str:
        """READs still running past half the hold we know of: claim again (``peer``: the
        source's, None when not connected). '' or why the load fails."""
        if not self.due(src, now):
            return ""
        if peer is None:
            return f"peer {src.key} went away during the read"
        return self.claim(load, src, peer)

    def again(self, load: Load, src: Source, peer: Peer | None, now: float) -> str:
        """The claim in flight is unanswered for ``RESEND_S``: send it again. '' or why the
        load fails."""
        if peer is None:
            return f"peer {src.key} went away with a claim unanswered"
        if len(src.claims) == 1:
            logger.warning(
                "load %s: claim (Prepare) to prefill %s unanswered for %.1f s (%s); sending "
                "it again",
                load.spec.request_id,
                src.key,
                now - src.claim_sent,
                "its READs ended" if src.reads_done else "READs not posted or running",
            )
        return self.claim(load, src, peer)

    @staticmethod
    def numbered(peer: Peer | None) -> bool:
        """``peer`` (a source's, connected) echoes claim numbers: a claim may be sent again."""
        return bool(peer and peer.description and peer.description.numbered_claims)

    def reads_ended(self, src: Source) -> str:
        """The source's READs ended: DONE within the hold, or wait while a claim is
        unanswered (''); else why the load fails."""
        verdict = self.verdict(src)
        if verdict:
            self.settle(src, ended=False)  # a refresh in flight: not needed now
            src.state = LoadState.DONE
        elif verdict is False:
            return (
                f"read from {src.key} ended {src.reads_done - src.held_until:.1f} s after the "
                f"hold prefill promised: its blocks may have been given back, nothing kept"
            )
        return ""

    def stray_answer(self, msg: Prepared, agent: str) -> None:
        """A ``Prepared`` no claim in flight waits for: an answer to a claim settled before
        (another answer came first, or the load ended: logged), or a bad notification."""
        late = self.late_answer(msg)
        if late is None:
            self._metrics.bad_notifications += 1
        elif late > 0:
            logger.warning(
                "prefill %s answered a claim on %s %.1f s after it was sent, after the load "
                "had ended without an answer",
                agent or "?",
                msg.request_id,
                late,
            )

    @staticmethod
    def verdict(src: Source) -> bool | None:
        """READs that ended: True (within the hold), None (wait: a claim is in flight),
        False (after the hold: the blocks may have been given back)."""
        if src.reads_done <= src.held_until:
            return True
        return None if src.claim_sent else False


PROBE_S = 1.0  # how often a prefill that owes a push round is probed
MAX_STATUS_QUERIES = 256  # rounds asked about per prefill and probe (the rest next time)


class Writers:
    """The prefill agents our push loads wait for, and those found gone."""

    def __init__(
        self,
        peers: PeerDirectory,
        send: Callable[[Peer, object], bool],
        quarantine: Quarantine,
    ) -> None:
        self._peers = peers
        self._send = send
        self._quarantine = quarantine
        self.gone: set[str] = set()  # agents removed as dead (a name never comes back)
        self._probed: dict[str, float] = {}  # agent -> last probe
        self._turns: dict[str, int] = {}  # agent -> where its next probe's rounds start
        peers.on_drop.append(self.on_drop)
        # the quarantine's cap: no new load from an agent holding too many of our blocks
        peers.admission.append(quarantine.refusal)

    def on_drop(self, agent: str) -> None:
        """A peer was removed and confirmed dead. Marked only: the drop may come from
        inside one of our sends; the receiver's next step fails the live loads it was
        writing."""
        self.gone.add(agent)
        self._probed.pop(agent, None)
        self._quarantine.peer_gone(agent)

    def writer_gone(self, load: Load) -> bool:
        """A source of ``load`` waits for a push round from a prefill found gone."""
        return any(s.state is LoadState.PUSHED and s.round_agent in self.gone for s in load.sources)

    def probe(self, loads: Iterable[Load], now: float) -> None:
        """Ask every prefill that owes a round (live or held load), each ``PROBE_S``,
        about each round it owes (``PushStatus``): it answers a round it no longer runs
        again, so an answer lost or unreadable does not hold our blocks while it lives."""
        owed: dict[str, list[tuple[str, int]]] = {}
        for agent, rid, round_ in sorted(self._quarantine.awaited_rounds):  # held ones first
            owed.setdefault(agent, []).append((rid, round_))
        for load in loads:
            for s in load.sources:
                if s.state is LoadState.PUSHED and s.round_agent:
                    owed.setdefault(s.round_agent, []).append(
                        (load.spec.params.remote_request_id, s.round)
                    )
        agents = set(owed)
        for agent in agents - self.gone:
            if now - self._probed.setdefault(agent, now) < PROBE_S:
                continue  # first seen now, or probed less than PROBE_S ago
            self._probed[agent] = now
            peer = self._peers.with_agent(agent)
            if peer is None:
                if self._peers.gone(agent):  # removed already, by another path
                    self.on_drop(agent)
                # else: removed while not known dead; its rounds stay held (nothing
                # proves its WRITEs stopped), visible in the log and the metrics
            else:
                if not (peer.description and peer.description.push_status):
                    self._send(peer, Heartbeat(request_ids=[]))  # an older prefill: a probe
                    continue
                rounds = owed[agent]
                if len(rounds) > MAX_STATUS_QUERIES:  # by turns, so every one is asked
                    turn = self._turns.get(agent, 0) % len(rounds)
                    rounds = (rounds[turn:] + rounds[:turn])[:MAX_STATUS_QUERIES]
                    self._turns[agent] = turn + MAX_STATUS_QUERIES
                for rid, round_ in rounds:
                    if not self._send(peer, PushStatus(request_id=rid, round=round_)):
                        break  # a disconnect dropped it; another failure: asked next time
        for agent in set(self._probed) - agents:
            del self._probed[agent]
            self._turns.pop(agent, None)
