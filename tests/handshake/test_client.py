"""HandshakeClient over real ZMQ/TCP on 127.0.0.1: caching, timeouts, refusals, auth."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.errors import (
    AuthenticationError,
    HandshakeError,
    HandshakeTimeoutError,
    PeerAuthenticationError,
    PeerError,
    ProtocolError,
    UnsupportedVersionError,
)
from kvbridge.handshake.framing import MAGIC, AuthHeader, FrameCodec, HandshakeSecurity
from kvbridge.handshake.listener import HandshakeListener, ListenerConfig
from kvbridge.handshake.messages import PROTOCOL_VERSION, ErrorCode, WorkerDescription, encode
from tests.handshake.descriptions import make_description
from tests.ports import dead_port

SECRET = b"s" * 32
FAST = ClientConfig(timeout_s=5.0, retries=0)


def serve(
    engine_id: str = "prefill-0", rank: int = 0, secret: bytes | None = None
) -> HandshakeListener:
    description = make_description(engine_id, rank)
    config = ListenerConfig(port=0, security=HandshakeSecurity(secret=secret))
    return HandshakeListener(config, lambda: description).start()


@pytest.fixture
def listener() -> Iterator[HandshakeListener]:
    lis = serve()
    yield lis
    lis.close()


def test_get_caches_per_engine_and_rank(listener: HandshakeListener) -> None:
    with HandshakeClient(FAST) as client:
        first = client.get("prefill-0", 0, "127.0.0.1", listener.port)
        assert first == make_description()
        assert client.get("prefill-0", 0, "127.0.0.1", listener.port) is first
    assert listener.stats().served == 1


def test_forget_re_handshakes_a_restarted_peer(listener: HandshakeListener) -> None:
    with HandshakeClient(FAST) as client:
        client.get("prefill-0", 0, "127.0.0.1", listener.port)
        listener.close()
        restarted = make_description()
        restarted = msgspec.structs.replace(restarted, agent_name="prefill-0-agent-0-v2")
        config = ListenerConfig(port=0)
        with HandshakeListener(config, lambda: restarted) as again:
            client.forget("prefill-0", 0)
            got = client.get("prefill-0", 0, "127.0.0.1", again.port)
            assert got.agent_name == "prefill-0-agent-0-v2"


def test_get_refuses_a_peer_that_is_someone_else(listener: HandshakeListener) -> None:
    with HandshakeClient(FAST) as client:
        with pytest.raises(HandshakeError, match="as engine 'prefill-0' rank 0, expected"):
            client.get("prefill-0", 1, "127.0.0.1", listener.port)
        with pytest.raises(HandshakeError, match="expected engine 'other' rank 0"):
            client.get("other", 0, "127.0.0.1", listener.port)


def test_fifty_concurrent_clients_get_the_right_description(
    listener: HandshakeListener,
) -> None:
    num_clients = 50
    barrier = threading.Barrier(num_clients, timeout=30)
    results: list[WorkerDescription | BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            with HandshakeClient(ClientConfig(timeout_s=10.0, retries=0)) as client:
                barrier.wait()
                result: WorkerDescription | BaseException = client.fetch("127.0.0.1", listener.port)
        except BaseException as exc:
            result = exc
        with lock:
            results.append(result)

    threads = [threading.Thread(target=run) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert results == [make_description()] * num_clients
    assert listener.stats().served == num_clients


def test_one_client_shared_by_threads_caches_each_peer_once() -> None:
    peers = [serve(rank=rank) for rank in range(2)]
    try:
        with HandshakeClient(FAST) as client:
            ranks = [i % 2 for i in range(16)]

            def get(rank: int) -> None:
                got = client.get("prefill-0", rank, "127.0.0.1", peers[rank].port)
                assert got == make_description(rank=rank)

            threads = [threading.Thread(target=get, args=(rank,)) for rank in ranks]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            for rank in range(2):  # cached: port 1 is never contacted
                assert client.get("prefill-0", rank, "127.0.0.1", 1) == make_description(rank=rank)
    finally:
        for peer in peers:
            peer.close()
    assert sum(peer.stats().served for peer in peers) >= 2


def assert_times_out(port: int) -> None:
    config = ClientConfig(timeout_s=0.2, retries=1, backoff_s=0.05)
    with HandshakeClient(config) as client:
        started = time.monotonic()
        with pytest.raises(HandshakeTimeoutError, match=f"127.0.0.1:{port} after 2 attempt"):
            client.fetch("127.0.0.1", port)
        elapsed = time.monotonic() - started
    assert config.max_wait_s == pytest.approx(0.45)
    assert 0.4 <= elapsed < config.max_wait_s + 1.0


def test_dead_port_times_out_naming_the_peer() -> None:
    with dead_port() as port:
        assert_times_out(port)


def test_silent_router_times_out_naming_the_peer() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        assert_times_out(port)
        # It was silent, not unreachable: both attempts arrived.
        received = [router.recv_multipart() for _ in range(2) if router.poll(1000)]
        assert len(received) == 2 and all(frames[1] == MAGIC for frames in received)
    finally:
        router.close(linger=0)
        ctx.term()


FakeHandler = Callable[[list[bytes]], list[bytes]]


def fake_peer(handler: FakeHandler) -> tuple[int, Callable[[], None]]:
    """A ROUTER that answers one request with ``handler(frames)``; returns (port, join)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def run() -> None:
        if router.poll(5000):
            identity, *frames = router.recv_multipart()
            router.send_multipart([identity, *handler(frames)])

    thread = threading.Thread(target=run)
    thread.start()

    def join() -> None:
        thread.join(timeout=10)
        router.close(linger=0)
        ctx.term()

    return port, join


