"""HandshakeListener over real ZMQ/TCP on 127.0.0.1: serving, typed refusals, shutdown."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.errors import HandshakeError, PeerError
from kvbridge.handshake.framing import MAGIC, FrameCodec, HandshakeSecurity
from kvbridge.handshake.listener import HandshakeListener, ListenerConfig, default_port
from kvbridge.handshake.messages import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    MetadataRequest,
    WorkerDescription,
    decode_reply,
    encode,
)
from kvbridge.handshake.port_holder import port_holder
from tests.handshake.descriptions import make_description

REPLY_TIMEOUT_MS = 5000
MAX_BYTES = 4096


@pytest.fixture
def listener() -> Iterator[HandshakeListener]:
    security = HandshakeSecurity(max_message_bytes=MAX_BYTES)
    with HandshakeListener(ListenerConfig(port=0, security=security), make_description) as lis:
        yield lis


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def exchange(ctx: zmq.Context[zmq.Socket[bytes]], port: int, frames: list[bytes]) -> list[bytes]:
    """Send raw frames with a DEALER and return the reply frames (fails on timeout)."""
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(frames)
        assert sock.poll(REPLY_TIMEOUT_MS, zmq.POLLIN), "listener did not answer"
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)


REQUEST = encode(MetadataRequest(PROTOCOL_VERSION))


def test_serves_the_description_to_a_raw_dealer(
    listener: HandshakeListener, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    reply = exchange(ctx, listener.port, [MAGIC, REQUEST])
    assert reply[0] == MAGIC and len(reply) == 2
    assert decode_reply(reply[1]) == make_description()
    assert listener.stats().served == 1 and listener.stats().num_errors == 0


def test_serves_the_description_to_a_client(listener: HandshakeListener) -> None:
    with HandshakeClient(ClientConfig(timeout_s=5.0)) as client:
        assert client.fetch("127.0.0.1", listener.port) == make_description()


BAD_MESSAGES: list[tuple[str, list[bytes], ErrorCode]] = [
    ("garbage payload", [MAGIC, b"\xc1\x00garbage"], ErrorCode.MALFORMED),
    ("truncated request", [MAGIC, REQUEST[:-4]], ErrorCode.MALFORMED),
    ("extra frame", [MAGIC, REQUEST, b"extra", b"more"], ErrorCode.MALFORMED),
    ("no magic", [REQUEST], ErrorCode.MALFORMED),
    ("wrong magic", [b"HTTP", REQUEST], ErrorCode.MALFORMED),
    ("future framing", [b"KVB9", REQUEST], ErrorCode.UNSUPPORTED_VERSION),
    ("wrong version", [MAGIC, encode(MetadataRequest(99))], ErrorCode.UNSUPPORTED_VERSION),
    ("reply as request", [MAGIC, encode(make_description())], ErrorCode.UNKNOWN_REQUEST),
    (
        "unknown tag",
        [MAGIC, msgspec.msgpack.encode({"type": "DropTables", "protocol_version": 1})],
        ErrorCode.UNKNOWN_REQUEST,
    ),
    ("oversized", [MAGIC, b"x" * (MAX_BYTES + 1)], ErrorCode.TOO_LARGE),
    ("unexpected auth header", [MAGIC, b"header", REQUEST], ErrorCode.UNAUTHENTICATED),
]


@pytest.mark.parametrize(
    ("frames", "code"), [m[1:] for m in BAD_MESSAGES], ids=[m[0] for m in BAD_MESSAGES]
)
def test_bad_message_gets_a_typed_error_reply_and_serving_goes_on(
    listener: HandshakeListener,
    ctx: zmq.Context[zmq.Socket[bytes]],
    frames: list[bytes],
    code: ErrorCode,
) -> None:
    reply = exchange(ctx, listener.port, frames)
    message = decode_reply(reply[-1])
    assert isinstance(message, ErrorReply) and message.code is code, message
    assert listener.stats().errors == {code: 1}
    assert decode_reply(exchange(ctx, listener.port, [MAGIC, REQUEST])[1]) == make_description()
    assert listener.is_alive


def test_describe_failure_is_an_internal_error_reply(
    ctx: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    calls = iter([RuntimeError("cache not allocated yet")])

    def describe() -> WorkerDescription:
        error = next(calls, None)
        if error is not None:
            raise error
        return make_description()

    with HandshakeListener(ListenerConfig(port=0), describe) as listener:
        with HandshakeClient(ClientConfig(timeout_s=5.0)) as client:
            with pytest.raises(PeerError, match="internal: RuntimeError: cache not allocated"):
                client.fetch("127.0.0.1", listener.port)
            assert client.fetch("127.0.0.1", listener.port) == make_description()
        assert listener.stats().errors == {ErrorCode.INTERNAL: 1}
    assert "internal error while answering" in caplog.text


def test_authenticated_listener_signs_its_replies(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    security = HandshakeSecurity(secret=b"s" * 32)
    with HandshakeListener(ListenerConfig(port=0, security=security), make_description) as lis:
        requester = FrameCodec(security)
        frames, nonce = requester.seal(REQUEST)
        reply = exchange(ctx, lis.port, frames)
        assert len(reply) == 3
        opened = requester.open(reply, in_reply_to=nonce)
        assert decode_reply(opened.payload) == make_description()
        # The same request again is a replay: refused with a plain, typed error reply.
        replayed = exchange(ctx, lis.port, frames)
        message = decode_reply(replayed[1])
        assert len(replayed) == 2 and isinstance(message, ErrorReply)
        assert message.code is ErrorCode.UNAUTHENTICATED and "replayed" in message.reason


def test_close_is_prompt_and_the_thread_is_gone() -> None:
    listener = HandshakeListener(ListenerConfig(port=0), make_description)
    listener.start()
    thread = listener._thread
    assert listener.is_alive and thread is not None
    started = time.monotonic()
    listener.close()
    assert time.monotonic() - started < 1.0
    assert not listener.is_alive and not thread.is_alive()
    assert thread not in threading.enumerate()
    listener.close()  # idempotent


def test_port_is_released_on_close() -> None:
    # read from procfs rather than by binding the port again: a rebind could collide
    # with any other process that took the port meanwhile
    first = HandshakeListener(ListenerConfig(port=0), make_description).start()
    port = first.port
    assert f"held by pid {os.getpid()} " in port_holder(port)
    first.close()
    assert f"pid {os.getpid()} " not in port_holder(port)


def test_busy_port_raises_naming_host_port_and_holder(listener: HandshakeListener) -> None:
    other = HandshakeListener(ListenerConfig(port=listener.port), make_description)
    with pytest.raises(HandshakeError, match=f"127.0.0.1:{listener.port}") as err:
        other.start()
    assert f"held by pid {os.getpid()} " in str(err.value)


def test_port_before_start_and_double_start_are_errors() -> None:
    listener = HandshakeListener(ListenerConfig(port=0), make_description)
    with pytest.raises(HandshakeError, match="after start"):
        _ = listener.port
    with listener:
        with pytest.raises(HandshakeError, match="twice"):
            listener.start()


def test_non_loopback_bind_without_secret_warns(caplog: pytest.LogCaptureFixture) -> None:
    config = ListenerConfig(host="0.0.0.0", port=0)
    assert not config.is_loopback and ListenerConfig(host="::1").is_loopback
    with caplog.at_level(logging.WARNING, logger="kvbridge.handshake.listener"):
        with HandshakeListener(config, make_description):
            pass
    assert "without a shared secret" in caplog.text


def test_default_port_and_config_validation() -> None:
    assert default_port(0) == 5600 and default_port(3) == 5603
    with pytest.raises(HandshakeError, match="port=70000"):
        ListenerConfig(port=70000)
