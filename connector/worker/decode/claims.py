"""Decode's claims on prefill's blocks: how long prefill promised to hold them, on our clock.

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
    claim unanswered for RESEND_S: send it again (same hold), every RESEND_S

A claim is idempotent on prefill (it extends the hold and answers again), so an
unanswered one goes out again: a first notification on a fresh NIXL connection, or one
that waited behind a stalled peer process, must not cost the load (CI saw a first load
whose READs had ended wait 30 s for the answer, which came just after the load failed).
The hold still counts from the *first* unanswered claim, so an answer to any of them
never makes us assume more than prefill promised. Answers beyond the first are expected
and dropped quietly (:meth:`Claims.extra_answer`), never counted as bad notifications.

A hold, once answered, ends no sooner on prefill's side: not at its lease end, not on an
engine abort, only when every reader said Done (``kvbridge.connector.worker.prefill
.sender``). So a READ that ended within the hold read the request's KV.
"""

from __future__ import annotations

from collections.abc import Callable

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import Prepare, Prepared
from kvbridge.connector.worker.decode.load_records import Load, Source
from kvbridge.connector.worker.peers import Peer

RESEND_S = 2.0  # a claim unanswered this long goes out again
LATE_ANSWERS_KEPT = 4096  # remote requests whose extra answers may still come


class Claims:
    """Sends claims and keeps, per source, the hold prefill promised."""

    def __init__(
        self,
        send: Callable[[Peer, object], bool],
        metrics: ConnectorMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._send = send
        self._metrics = metrics
        self._clock = clock
        # remote request -> (answers still to come, first claim sent): loads that ended
        # with claims unanswered or answered more than once
        self._late: dict[str, tuple[int, float]] = {}

    def send(self, load: Load, src: Source, peer: Peer) -> bool:
        """Claim the blocks for the rest of the load's deadline (with the rewrites its
        plan wants); False when prefill is unreachable."""
        now = self._clock()
        msg = Prepare(
            request_id=load.spec.params.remote_request_id,
            rewrites=src.rewrites,
            hold_s=max(load.deadline - now, 0.0),
        )
        if not self._send(peer, msg):
            return False
        if src.claim_sent:
            self._metrics.claims_resent += 1
        src.claim_sent = src.claim_sent or now  # the first unanswered one counts
        src.claim_last = now
        src.claims_unanswered += 1
        self._metrics.claims_sent += 1
        return True

    @staticmethod
    def resend_due(src: Source, now: float) -> bool:
        """A claim is in flight and no claim went out for ``RESEND_S``."""
        return bool(src.claim_sent) and now - src.claim_last >= RESEND_S

    def due(self, src: Source, now: float) -> bool:
        """READs still run past half the hold we know of and no claim is in flight."""
        if src.claim_sent or not src.held_until:
            return False
        return now >= src.held_until - src.held_s / 2

    @staticmethod
    def answered(src: Source, msg: Prepared) -> str:
        """Fold prefill's ok answer in; '' or why the hold cannot be trusted."""
        if msg.held_s <= 0:
            return (
                f"prefill {src.key} did not say how long it holds the blocks (Prepared.held_s "
                f"is 0: a kvbridge older than this decode? upgrade prefill first)"
            )
        src.held_until = max(src.held_until, src.claim_sent + msg.held_s)
        src.held_s, src.claim_sent = msg.held_s, 0.0
        src.extra_answers += max(src.claims_unanswered - 1, 0)  # resent ones answer too
        src.claims_unanswered = 0
        return ""

    def forget(self, remote_request_id: str, sources: list[Source]) -> None:
        """A load ended: remember how many answers to its claims may still come."""
        due = sum(s.extra_answers + s.claims_unanswered for s in sources)
        if not due:
            return
        # 0.0: every claim was answered once (what comes now answers a resent one)
        sent = min((s.claim_sent for s in sources if s.claim_sent), default=0.0)
        self._late[remote_request_id] = (due, sent)
        while len(self._late) > LATE_ANSWERS_KEPT:
            del self._late[next(iter(self._late))]

    def extra_answer(self, remote_request_id: str, src: Source | None) -> float | None:
        """An answer no claim in flight waits for: one of several to a resent claim
        (``src``: its source, whose load is still in flight), or one to a load that
        ended (seconds since the first claim it left unanswered; 0.0 when every claim
        had been answered once). None: nobody expected it (a bad notification)."""
        if src is not None:
            if src.extra_answers <= 0:
                return None
            src.extra_answers -= 1
            return 0.0
        due, sent = self._late.pop(remote_request_id, (0, 0.0))
        if due <= 0:
            return None
        if due > 1:
            self._late[remote_request_id] = (due - 1, sent)
        return self._clock() - sent if sent else 0.0

    @staticmethod
    def verdict(src: Source) -> bool | None:
        """READs that ended: True (within the hold), None (wait: a claim is in flight),
        False (after the hold: the blocks may have been given back)."""
        if src.reads_done <= src.held_until:
            return True
        return None if src.claim_sent else False
