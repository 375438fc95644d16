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
        src.claim_sent = now
        self._metrics.claims_sent += 1
        return True

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
        return ""

    @staticmethod
    def verdict(src: Source) -> bool | None:
        """READs that ended: True (within the hold), None (wait: a claim is in flight),
        False (after the hold: the blocks may have been given back)."""
        if src.reads_done <= src.held_until:
            return True
        return None if src.claim_sent else False
