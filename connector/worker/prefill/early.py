"""Messages that reach prefill before their request does.

A ``Done`` may arrive before the request does: an engine hands its worker the finished
request with its next step, and an idle engine takes none, while decode (which needs no
``Prepare`` when no rewrite is due) has already read the blocks. Such a ``Done`` is kept
for ``EARLY_DONE_TTL_S`` and ends the request as soon as it is added. A ``Prepare`` may
arrive that early too (a rewrite, or a decode claiming the blocks near the lease end): it
is answered when the request is added, or refused once ``wait_s`` passed (the worker
passes its lease: the engine hands over a finished request with its next step, which
under load may be seconds away, and a request it still owns is finishing, not gone). One
for a request that already ended here, or that the engine freed before handing it over,
is refused at once (the sender's to decide). At most ``MAX_EARLY`` requests wait of each
kind; more are refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import Done, Prepare
from kvbridge.connector.worker.prefill.holds import MAX_READERS

logger = logging.getLogger(__name__)

EARLY_DONE_TTL_S = 120.0  # how long a Done for a request not added yet is kept
# how long a Prepare (or Push) waits for its request to be added, unless the worker says
# otherwise (it passes its lease): the engine may take several seconds to hand over a
# request it finished (a long step under load); 5 s lost pushes under 8 concurrent loads
EARLY_PREPARE_TTL_S = 30.0
MAX_EARLY = 4096  # requests with early messages waiting, of each kind

Waiting = list[tuple[str, Prepare]]  # (requester agent, Prepare)


class Early:
    """The ``Done`` and ``Prepare`` messages waiting for their request, by request id."""

    def __init__(
        self,
        metrics: ConnectorMetrics,
        *,
        wait_s: float = EARLY_PREPARE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self.wait_s = wait_s
        self._clock = clock
        # request -> (expiry, [(reader's agent, Done)])
        self._dones: dict[str, tuple[float, list[tuple[str, Done]]]] = {}
        # request -> (expiry, [(requester agent, Prepare)])
        self._prepares: dict[str, tuple[float, Waiting]] = {}

    def keep_done(self, msg: Done, agent: str) -> bool:
        """Keep ``msg`` until its request is added; False: too many wait already."""
        if msg.request_id not in self._dones and len(self._dones) >= MAX_EARLY:
            return False
        _, dones = self._dones.setdefault(msg.request_id, (self._clock() + EARLY_DONE_TTL_S, []))
        if len(dones) >= MAX_READERS:  # a request has no more readers than that
            return False
        dones.append((agent, msg))
        return True

    def keep_prepare(self, msg: Prepare, agent: str) -> bool:
        """Keep ``msg`` until its request is added (or ``wait_s`` passed); a claim sent
        again replaces the reader's earlier one: answered once, from the latest send,
        which decode counts its hold from. False: too many wait already."""
        if msg.request_id not in self._prepares and len(self._prepares) >= MAX_EARLY:
            return False
        _, waiting = self._prepares.setdefault(msg.request_id, (self._clock() + self.wait_s, []))
        reader = (agent, msg.reader_rank)
        waiting[:] = [(a, p) for a, p in waiting if (a, p.reader_rank) != reader]
        if len(waiting) >= MAX_READERS:
            return False
        waiting.append((agent, msg))
        return True

    def take(self, request_id: str) -> tuple[Waiting, list[tuple[str, Done]]]:
        """The request was added: the claims and Dones that waited for it, in that order
        of handling (claims first: a Done ends the claims it names)."""
        _, prepares = self._prepares.pop(request_id, (0.0, []))
        _, dones = self._dones.pop(request_id, (0.0, []))
        return prepares, dones

    def drop(self, request_id: str) -> Waiting:
        """The request will never be added (the engine freed it): its Dones go, its
        claims are returned to be refused."""
        self._dones.pop(request_id, None)
        _, prepares = self._prepares.pop(request_id, (0.0, []))
        return prepares

    def expire(self) -> Waiting:
        """Drop what waited too long; returns the claims to refuse."""
        now = self._clock()
        for rid, (expiry, _) in list(self._dones.items()):
            if now > expiry:
                _, msgs = self._dones.pop(rid)
                self._metrics.bad_notifications += len(msgs)
                logger.warning("Done for %s arrived but the request never did; dropped", rid)
        refused: Waiting = []
        for rid, (expiry, waiting) in list(self._prepares.items()):
            if now > expiry:
                del self._prepares[rid]
                refused += waiting
        return refused
