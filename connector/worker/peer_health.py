"""Each peer's state as an operator sees it, and failed handshakes counted by reason.

A misconfigured pair (another secret, another model, an address the peer cannot reach)
fails every handshake the same way; decode then recomputes every request while the client
sees answers. :class:`PeerBook` makes that visible: the first failure of a peer in a state
is logged at ERROR with the fix (its repeats at DEBUG, until the peer is ready again), the
state is a gauge per peer (``kvbridge_peer_state{peer,state}``) and each failure counts
under its reason (``kvbridge_peer_failures_total{reason}``)::

    connecting --> ready | incompatible | bad_secret | unreachable | failed
    ready <--> refused (an admission check: decode's quarantine)
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Iterable

from kvbridge.handshake.errors import (
    AuthenticationError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    UnsupportedVersionError,
)

logger = logging.getLogger(__name__)


class PeerHealth(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    REFUSED = "refused"  # ready, but no new load from it (an admission check)
    INCOMPATIBLE = "incompatible"  # answered; its KV cannot be exchanged with ours
    BAD_SECRET = "bad_secret"  # its messages, or ours to it, fail authentication
    UNREACHABLE = "unreachable"  # no answer at its address
    FAILED = "failed"  # any other failure (a malformed reply, a set-up error)


FAILURES = (
    PeerHealth.INCOMPATIBLE,
    PeerHealth.BAD_SECRET,
    PeerHealth.UNREACHABLE,
    PeerHealth.FAILED,
)

_FIXES = {
    PeerHealth.BAD_SECRET: (
        "set the same `secret` on every prefill and decode worker (docs/troubleshooting.md, "
        '"secret mismatch")'
    ),
    PeerHealth.INCOMPATIBLE: "change what the lines above name (docs/troubleshooting.md)",
    PeerHealth.UNREACHABLE: (
        "check that the peer runs and that its kv_ip is its address on the KV network, "
        "reachable from here, and its kv_port the port it listens on (docs/multihost.md)"
    ),
    PeerHealth.FAILED: "see the error above (docs/troubleshooting.md)",
}


def classify(exc: BaseException) -> PeerHealth:
    """The state a handshake or set-up that raised ``exc`` leaves its peer in."""
    if isinstance(exc, AuthenticationError):  # our secret refused theirs, or theirs ours
        return PeerHealth.BAD_SECRET
    if isinstance(exc, (IncompatiblePeerError, UnsupportedVersionError)):
        return PeerHealth.INCOMPATIBLE
    if isinstance(exc, HandshakeTimeoutError):
        return PeerHealth.UNREACHABLE
    return PeerHealth.FAILED


class PeerBook:
    """Peers' states by address (``host:port``) and failures by reason (one directory's)."""

    def __init__(self) -> None:
        self.states: dict[str, PeerHealth] = {}
        self.failures: Counter[str] = Counter()
        self._logged: set[tuple[str, PeerHealth]] = set()

    def set(self, peer: str, health: PeerHealth, reason: str = "") -> None:
        """``peer`` is now ``health``; a failure is counted, and logged at ERROR with its
        fix the first time the peer fails this way since it was last ready."""
        self.states[peer] = health
        if health is PeerHealth.READY:
            self._logged = {k for k in self._logged if k[0] != peer}
            return
        if health not in FAILURES:
            return
        self.failures[health.value] += 1
        if (peer, health) in self._logged:
            logger.debug("peer %s still %s: %s", peer, health.value, reason)
            return
        self._logged.add((peer, health))
        logger.error(
            "kvbridge: peer %s is %s; its loads are recomputed (or fail, by the failure "
            "policy) until fixed: %s\nfix: %s",
            peer,
            health.value,
            reason,
            _FIXES[health],
        )

    def forget(self, peer: str) -> None:
        self.states.pop(peer, None)


def merged(books: Iterable[PeerBook]) -> tuple[dict[str, str], dict[str, int]]:
    """Every book's peer states (by value) and failures by reason, together."""
    states: dict[str, str] = {}
    failures: Counter[str] = Counter()
    for book in books:
        states.update({peer: h.value for peer, h in book.states.items()})
        failures.update(book.failures)
    return states, dict(failures)
