"""Errors of the handshake side channel.

Every message names the peer (``host:port``) where one is known, what was expected and what
came back, so that a log line alone says which process to look at and what to change::

    HandshakeError
    |-- HandshakeTimeoutError      no reply in time (dead peer, wrong port, silent listener)
    |-- ProtocolError              bytes that are not a valid message of this protocol
    |   |-- MessageTooLargeError   over the size limit (checked before decoding)
    |   |-- UnsupportedVersionError  the peer speaks another protocol / framing version
    |   `-- UnknownRequestError    a request type this listener does not serve
    |-- AuthenticationError        missing, wrong, stale or replayed HMAC
    |-- ListenerBusyError          the listener's queue of requests is full (retry later)
    |-- IncompatiblePeerError      both sides talk, but cannot exchange KV blocks
    `-- PeerError                  the peer answered with an ErrorReply
        `-- PeerAuthenticationError  ... whose code says our request failed authentication
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvbridge.layouts.errors import KVBridgeError


class ErrorCode(enum.Enum):
    """Why a listener refused a request; travels as its string value."""

    MALFORMED = "malformed"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_REQUEST = "unknown_request"
    TOO_LARGE = "too_large"
    UNAUTHENTICATED = "unauthenticated"
    INTERNAL = "internal"
    BUSY = "busy"  # the request queue is full (an older requester cannot decode it: refused)


class HandshakeError(KVBridgeError):
    """Base class of every error raised by the handshake side channel."""


class HandshakeTimeoutError(HandshakeError, TimeoutError):
    """The peer did not answer within the configured time (after all retries)."""


class ListenerBusyError(HandshakeError):
    """A listener's queue of requests waiting for its worker is full: the request is
    refused (``ErrorCode.BUSY``), the listener keeps serving, the requester may retry."""


class ProtocolError(HandshakeError):
    """Bytes that do not form a valid message: malformed, wrong version, unknown request."""


class MessageTooLargeError(ProtocolError):
    """A message exceeds the configured size limit; it was refused before decoding."""


class UnsupportedVersionError(ProtocolError):
    """The peer speaks another protocol or framing version than this process."""


class UnknownRequestError(ProtocolError):
    """A well-formed message whose type this listener does not serve."""


class AuthenticationError(HandshakeError):
    """A message failed authentication: no/garbled header, bad HMAC, stale or replayed."""


class IncompatiblePeerError(HandshakeError):
    """The peer answered, but its KV cache cannot be exchanged with ours.

    ``differences`` holds one ``(field, local, remote)`` triple per disagreement; the
    message lists them one per line so that the fix is obvious from the log.
    """

    def __init__(
        self,
        differences: Sequence[tuple[str, object, object]],
        *,
        peer: str = "",
        hint: str = "",
    ) -> None:
        self.differences: list[tuple[str, object, object]] = list(differences)
        self.peer = peer
        self.hint = hint
        who = f"peer {peer}" if peer else "peer"
        lines = [f"{who} is incompatible ({len(self.differences)} difference(s)):"]
        lines += [
            f"  {name}: local={local!r} remote={remote!r}"
            for name, local, remote in self.differences
        ]
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


class PeerError(HandshakeError):
    """The peer refused our request with an ``ErrorReply`` (``code`` + ``reason``)."""

    def __init__(self, peer: str, code: ErrorCode, reason: str, *, authenticated: bool) -> None:
        self.peer = peer
        self.code = code
        self.reason = reason
        self.authenticated = authenticated
        note = "" if authenticated else " (error reply was not authenticated)"
        super().__init__(f"peer {peer} refused the handshake: {code.value}: {reason}{note}")


class PeerAuthenticationError(PeerError, AuthenticationError):
    """The peer refused our request because it failed authentication (code UNAUTHENTICATED)."""
