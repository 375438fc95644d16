"""The ZMQ side channel: typed msgspec messages, framing/auth, listener and client.

Negotiation (description <-> layouts specs, compatibility, transfer plan) builds on these.
"""

from __future__ import annotations

from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.errors import (
    AuthenticationError,
    HandshakeError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    MessageTooLargeError,
    PeerAuthenticationError,
    PeerError,
    ProtocolError,
    UnknownRequestError,
    UnsupportedVersionError,
)
from kvbridge.handshake.framing import FrameCodec, HandshakeSecurity
from kvbridge.handshake.listener import (
    HandshakeListener,
    ListenerConfig,
    ListenerStats,
    default_port,
)
from kvbridge.handshake.messages import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    MetadataRequest,
    WireGroup,
    WireRegion,
    WireSpec,
    WorkerDescription,
    decode_reply,
    decode_request,
    encode,
)

__all__ = [
    "PROTOCOL_VERSION",
    "AuthenticationError",
    "ClientConfig",
    "ErrorCode",
    "ErrorReply",
    "FrameCodec",
    "HandshakeClient",
    "HandshakeError",
    "HandshakeListener",
    "HandshakeSecurity",
    "HandshakeTimeoutError",
    "IncompatiblePeerError",
    "ListenerConfig",
    "ListenerStats",
    "MessageTooLargeError",
    "MetadataRequest",
    "PeerAuthenticationError",
    "PeerError",
    "ProtocolError",
    "UnknownRequestError",
    "UnsupportedVersionError",
    "WireGroup",
    "WireRegion",
    "WireSpec",
    "WorkerDescription",
    "decode_reply",
    "decode_request",
    "default_port",
    "encode",
]