def fetch_from_fake(handler: FakeHandler, security: HandshakeSecurity) -> WorkerDescription:
    port, join = fake_peer(handler)
    try:
        with HandshakeClient(ClientConfig(timeout_s=5.0, retries=2, security=security)) as c:
            return c.fetch("127.0.0.1", port)
    finally:
        join()


def request_nonce(frames: list[bytes]) -> bytes:
    return msgspec.msgpack.decode(frames[1], type=AuthHeader).nonce


def test_reply_signed_with_another_secret_is_refused() -> None:
    def reply(frames: list[bytes]) -> list[bytes]:
        wrong = FrameCodec(HandshakeSecurity(secret=b"w" * 32))
        return wrong.seal(encode(make_description()), in_reply_to=request_nonce(frames))[0]

    with pytest.raises(AuthenticationError, match=r"reply from 127\.0\.0\.1:\d+.*HMAC"):
        fetch_from_fake(reply, HandshakeSecurity(secret=SECRET))


def test_reply_bound_to_another_request_is_refused() -> None:
    def reply(frames: list[bytes]) -> list[bytes]:
        right = FrameCodec(HandshakeSecurity(secret=SECRET))
        return right.seal(encode(make_description()), in_reply_to=b"x" * 16)[0]

    with pytest.raises(AuthenticationError, match="does not match its request"):
        fetch_from_fake(reply, HandshakeSecurity(secret=SECRET))


def test_unauthenticated_description_is_refused_by_a_client_with_a_secret() -> None:
    def reply(frames: list[bytes]) -> list[bytes]:
        return [MAGIC, encode(make_description())]

    with pytest.raises(AuthenticationError, match="no authentication header"):
        fetch_from_fake(reply, HandshakeSecurity(secret=SECRET))


def test_malformed_reply_is_a_protocol_error_without_retry() -> None:
    with pytest.raises(ProtocolError, match=r"reply from 127\.0\.0\.1:\d+: malformed reply"):
        fetch_from_fake(lambda frames: [MAGIC, b"\xc1junk"], HandshakeSecurity())


def test_reply_of_another_protocol_version_is_refused() -> None:
    future = msgspec.structs.replace(make_description(), protocol_version=PROTOCOL_VERSION + 1)
    with pytest.raises(UnsupportedVersionError, match=f"protocol version {PROTOCOL_VERSION + 1}"):
        fetch_from_fake(lambda frames: [MAGIC, encode(future)], HandshakeSecurity())


def test_unauthenticated_client_gets_authentication_error_from_the_error_reply() -> None:
    with serve(secret=SECRET) as listener, HandshakeClient(FAST) as client:
        with pytest.raises(AuthenticationError, match="no authentication header") as info:
            client.fetch("127.0.0.1", listener.port)
        assert isinstance(info.value, PeerAuthenticationError)
        assert info.value.code is ErrorCode.UNAUTHENTICATED
        assert listener.stats().errors == {ErrorCode.UNAUTHENTICATED: 1}


def test_wrong_secret_client_is_refused_by_the_listener() -> None:
    wrong = ClientConfig(timeout_s=5.0, security=HandshakeSecurity(secret=b"w" * 32))
    with serve(secret=SECRET) as listener, HandshakeClient(wrong) as client:
        with pytest.raises(PeerAuthenticationError, match="HMAC mismatch") as info:
            client.fetch("127.0.0.1", listener.port)
        assert not info.value.authenticated  # the listener could not sign for us
        assert listener.stats().errors == {ErrorCode.UNAUTHENTICATED: 1}  # no retries


def test_matching_secrets_handshake() -> None:
    right = ClientConfig(timeout_s=5.0, security=HandshakeSecurity(secret=SECRET))
    with serve(secret=SECRET) as listener, HandshakeClient(right) as client:
        assert client.fetch("127.0.0.1", listener.port) == make_description()


def test_peer_error_carries_code_and_reason() -> None:
    def describe() -> WorkerDescription:
        raise ValueError("not ready")

    with HandshakeListener(ListenerConfig(port=0), describe) as listener:
        with HandshakeClient(FAST) as client, pytest.raises(PeerError) as info:
            client.fetch("127.0.0.1", listener.port)
    assert info.value.code is ErrorCode.INTERNAL and info.value.authenticated
    assert "not ready" in info.value.reason and f":{listener.port}" in str(info.value)


def test_fetch_after_close_and_config_validation() -> None:
    client = HandshakeClient()
    client.close()
    client.close()
    with pytest.raises(HandshakeError, match="after close"):
        client.fetch("127.0.0.1", 1)
    with pytest.raises(HandshakeError, match="timeout_s=0"):
        ClientConfig(timeout_s=0)
