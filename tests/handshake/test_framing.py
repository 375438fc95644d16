"""Frames: magic, HMAC authentication, freshness, replay, size limits."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.handshake.errors import (
    AuthenticationError,
    HandshakeError,
    MessageTooLargeError,
    ProtocolError,
    UnsupportedVersionError,
)
from kvbridge.handshake.framing import MAGIC, AuthHeader, FrameCodec, HandshakeSecurity

SECRET = b"k" * 32
SKEW_S = 30.0
T0 = 1_700_000_000 * 10**9


class FakeClock:
    def __init__(self, now_ns: int = T0) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * 1e9)


def codec(
    secret: bytes | None = SECRET, clock: FakeClock | None = None, **limits: int
) -> FrameCodec:
    security = HandshakeSecurity(secret=secret, max_clock_skew_s=SKEW_S, **limits)
    return FrameCodec(security, clock=clock or FakeClock())


def test_without_a_secret_frames_are_magic_and_payload() -> None:
    frames, nonce = codec(None).seal(b"hello")
    assert frames == [MAGIC, b"hello"] and nonce == b""
    opened = codec(None).open(frames)
    assert opened.payload == b"hello" and not opened.authenticated


def test_hmac_round_trip() -> None:
    sender, receiver = codec(), codec()
    frames, nonce = sender.seal(b"payload")
    assert len(frames) == 3 and frames[0] == MAGIC and len(nonce) == 16
    opened = receiver.open(frames)
    assert opened.payload == b"payload" and opened.nonce == nonce and opened.authenticated


def flip_bit(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize("index", [0, 3, 6])
def test_tampered_payload_is_refused(index: int) -> None:
    frames, _ = codec().seal(b"payload")
    frames[2] = flip_bit(frames[2], index)
    with pytest.raises(AuthenticationError, match="HMAC mismatch"):
        codec().open(frames)


@pytest.mark.parametrize("field", ["timestamp_ns", "nonce", "mac"])
def test_tampered_header_field_is_refused(field: str) -> None:
    frames, _ = codec().seal(b"payload")
    header = msgspec.msgpack.decode(frames[1], type=AuthHeader)
    value = getattr(header, field)
    changed = value + 1 if isinstance(value, int) else flip_bit(value, 5)
    frames[1] = msgspec.msgpack.encode(msgspec.structs.replace(header, **{field: changed}))
    with pytest.raises(AuthenticationError, match="HMAC mismatch"):
        codec().open(frames)


@pytest.mark.parametrize(
    "header",
    [b"", b"\xc1garbage", msgspec.msgpack.encode([1, b"short", b"x" * 32])],
)
def test_garbled_header_is_refused_as_malformed(header: bytes) -> None:
    frames, _ = codec().seal(b"payload")
    with pytest.raises(AuthenticationError, match="malformed authentication header"):
        codec().open([frames[0], header, frames[2]])


def test_wrong_secret_is_refused() -> None:
    frames, _ = codec(b"w" * 32).seal(b"payload")
    with pytest.raises(AuthenticationError, match="wrong secret"):
        codec().open(frames)


def test_replay_is_refused() -> None:
    receiver = codec()
    frames, _ = codec().seal(b"payload")
    receiver.open(frames)
    with pytest.raises(AuthenticationError, match="replayed"):
        receiver.open(frames)


@pytest.mark.parametrize("offset_s", [-(SKEW_S + 1), SKEW_S + 1])
def test_timestamp_outside_the_skew_is_refused(offset_s: float) -> None:
    sender_clock = FakeClock()
    sender_clock.advance(offset_s)
    frames, _ = codec(clock=sender_clock).seal(b"payload")
    with pytest.raises(AuthenticationError, match=r"max_clock_skew_s=30\.0"):
        codec().open(frames)


def test_timestamp_inside_the_skew_is_accepted() -> None:
    sender_clock = FakeClock()
    sender_clock.advance(SKEW_S - 1)
    frames, _ = codec(clock=sender_clock).seal(b"payload")
    assert codec().open(frames).payload == b"payload"


def test_nonce_cache_is_bounded_and_forgets_by_time() -> None:
    clock = FakeClock()
    sender, receiver = codec(clock=clock), codec(clock=clock, max_remembered_nonces=2)
    receiver.open(sender.seal(b"1")[0])
    receiver.open(sender.seal(b"2")[0])
    with pytest.raises(AuthenticationError, match="replay cache full"):
        receiver.open(sender.seal(b"3")[0])
    clock.advance(SKEW_S + 1)  # both nonces are now too old to be replayed: forgotten
    receiver.open(sender.seal(b"4")[0])
    receiver.open(sender.seal(b"5")[0])


def test_reply_bound_to_another_request_is_refused() -> None:
    reply, _ = codec().seal(b"reply", in_reply_to=b"a" * 16)
    with pytest.raises(AuthenticationError, match="does not match its request"):
        codec().open(reply, in_reply_to=b"b" * 16)
    assert codec().open(reply, in_reply_to=b"a" * 16).payload == b"reply"


def test_oversized_message_is_refused_before_anything_is_decoded() -> None:
    limit = 1024
    # Garbage everywhere: only the size check can have produced this error.
    frames = [b"nonsense", b"\xc1" * 10, b"\xc1" * limit]
    with pytest.raises(MessageTooLargeError, match=f"exceeds max_message_bytes={limit}"):
        codec(max_message_bytes=limit).open(frames)
    with pytest.raises(MessageTooLargeError):
        codec(None, max_message_bytes=limit).open([MAGIC, b"x" * limit])


def test_unauthenticated_frames_to_a_secret_codec_are_refused() -> None:
    with pytest.raises(AuthenticationError, match="no authentication header"):
        codec().open([MAGIC, b"payload"])


def test_authenticated_frames_to_a_codec_without_secret_are_refused() -> None:
    frames, _ = codec().seal(b"payload")
    with pytest.raises(AuthenticationError, match="no secret is configured here"):
        codec(None).open(frames)


@pytest.mark.parametrize(
    ("frames", "error", "fragment"),
    [
        ([b"HTTP", b"x"], ProtocolError, "expected b'KVB1'"),
        ([b"KVB2", b"x"], UnsupportedVersionError, "b'KVB2'"),
        ([MAGIC], ProtocolError, "got 1"),
        ([MAGIC, b"a", b"b", b"c"], ProtocolError, "got 4"),
    ],
)
def test_bad_frame_shapes_are_protocol_errors(
    frames: list[bytes], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error) as info:
        codec(None).open(frames)
    assert fragment in str(info.value)


def test_security_config_is_validated() -> None:
    with pytest.raises(HandshakeError, match="at least 16"):
        HandshakeSecurity(secret=b"short")
    with pytest.raises(HandshakeError, match="max_message_bytes=0"):
        HandshakeSecurity(max_message_bytes=0)
    assert HandshakeSecurity().socket_max_bytes > HandshakeSecurity().max_message_bytes
