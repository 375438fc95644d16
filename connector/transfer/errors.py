"""Errors raised by the transfer engine.

Every message names the agent, the peer or handle involved and, where NIXL raised, the
NIXL exception's class and text, so a log line alone says what failed and where.
"""

from __future__ import annotations

from kvbridge.layouts.errors import KVBridgeError


class TransferError(KVBridgeError):
    """A NIXL operation failed, or the engine was used in a way it does not allow
    (after ``close()``, from a foreign thread, on a released handle, unknown peer)."""


class PeerDisconnectedError(TransferError):
    """The remote agent is gone (process died, connection reset). Release the handles
    that touch it, ``remove_peer`` it, and handshake again with its next incarnation."""


class TransferTimeoutError(TransferError):
    """A transfer stayed pending past its deadline (e.g. a frozen peer). Releasing the
    handle does not stop it: memory it targets stays its own until NIXL reports it ended."""


class RegistrationError(TransferError):
    """Memory could not be registered: not contiguous, empty, overlapping an earlier
    registration, or refused by NIXL."""


class DescriptorError(TransferError, ValueError):
    """A descriptor array or index array is malformed, out of bounds, lies outside
    registered memory, or its lengths do not pair up."""
