"""A worker's side channel does not grow on its requesters' account.

A real side channel (listener, real NIXL engine) asked by many requesters, as restarted
decodes, probes and an unauthenticated flood would: the listener's queue refuses what it
cannot hold (``ErrorCode.BUSY``) and keeps serving; the requesters' agents are bounded, and
an agent added to NIXL and idle is removed from it (added again at its next notification).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.agent_gate import AgentGate
from kvbridge.connector.worker.nixl_setup import nixl_engine
from kvbridge.connector.worker.peer_setup import PeerSetup
from kvbridge.connector.worker.requester_agents import IDLE_S, RequesterAgents
from kvbridge.connector.worker.side_channel import SideChannel
from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.description import WorkerIdentity
from kvbridge.handshake.errors import ErrorCode, PeerError
from kvbridge.handshake.messages import PROTOCOL_VERSION, MetadataRequest
from kvbridge.handshake.modes import TransferMode
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.layout import KVLayout
from tests.connector.pair_harness import FakeClock
from tests.handshake.plan_harness import make_groups


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    engine = nixl_engine("prefill-r0-bounds")
    yield engine
    engine.close()


_SETUPS: dict[int, PeerSetup] = {}  # engine id -> its set-up thread (closed with the side)


def _setup(engine: object) -> PeerSetup:
    setup = _SETUPS.get(id(engine))
    if setup is None:
        setup = _SETUPS[id(engine)] = PeerSetup(engine, AgentGate(), handshake_threads=1)  # type: ignore[arg-type]
    return setup


def _settled(setup: PeerSetup) -> None:
    """Wait until the set-up thread ran every job asked for so far (it runs them in order)."""
    ran = threading.Event()
    setup.nixl(ran.set)
    assert ran.wait(10.0), "timed out waiting for the set-up thread's jobs"


def _ensured(side: SideChannel, name: str) -> bool:
    """``ensure_agent`` as a notification would, waiting for the add it asks for."""
    if side.ensure_agent(name):
        return True
    _settled(side._setup)
    return side.ensure_agent(name)


@pytest.fixture(autouse=True)
def _close_setups() -> Iterator[None]:
    yield
    for setup in _SETUPS.values():
        setup.close()
    _SETUPS.clear()


def _side_channel(engine: TransferEngine, clock: FakeClock) -> SideChannel:
    kv = KVCacheConfig.uniform(make_groups(16, "F"), 8)
    buffers = KVCacheBuffers(kv, CacheFormat(layout=KVLayout.NHD, cross_layer=True), "cpu")
    engine.register(buffers.tensors)
    config = KVTransferConfig.from_dict(
        {"kv_role": "kv_producer", "engine_id": "prefill", "kv_port": 0}
    )
    identity = WorkerIdentity(
        engine_id="prefill",
        agent_name=engine.agent_name,
        model_name="m",
        dtype="float16",
        num_layers=kv.num_layers,
        num_kv_heads=2,
        head_size=4,
    )
    return SideChannel(
        config,
        identity,
        buffers,
        engine,
        _setup(engine),
        rewrites_in_place=True,
        transfer_mode=TransferMode.PULL,
        can_repack=False,
        rewrites_on_save=False,
        clock=clock,
    )


@pytest.fixture
def side(engine: TransferEngine, clock: FakeClock) -> Iterator[SideChannel]:
    side = _side_channel(engine, clock)
    yield side
    side.close()


def _ask(side: SideChannel, agent: str, metadata: bytes = b"m" * 100) -> None:
    """Handshake with ``side`` as requester ``agent`` (raises the listener's refusal)."""
    request = MetadataRequest(
        protocol_version=PROTOCOL_VERSION,
        requester_engine_id="decode",
        requester_agent_name=agent,
        requester_nixl_metadata=metadata,
    )
    client = HandshakeClient(ClientConfig(timeout_s=2.0, retries=0), request=request)
    try:
        client.fetch("127.0.0.1", side.port)
    finally:
        client.close()


def test_a_full_request_queue_refuses_with_busy_and_the_listener_keeps_serving(
    engine, clock, monkeypatch
):
    monkeypatch.setattr("kvbridge.handshake.listener.MAX_QUEUED_REQUESTS", 4)
    side = _side_channel(engine, clock)  # its worker does not step: nothing is taken
    try:
        for i in range(4):
            _ask(side, f"decode-{i}")
        with pytest.raises(PeerError) as refused:
            _ask(side, "decode-4")
        assert refused.value.code is ErrorCode.BUSY
        assert side.listener.stats().errors[ErrorCode.BUSY] == 1
        side.add_requesters()  # the worker steps: the queue empties
        _ask(side, "decode-5")
        assert side.listener.is_alive and side.listener.stats().served == 5
    finally:
        side.close()


def test_requesters_that_never_notify_are_bounded(engine, clock, monkeypatch):
    """Restarted decodes and probes: every one a new agent name, none ever notified."""
    monkeypatch.setattr("kvbridge.connector.worker.requester_agents.MAX_AGENTS", 3)
    side = _side_channel(engine, clock)
    try:
        for i in range(10):
            _ask(side, f"decode-{i}-restarted")
        side.add_requesters()
        assert len(side.agents) == 3 and side.agents.num_evicted == 7
        assert side.agents.num_kept_bytes == 300  # the 3 newest
        assert side.ensure_agent("decode-0-restarted")  # evicted: nothing to add
        assert side.agents.num_added == 0
    finally:
        side.close()


def test_an_idle_requester_agent_is_removed_from_nixl_and_added_again_when_notified(
    side, engine, clock
):
    decode = nixl_engine("decode-r0-idle")
    try:
        name = decode.agent_name
        _ask(side, name, decode.metadata())
        side.add_requesters()
        assert name not in engine.peers  # added only at the first notification
        assert not side.ensure_agent(name)  # on the set-up thread: the message waits
        assert _ensured(side, name)
        assert name in engine.peers

        clock.now += IDLE_S - 1  # notified within IDLE_S: a claim may still be live
        side.add_requesters()
        _settled(side._setup)
        assert name in engine.peers
        assert side.ensure_agent(name)  # notified again (a claim answered): idle from now
        clock.now += IDLE_S
        side.add_requesters()
        _settled(side._setup)
        assert name not in engine.peers and side.agents.num_removed == 1

        assert _ensured(side, name)  # it notifies us after all: added again from its metadata
        assert name in engine.peers
    finally:
        decode.close()


class _Engine:
    def __init__(self) -> None:
        self.peers: set[str] = set()

    def add_peer(self, metadata: bytes) -> str:
        self.peers.add(metadata.decode())
        return metadata.decode()

    def remove_peer(self, peer: str) -> None:
        self.peers.discard(peer)


def _added(agents: RequesterAgents, setup: PeerSetup, name: str) -> None:
    assert not agents.ensure(name)
    _settled(setup)
    assert agents.ensure(name)


def test_an_agent_a_peer_directory_holds_is_never_removed(clock):
    engine = _Engine()
    setup = _setup(engine)
    agents = RequesterAgents(setup, held=lambda name: name == "held", clock=clock)
    for name in ("held", "idle"):
        agents.asked(name, name.encode())
        _added(agents, setup, name)
    clock.now += IDLE_S
    agents.prune()
    _settled(setup)
    assert engine.peers == {"held"}


def test_added_agents_are_never_evicted_and_bytes_are_bounded(clock):
    engine = _Engine()
    setup = _setup(engine)
    agents = RequesterAgents(setup, clock=clock, max_agents=100, max_bytes=10)
    agents.asked("live", b"live")
    _added(agents, setup, "live")
    for i in range(5):
        agents.asked(f"probe-{i}", f"probe{i}".encode())  # 6 bytes each
    assert agents.num_kept_bytes == 6 and len(agents) == 2  # the live one and the newest
    assert engine.peers == {"live"}


def test_a_request_reusing_a_live_agents_name_changes_nothing_it_was_added_with(clock):
    """Without a secret anyone may send a handshake request naming a live decode's agent:
    the metadata that agent was added with and the layout it described stay."""
    engine = _Engine()
    setup = _setup(engine)
    agents = RequesterAgents(setup, clock=clock)
    first = object()
    agents.asked("decode-r0", b"decode-r0", first)  # type: ignore[arg-type]
    _added(agents, setup, "decode-r0")
    agents.asked("decode-r0", b"forged", object())  # type: ignore[arg-type]
    assert agents.layout("decode-r0") is first
    assert engine.peers == {"decode-r0"} and agents.num_kept_bytes == 0


def test_a_busy_listener_is_asked_again_until_it_drained_its_queue(engine, clock, monkeypatch):
    """The requester retries a ``busy`` refusal (with its backoff) instead of failing the
    peer: once the worker took the queued requests, the handshake goes through."""
    import threading
    import time

    monkeypatch.setattr("kvbridge.handshake.listener.MAX_QUEUED_REQUESTS", 1)
    side = _side_channel(engine, clock)
    try:
        _ask(side, "decode-0")  # the queue is full now
        request = MetadataRequest(
            protocol_version=PROTOCOL_VERSION,
            requester_engine_id="decode",
            requester_agent_name="decode-1",
            requester_nixl_metadata=b"m",
        )
        client = HandshakeClient(
            ClientConfig(timeout_s=2.0, retries=6, backoff_s=0.1), request=request
        )
        result: dict[str, object] = {}
        asking = threading.Thread(
            target=lambda: result.update(desc=client.fetch("127.0.0.1", side.port))
        )
        asking.start()
        deadline = time.monotonic() + 10.0
        while side.listener.stats().errors.get(ErrorCode.BUSY, 0) < 1:
            assert time.monotonic() < deadline, "timed out waiting for the busy refusal"
            time.sleep(0.01)  # polling the listener's counter, not synchronising on time
        side.add_requesters()  # the worker steps: the queue empties
        asking.join(timeout=15.0)
        assert not asking.is_alive(), "the handshake did not end after the queue drained"
        client.close()
        assert result["desc"] == side.description
    finally:
        side.close()
