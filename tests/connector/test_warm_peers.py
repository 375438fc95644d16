"""``extra.warm_peers``: handshake and NIXL connection before the first request.

A decode that lists its prefill's listener finds the peer READY (plan, descriptor lists,
NIXL connection) before any request names it, so its first load handshakes no more; a
pushing prefill that lists its decode does the same for its writes. A listener that does
not answer costs nothing but a warning: requests handshake as usual."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.connector.common.config import ConfigError
from kvbridge.connector.transfer.nixl_engine import NixlTransferEngine
from kvbridge.connector.worker.worker import KVBridgeWorker
from tests.connector.conftest import (
    MODEL,
    Cluster,
    Node,
    SideFormat,
    check_loaded,
    expectations,
    plan_request,
    transfer_config,
)

FMT = SideFormat(16, cross_layer=True)


@pytest.mark.parametrize(
    "value",
    [["127.0.0.1"], ["127.0.0.1:0"], ["127.0.0.1:x"], [":5600"], "127.0.0.1:5600", [5600]],
)
def test_a_malformed_warm_peer_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"extra\.warm_peers"):
        KVBridgeWorker(transfer_config("kv_consumer", "d", extra={"warm_peers": value}), MODEL)


def test_a_pulling_prefill_refuses_warm_peers():
    with pytest.raises(ConfigError, match="prefill in pull mode"):
        KVBridgeWorker(
            transfer_config("kv_producer", "p", extra={"warm_peers": ["127.0.0.1:5600"]}), MODEL
        )


def _until_handshaken(cluster: Cluster, node: Node, count: int) -> None:
    cluster.pump(
        [node], lambda: node.worker.metrics.handshakes >= count, f"{count} warm handshake(s)"
    )


def _load(cluster: Cluster, prefill: Node, decode: Node, seed: int) -> None:
    prefill.fill(seed)
    req = plan_request(prefill, decode, 0, 64, np.random.default_rng(seed))
    before = expectations(prefill, decode, req)
    cluster.transfer(prefill, decode, req)
    check_loaded(prefill, decode, req, before)


def test_a_decode_warms_its_prefill_before_the_first_request(cluster, monkeypatch):
    connected: list[str] = []
    real_connect = NixlTransferEngine.connect

    def connect(self: NixlTransferEngine, peer: str) -> None:
        connected.append(peer)
        real_connect(self, peer)

    monkeypatch.setattr(NixlTransferEngine, "connect", connect)
    prefill = cluster.new_node("kv_producer", FMT, "F")
    warm = {"warm_peers": [f"127.0.0.1:{prefill.port}"]}
    decode = cluster.new_node("kv_consumer", FMT, "F", extra=warm)

    _until_handshaken(cluster, decode, 1)
    assert connected == [prefill.worker.agent_name]  # NIXL connected ahead of time
    _load(cluster, prefill, decode, seed=5)
    assert decode.worker.metrics.handshakes == 1  # the load found the peer ready
    assert decode.worker.metrics.handshake_failures == 0


def test_a_pushing_prefill_warms_its_decode(cluster):
    decode = cluster.new_node("kv_consumer", FMT, "F", extra={"transfer_mode": "push"})
    extra = {"transfer_mode": "push", "warm_peers": [f"127.0.0.1:{decode.port}"]}
    prefill = cluster.new_node("kv_producer", FMT, "F", extra=extra)

    _until_handshaken(cluster, prefill, 1)
    _load(cluster, prefill, decode, seed=6)
    assert prefill.worker.metrics.handshakes == 1  # the push wrote without a new handshake
    assert prefill.worker.metrics.bytes_written > 0


def test_a_silent_warm_peer_is_logged_and_requests_still_load(cluster, dead_port, caplog):
    prefill = cluster.new_node("kv_producer", FMT, "F")
    extra = {"warm_peers": [f"127.0.0.1:{dead_port}"]}
    decode = cluster.new_node("kv_consumer", FMT, "F", handshake_timeout_s=0.2, extra=extra)

    cluster.pump(
        [decode],
        lambda: f"peer 127.0.0.1:{dead_port} is unreachable" in caplog.text,
        "the warning about the silent listener",
    )
    _load(cluster, prefill, decode, seed=7)
    assert decode.worker.metrics.handshakes == 1


def test_decode_starts_the_nixl_connection_at_the_handshake(cluster, monkeypatch):
    """Without warm_peers: decode connects to prefill as soon as the handshake answered
    (docs/handover.md: a first READ on an unconnected endpoint waits for the other side's
    UCX progress); prefill does not connect back (both connecting at once is where a
    prefill worker froze in CI)."""
    connected: list[tuple[str, str]] = []
    real_connect = NixlTransferEngine.connect

    def connect(self: NixlTransferEngine, peer: str) -> None:
        connected.append((self.agent_name, peer))
        real_connect(self, peer)

    monkeypatch.setattr(NixlTransferEngine, "connect", connect)
    prefill = cluster.new_node("kv_producer", FMT, "F")
    decode = cluster.new_node("kv_consumer", FMT, "F")
    _load(cluster, prefill, decode, seed=8)
    p, d = prefill.worker.agent_name, decode.worker.agent_name
    assert connected == [(d, p)]


def test_prefill_adds_a_requesting_decode_only_when_it_first_notifies_it(cluster, monkeypatch):
    """Right after the handshake the decode is adding prefill's agent; prefill adds the
    decode's only when it first notifies it (the answer to the claim), by which time the
    decode has reached prefill through NIXL: the two never create UCX endpoints to each
    other at once (suspected in CI holds of 17-62 s, docs/handover.md)."""
    added: list[tuple[str, bool]] = []  # (adding agent, whether it had received a notif)
    received: set[str] = set()
    real_add, real_notifs = NixlTransferEngine.add_peer, NixlTransferEngine.get_notifs

    def add_peer(self: NixlTransferEngine, metadata: bytes) -> str:
        added.append((self.agent_name, self.agent_name in received))
        return real_add(self, metadata)

    def get_notifs(self: NixlTransferEngine) -> dict[str, list[bytes]]:
        notifs = real_notifs(self)
        if any(notifs.values()):
            received.add(self.agent_name)
        return notifs

    monkeypatch.setattr(NixlTransferEngine, "add_peer", add_peer)
    monkeypatch.setattr(NixlTransferEngine, "get_notifs", get_notifs)
    prefill = cluster.new_node("kv_producer", FMT, "F")
    decode = cluster.new_node("kv_consumer", FMT, "F")
    _load(cluster, prefill, decode, seed=9)
    p, d = prefill.worker.agent_name, decode.worker.agent_name
    # decode added prefill at the handshake; prefill added decode once, after the claim
    assert [a for a, _ in added] == [d, p]
    assert added[1] == (p, True)
