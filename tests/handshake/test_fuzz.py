"""Fuzz the listener with raw frames from a DEALER; it must answer typed errors and live on.

Each Hypothesis example sends a batch of messages and reads one reply per message (a DEALER
gets replies in order), so a few hundred examples push thousands of frames through.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.framing import MAGIC, FrameCodec, HandshakeSecurity
from kvbridge.handshake.listener import HandshakeListener, ListenerConfig
from kvbridge.handshake.messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    MetadataRequest,
    WorkerDescription,
    decode_reply,
    encode,
)
from tests.handshake.descriptions import make_description

MAX_BYTES = 4096
SECRET = b"f" * 32
BATCH = 25
REPLY_TIMEOUT_MS = 5000
FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

DESCRIPTION = make_description("prefill-fuzz", agent_name="prefill-fuzz-agent")
REQUEST = encode(MetadataRequest(PROTOCOL_VERSION, requester_engine_id="decode-fuzz"))


def start(secret: bytes | None) -> HandshakeListener:
    security = HandshakeSecurity(secret=secret, max_message_bytes=MAX_BYTES)
    return HandshakeListener(ListenerConfig(port=0, security=security), lambda: DESCRIPTION).start()


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def plain() -> Iterator[HandshakeListener]:
    listener = start(None)
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def signed() -> Iterator[HandshakeListener]:
    listener = start(SECRET)
    yield listener
    listener.close()


def send_batch(
    ctx: zmq.Context[zmq.Socket[bytes]], port: int, batch: list[list[bytes]]
) -> list[ErrorReply | WorkerDescription]:
    """Send every message, then read exactly one well-formed reply per message."""
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        for frames in batch:
            sock.send_multipart(frames)
        replies = []
        for _ in batch:
            assert sock.poll(REPLY_TIMEOUT_MS), "listener stopped answering"
            reply = sock.recv_multipart()
            assert reply[0] == MAGIC and len(reply) in (2, 3), reply
            replies.append(decode_reply(reply[-1]))
        return replies
    finally:
        sock.close(linger=0)


def assert_still_serving(
    listener: HandshakeListener, errors_before: int, secret: bytes | None
) -> None:
    assert listener.is_alive
    assert listener.stats().num_errors > errors_before
    config = ClientConfig(timeout_s=5.0, retries=0, security=HandshakeSecurity(secret=secret))
    with HandshakeClient(config) as client:
        assert client.fetch("127.0.0.1", listener.port) == DESCRIPTION


random_frames = st.lists(st.binary(max_size=200), min_size=1, max_size=5)


@st.composite
def mutated(draw: st.DrawFn, base: list[bytes]) -> list[bytes]:
    """``base`` with one mutation: truncation, bit flip, extra frames, swaps, oversize."""
    frames = list(base)
    kind = draw(
        st.sampled_from(
            ["truncate", "flip", "extra", "drop", "insert", "tag", "version", "type", "big"]
        )
    )
    index = draw(st.integers(0, len(frames) - 1))
    frame = frames[index]
    if kind == "truncate":
        frames[index] = frame[: draw(st.integers(0, max(0, len(frame) - 1)))]
    elif kind == "flip" and frame:
        at = draw(st.integers(0, len(frame) - 1))
        bit = draw(st.integers(0, 7))
        frames[index] = frame[:at] + bytes([frame[at] ^ (1 << bit)]) + frame[at + 1 :]
    elif kind == "extra":
        frames += draw(st.lists(st.binary(max_size=50), min_size=1, max_size=3))
    elif kind == "drop" and len(frames) > 1:
        del frames[index]
    elif kind == "insert":
        at = draw(st.integers(0, len(frame)))
        frames[index] = frame[:at] + draw(st.binary(min_size=1, max_size=20)) + frame[at:]
    elif kind in ("tag", "version", "type"):
        fields = {"type": "MetadataRequest", "protocol_version": PROTOCOL_VERSION}
        if kind == "tag":
            fields["type"] = draw(st.sampled_from(["ErrorReply", "WorkerDescription", "", "X"]))
        elif kind == "version":
            fields["protocol_version"] = draw(st.integers(-(2**63), 2**63 - 1))
        else:
            fields["requester_rank"] = draw(st.sampled_from(["0", None, [1], 1.5]))
        frames[-1] = msgspec.msgpack.encode(fields)
    else:  # "big" (and no-op fallbacks): over the limit, under the socket's MAXMSGSIZE
        frames[-1] = frame + b"\x00" * MAX_BYTES
    return frames


@FUZZ
@given(batch=st.lists(random_frames, min_size=BATCH, max_size=BATCH))
def test_random_frames_get_error_replies(
    ctx: zmq.Context[zmq.Socket[bytes]], plain: HandshakeListener, batch: list[list[bytes]]
) -> None:
    before = plain.stats().num_errors
    replies = send_batch(ctx, plain.port, batch)
    assert all(isinstance(reply, ErrorReply) for reply in replies)
    assert_still_serving(plain, before, None)


@FUZZ
@given(batch=st.lists(mutated([MAGIC, REQUEST]), min_size=BATCH, max_size=BATCH))
def test_mutated_requests_get_typed_replies(
    ctx: zmq.Context[zmq.Socket[bytes]], plain: HandshakeListener, batch: list[list[bytes]]
) -> None:
    before = plain.stats()
    replies = send_batch(ctx, plain.port, batch)
    # A mutation may leave a valid request (a flipped bit inside a string): then it is served.
    num_served = sum(isinstance(reply, WorkerDescription) for reply in replies)
    assert all(reply == DESCRIPTION for reply in replies if isinstance(reply, WorkerDescription))
    after = plain.stats()
    assert after.served - before.served == num_served
    assert after.num_errors - before.num_errors == BATCH - num_served


def signed_request() -> list[bytes]:
    """A fresh authenticated request (new nonce): only the mutation can make it fail."""
    return FrameCodec(HandshakeSecurity(secret=SECRET)).seal(REQUEST)[0]


@settings(FUZZ, max_examples=80)
@given(batch=st.lists(st.builds(signed_request).flatmap(mutated), min_size=BATCH, max_size=BATCH))
def test_any_mutation_of_an_authenticated_request_is_refused(
    ctx: zmq.Context[zmq.Socket[bytes]], signed: HandshakeListener, batch: list[list[bytes]]
) -> None:
    before = signed.stats().num_errors
    replies = send_batch(ctx, signed.port, batch)
    assert all(isinstance(reply, ErrorReply) for reply in replies), replies
    assert_still_serving(signed, before, SECRET)


def test_huge_frame_is_dropped_by_libzmq_and_serving_goes_on(
    ctx: zmq.Context[zmq.Socket[bytes]], plain: HandshakeListener
) -> None:
    huge = ctx.socket(zmq.DEALER)
    try:
        huge.setsockopt(zmq.LINGER, 0)
        huge.connect(f"tcp://127.0.0.1:{plain.port}")
        huge.send_multipart(
            [MAGIC, b"\x00" * (8 * HandshakeSecurity(max_message_bytes=MAX_BYTES).socket_max_bytes)]
        )
        before = plain.stats().num_errors
        # Something the listener does answer, so the huge frame was surely read (and dropped).
        replies = send_batch(ctx, plain.port, [[b"not", b"valid"], [MAGIC, REQUEST]])
        assert isinstance(replies[0], ErrorReply) and replies[1] == DESCRIPTION
        assert_still_serving(plain, before, None)
    finally:
        huge.close(linger=0)
