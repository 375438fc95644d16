"""A load lands by the plan its READs were posted with, not by the peer as it is now.

Two full connectors in one process (``pair_harness``); decode's READs go through a
``LateTransport`` so the test can drop decode's peer and handshake with it again after the
READ was posted and before the load completes. Prefill's blocks (16 tokens) are smaller
than decode's (64), so decode merges the cross-layer chunks it read after the load (a
receiver rewrite): landing without the plan would report the load with its blocks still in
wire arrangement.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.decode.receiver import Receiver
from kvbridge.connector.worker.nixl_setup import nixl_engine
from kvbridge.connector.worker.peers import Peer, PeerState
from kvbridge.layouts.allocation import CacheFormat, read_group_token_major
from kvbridge.layouts.layout import KVLayout
from tests.connector.late_transport import LateTransport
from tests.connector.pair_harness import (
    FakeClock,
    Request,
    Side,
    decode_admit,
    failed,
    loaded,
    make_side,
    prefill_finish,
    run_until,
    token_ids,
)

FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side, LateTransport]]:
    clock = FakeClock()
    transports: list[LateTransport] = []

    def factory(name: str) -> LateTransport:
        transports.append(LateTransport(nixl_engine(name)))
        return transports[-1]

    prefill = make_side("kv_producer", "prefill", 16, FMT, "F", clock, lease_s=30.0)
    try:
        decode = make_side("kv_consumer", "decode", 64, FMT, "F", clock, engine_factory=factory)
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        yield prefill, decode, transports[0]
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def _receiver(side: Side) -> Receiver:
    receiver = side.worker._receiver
    assert receiver is not None
    return receiver


def _read_landed_then_peer_handshaking_again(
    prefill: Side, decode: Side, late: LateTransport
) -> tuple[Request, Request]:
    """Post the READ, let prefill answer its claim and the READ land; then leave decode's
    peer entry as a drop and a new handshake that has not answered yet leave it."""
    p = Request("p1", token_ids(200), KVTransferParams(do_remote_decode=True))
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    assert decode_admit(decode, d) == 199
    receiver = _receiver(decode)
    run_until([decode, prefill], lambda: late.num_in_flight > 0, "decode's READ to be posted")
    src = receiver._loads["d1"].sources[0]
    run_until([prefill, decode], lambda: src.held_until > 0, "prefill to answer the claim")
    peer = receiver._peers.get(src.key)
    assert peer is not None and peer.plan is not None
    assert any(g.receiver for g in peer.plan.groups), "the test needs a receiver rewrite"
    late.land(prefill.step)
    # The directory's entry for the key is now a new peer still handshaking, as a drop and
    # a re-ensure leave it. Under TP the source dropped is one whose READs already ended
    # (its handles released) while another source still reads; here the one source's READ
    # has landed and is polled next, so the drop's release of its handle is left out.
    receiver._peers._peers[src.key] = again = Peer(key=src.key, host=peer.host, port=peer.port)
    assert again.state is PeerState.CONNECTING and again.plan is None
    return p, d


def test_a_load_lands_by_the_plan_its_reads_were_posted_with(pair):
    prefill, decode, late = pair
    p, d = _read_landed_then_peer_handshaking_again(prefill, decode, late)
    rewrites = decode.worker.metrics.receiver_rewrites

    decode.step()

    assert loaded(decode, "d1") and not failed(decode, "d1")
    assert decode.worker.metrics.receiver_rewrites > rewrites
    want = read_group_token_major(prefill.buffers, 0, np.array(p.block_ids[0][:13]))
    got = read_group_token_major(decode.buffers, 0, np.array(d.block_ids[0][:4]))
    assert torch.equal(got[:, :, :199], want[:, :, :199]), "loaded in wire arrangement"


def test_a_load_whose_source_has_no_plan_fails_and_is_never_reported_loaded(pair):
    prefill, decode, late = pair
    _read_landed_then_peer_handshaking_again(prefill, decode, late)
    _receiver(decode)._loads["d1"].sources[0].plan = None

    run_until([decode], lambda: bool(failed(decode, "d1")), "the load to fail")

    assert not loaded(decode, "d1")
    assert "carries no plan" in failed(decode, "d1")[0].reason
