"""The failure boundary: one message, one scheduler order or one stage of a progress round
fails alone, whatever it raises.

A peer that passed the handshake can still send a message no check foresaw (version skew,
a bug, an insider), and our own code can raise on it anywhere: numpy, torch, a KeyError.
Each unit of work a worker does for its engine therefore runs inside :meth:`Boundary.run`::

    notification    Prepare, Push, Done, ...   -> that request's claim, push or load fails
    scheduler order one request to send/load   -> that request is dropped (reported)
    round stage     inbox, pushes, loads, ...  -> that stage waits for the next round

Whatever escapes the unit is counted (``peer_message_errors`` for a peer's message,
``unit_errors`` for the rest, both by kind), logged once with its traceback per kind and
then in one line, and handed to the unit's ``fail`` callback, which ends that unit with the
exception as its reason (a refusal to the peer, a failed load); nothing reaches the engine's
call or the idle-progress thread. ``fail`` itself runs inside the same boundary: if it
raises too, that is counted and logged, and the unit is left to its deadline or lease.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from kvbridge.connector.common.metrics import ConnectorMetrics

logger = logging.getLogger(__name__)

R = TypeVar("R")


class Boundary:
    """Runs units of work so that an exception fails only the unit that raised it."""

    def __init__(self, metrics: ConnectorMetrics) -> None:
        self._metrics = metrics
        self._traced: set[str] = set()  # kinds whose first failure was logged in full

    def run(
        self,
        kind: str,
        work: Callable[[], R],
        fail: Callable[[str], object] | None = None,
        *,
        peer: str = "",
    ) -> R | None:
        """``work()``'s result, or None when it raised: then the failure is counted under
        ``kind`` (a peer's message when ``peer`` names its agent) and ``fail(reason)``
        ends the unit."""
        try:
            return work()
        except Exception as exc:  # the boundary itself: see the module docstring
            reason = f"{kind} failed here: {type(exc).__name__}: {exc}"
            self._count(kind, peer)
            self._log(kind, peer, reason)
        if fail is not None:
            try:
                fail(reason)
            except Exception as exc:  # failing the unit failed: left to its deadline
                self._count(f"{kind} (ending it)", peer)
                self._log(f"{kind} (ending it)", peer, f"{type(exc).__name__}: {exc}")
        return None

    def _count(self, kind: str, peer: str) -> None:
        m = self._metrics
        if peer:
            m.peer_message_errors += 1
            m.peer_message_errors_by_kind[kind] = m.peer_message_errors_by_kind.get(kind, 0) + 1
        else:
            m.unit_errors += 1
            m.unit_errors_by_kind[kind] = m.unit_errors_by_kind.get(kind, 0) + 1

    def _log(self, kind: str, peer: str, reason: str) -> None:
        source = f" (from {peer})" if peer else ""
        if kind not in self._traced:
            self._traced.add(kind)
            logger.exception("%s%s; that unit alone fails", reason, source)
        else:
            logger.error("%s%s; that unit alone fails", reason, source)
