"""Frames on the wire: magic, optional authentication header, payload.

Each message is one ZMQ multipart message::

    without a secret:  [ b"KVB1" | payload ]
    with a secret:     [ b"KVB1" | header | payload ]

    header  = msgpack [timestamp_ns, nonce (16 random bytes), mac (32 bytes)]
    mac     = HMAC-SHA256(secret, magic | timestamp_ns | nonce | in_reply_to | payload)

``in_reply_to`` is empty for a request and the request's nonce for its reply, so a reply
cannot be replayed to another request. Verification order: size (before anything is
decoded), magic, header shape, MAC (constant-time), timestamp within the clock skew, nonce
not seen before. A nonce is remembered exactly as long as its timestamp would still pass the
skew check, so the replay window equals the skew window; the cache is bounded.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from kvbridge.handshake.errors import (
    AuthenticationError,
    HandshakeError,
    MessageTooLargeError,
    ProtocolError,
    UnsupportedVersionError,
)

MAGIC = b"KVB1"
NONCE_BYTES = 16
MAC_BYTES = 32
_MAGIC_FAMILY = MAGIC[:3]


@dataclass(frozen=True, kw_only=True)
class HandshakeSecurity:
    """Limits and the optional shared secret of the side channel (both ends alike)."""

    secret: bytes | None = None
    max_message_bytes: int = 1 << 20
    max_clock_skew_s: float = 30.0
    max_remembered_nonces: int = 1 << 16

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < 16:
            raise HandshakeError(
                f"HandshakeSecurity: secret has {len(self.secret)} bytes; use at least 16"
            )
        if self.max_message_bytes <= 0 or self.max_clock_skew_s <= 0:
            raise HandshakeError(
                f"HandshakeSecurity: max_message_bytes={self.max_message_bytes} and "
                f"max_clock_skew_s={self.max_clock_skew_s} must be positive"
            )
        if self.max_remembered_nonces <= 0:
            raise HandshakeError(
                f"HandshakeSecurity: max_remembered_nonces={self.max_remembered_nonces} "
                "must be positive"
            )

    @property
    def socket_max_bytes(self) -> int:
        """ZMQ ``MAXMSGSIZE``: up to twice the limit is read and answered TOO_LARGE, so a
        misconfigured peer learns why; beyond that libzmq drops the connection unread."""
        return 2 * self.max_message_bytes + 4096


class AuthHeader(msgspec.Struct, frozen=True, array_like=True):
    timestamp_ns: int
    nonce: bytes
    mac: bytes


_HEADER_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(AuthHeader)


@dataclass(frozen=True)
class OpenedFrames:
    """A verified payload; ``nonce`` is empty when the side channel has no secret."""

    payload: bytes
    nonce: bytes

    @property
    def authenticated(self) -> bool:
        return bool(self.nonce)


class FrameCodec:
    """Seals payloads into frames and opens (verifies) received frames.

    Thread-safe: the nonce cache is guarded by a lock, the rest is immutable.
    """

    __slots__ = ("_clock", "_expiry_heap", "_lock", "_seen", "security")

    def __init__(
        self, security: HandshakeSecurity, *, clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.security = security
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[bytes] = set()
        self._expiry_heap: list[tuple[int, bytes]] = []

    def __repr__(self) -> str:
        auth = "hmac-sha256" if self.security.secret else "none"
        return (
            f"FrameCodec(auth={auth}, max_message_bytes={self.security.max_message_bytes}, "
            f"remembered_nonces={len(self._seen)})"
        )

    def seal(self, payload: bytes, *, in_reply_to: bytes = b"") -> tuple[list[bytes], bytes]:
        """Frames for ``payload`` and the nonce they carry (empty without a secret)."""
        secret = self.security.secret
        if secret is None:
            return [MAGIC, payload], b""
        timestamp_ns = self._clock()
        nonce = os.urandom(NONCE_BYTES)
        mac = _mac(secret, timestamp_ns, nonce, in_reply_to, payload)
        header = _HEADER_ENCODER.encode(AuthHeader(timestamp_ns, nonce, mac))
        return [MAGIC, header, payload], nonce

    def open(self, frames: Sequence[bytes], *, in_reply_to: bytes = b"") -> OpenedFrames:
        """Verify received frames; raises MessageTooLarge/Protocol/AuthenticationError."""
        size = sum(len(frame) for frame in frames)
        if size > self.security.max_message_bytes:
            raise MessageTooLargeError(
                f"message of {size} bytes exceeds max_message_bytes="
                f"{self.security.max_message_bytes}; refused before decoding"
            )
        if len(frames) not in (2, 3):
            raise ProtocolError(
                f"expected 2 frames [magic, payload] or 3 [magic, header, payload], "
                f"got {len(frames)}"
            )
        magic = bytes(frames[0])
        if magic != MAGIC:
            error = UnsupportedVersionError if magic[:3] == _MAGIC_FAMILY else ProtocolError
            raise error(f"first frame is {magic[:16]!r}, expected {MAGIC!r}")
        secret = self.security.secret
        if secret is None:
            if len(frames) == 3:
                raise AuthenticationError(
                    "message carries an authentication header but no secret is configured "
                    "here; configure the same secret on both sides"
                )
            return OpenedFrames(bytes(frames[1]), b"")
        if len(frames) == 2:
            raise AuthenticationError(
                "message has no authentication header but a secret is configured here; "
                "configure the same secret on both sides"
            )
        header = _decode_header(frames[1])
        payload = bytes(frames[2])
        expected = _mac(secret, header.timestamp_ns, header.nonce, in_reply_to, payload)
        if not hmac.compare_digest(expected, header.mac):
            what = "reply does not match its request or " if in_reply_to else ""
            raise AuthenticationError(f"HMAC mismatch: {what}wrong secret or tampered message")
        self._check_fresh(header)
        return OpenedFrames(payload, header.nonce)

    def _check_fresh(self, header: AuthHeader) -> None:
        now = self._clock()
        skew_ns = int(self.security.max_clock_skew_s * 1e9)
        if abs(now - header.timestamp_ns) > skew_ns:
            age_s = (now - header.timestamp_ns) / 1e9
            raise AuthenticationError(
                f"timestamp is {age_s:+.3f} s off this clock, more than max_clock_skew_s="
                f"{self.security.max_clock_skew_s}; stale message or unsynchronised clocks"
            )
        with self._lock:
            heap, seen = self._expiry_heap, self._seen
            while heap and heap[0][0] < now:
                seen.discard(heapq.heappop(heap)[1])
            if header.nonce in seen:
                raise AuthenticationError("replayed message: nonce already seen in the window")
            if len(seen) >= self.security.max_remembered_nonces:
                # Forgetting a live nonce would let its message be replayed: refuse instead.
                raise AuthenticationError(
                    f"replay cache full ({len(seen)} nonces within the last "
                    f"{self.security.max_clock_skew_s} s); raise max_remembered_nonces"
                )
            seen.add(header.nonce)
            heapq.heappush(heap, (header.timestamp_ns + skew_ns, header.nonce))


def _decode_header(frame: bytes) -> AuthHeader:
    try:
        header = _HEADER_DECODER.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AuthenticationError(f"malformed authentication header: {exc}") from None
    if len(header.nonce) != NONCE_BYTES or len(header.mac) != MAC_BYTES:
        raise AuthenticationError(
            f"malformed authentication header: nonce {len(header.nonce)} bytes, mac "
            f"{len(header.mac)} bytes; expected {NONCE_BYTES} and {MAC_BYTES}"
        )
    return header


def _mac(
    secret: bytes, timestamp_ns: int, nonce: bytes, in_reply_to: bytes, payload: bytes
) -> bytes:
    if not 0 <= timestamp_ns < 1 << 64:
        raise AuthenticationError(f"timestamp_ns={timestamp_ns} is out of range")
    mac = hmac.new(secret, MAGIC, hashlib.sha256)
    mac.update(struct.pack(">QB", timestamp_ns, len(in_reply_to)))
    mac.update(nonce)
    mac.update(in_reply_to)
    mac.update(payload)
    return mac.digest()
