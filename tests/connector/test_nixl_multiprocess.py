"""NixlTransferEngine between real OS processes: read, peer death, recovery.

The child (``kvbridge.examples.nixl_peer``) registers blocks of known bytes and reports its
metadata, descriptors and every notification it receives as ``@@ {json}`` lines on stdout.
Each child is SIGKILLed in ``finally`` whatever happens, and exits by itself if the parent
dies (stdin closes).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge.connector.transfer.errors import PeerDisconnectedError, TransferError
from kvbridge.connector.transfer.nixl_engine import NixlEngineConfig, NixlTransferEngine
from kvbridge.connector.transfer.transport import DescList, XferState, wait_done
from kvbridge.examples.nixl_peer import Peer, block_bytes_of

pytestmark = pytest.mark.integration

NUM_BLOCKS = 256
BLOCK_BYTES = 4096
TIMEOUT_S = 10.0


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    peers: list[Peer] = []

    def start(seed: int, num_blocks: int = NUM_BLOCKS, block_bytes: int = BLOCK_BYTES) -> Peer:
        name = f"prefill-0-{uuid.uuid4().hex[:8]}"
        peers.append(Peer(name, seed, tmp_path / f"{name}.log", num_blocks, block_bytes))
        return peers[-1]

    try:
        yield start
    finally:
        for peer in peers:
            peer.kill()


@pytest.fixture
def decode() -> Iterator[NixlTransferEngine]:
    with NixlTransferEngine(
        NixlEngineConfig(agent_name=f"decode-0-{uuid.uuid4().hex[:8]}")
    ) as engine:
        yield engine


def _local_cache(
    engine: NixlTransferEngine, num_blocks: int = NUM_BLOCKS, block_bytes: int = BLOCK_BYTES
) -> tuple[torch.Tensor, DescList]:
    cache = torch.zeros(num_blocks, block_bytes, dtype=torch.uint8)
    engine.register([cache])
    descs = np.zeros((num_blocks, 3), dtype=np.int64)
    descs[:, 0] = cache.data_ptr() + np.arange(num_blocks) * block_bytes
    descs[:, 1] = block_bytes
    return cache, engine.prep_local(descs)


def _read_and_check(engine, local, cache, peer: Peer, notif: bytes) -> None:
    """READ a shuffled subset from ``peer``; check bytes and that the child got ``notif``."""
    agent = engine.add_peer(peer.metadata)
    assert agent == peer.agent_name
    remote = engine.prep_remote(agent, peer.descs)
    rng = np.random.default_rng(peer.seed)
    remote_idx = rng.permutation(NUM_BLOCKS)[:64]
    local_idx = rng.permutation(NUM_BLOCKS)[:64]
    handle = engine.read(local, local_idx, remote, remote_idx, notif=notif)
    wait_done(engine, handle, timeout_s=TIMEOUT_S)
    expected = block_bytes_of(peer.seed, NUM_BLOCKS, BLOCK_BYTES)
    assert torch.equal(cache[local_idx], expected[remote_idx])
    assert peer.next_msg() == {"notif_from": engine.agent_name, "notif": notif.decode()}
    handle.release()


def test_read_from_child_then_survive_its_death(spawn, decode: NixlTransferEngine) -> None:
    cache, local = _local_cache(decode)
    first = spawn(seed=11)
    _read_and_check(decode, local, cache, first, b"req-1")
    remote = decode.prep_remote(first.agent_name, first.descs)
    decode.send_notif(first.agent_name, b"ping")
    assert first.next_msg() == {"notif_from": decode.agent_name, "notif": "ping"}

    assert not decode.peer_gone(first.agent_name)  # alive: nothing says otherwise
    first.kill()
    killed_at = time.monotonic()
    error: TransferError | None = None
    while error is None and time.monotonic() - killed_at < TIMEOUT_S:
        try:
            handle = decode.read(local, np.arange(8), remote, np.arange(8))
            wait_done(decode, handle, timeout_s=TIMEOUT_S)
            handle.release()
        except TransferError as exc:
            error = exc
    assert isinstance(error, PeerDisconnectedError), repr(error)
    assert first.agent_name in str(error) and "nixlRemoteDisconnectError" in str(error)
    assert decode.num_live_handles == 0  # a failed post frees its own handle
    with pytest.raises(PeerDisconnectedError, match=first.agent_name):
        decode.send_notif(first.agent_name, b"ping")  # the cheap liveness probe

    decode.remove_peer(first.agent_name)
    assert remote.released and decode.peers == ()
    # the disconnect NIXL reported is what proves nothing more lands: kept after removal
    assert decode.peer_gone(first.agent_name)
    second = spawn(seed=22)
    _read_and_check(decode, local, cache, second, b"req-2")
    assert decode.peers == (second.agent_name,)


def test_in_flight_read_cancels_and_fails_on_peer_death(
    spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under the default transport (cma) transfer() copies synchronously; tcp keeps a large
    # READ in flight long enough to cancel it or kill the peer under it. The child
    # inherits the variable; the parent's agent reads it when its UCX context is created.
    monkeypatch.setenv("UCX_TLS", "tcp")
    num_blocks, block_bytes = 32, 4 << 20  # 128 MiB: ~0.1-0.4 s over loopback tcp
    child = spawn(seed=3, num_blocks=num_blocks, block_bytes=block_bytes)
    with NixlTransferEngine(NixlEngineConfig(agent_name=f"decode-0-{uuid.uuid4().hex[:8]}")) as e:
        cache, local = _local_cache(e, num_blocks, block_bytes)
        remote = e.prep_remote(e.add_peer(child.metadata), child.descs)
        every = np.arange(num_blocks)

        cancelled = e.read(local, every, remote, every)
        assert e.poll(cancelled) is XferState.PENDING
        cancelled.release()  # cancels the in-flight READ

        handle = e.read(local, every, remote, every)
        assert e.poll(handle) is XferState.PENDING
        child.kill()
        killed_at = time.monotonic()
        with pytest.raises(PeerDisconnectedError, match=child.agent_name):
            wait_done(e, handle, timeout_s=TIMEOUT_S)
        assert time.monotonic() - killed_at < TIMEOUT_S
        handle.release()
        assert not bool(cache.all())  # the READ never completed
