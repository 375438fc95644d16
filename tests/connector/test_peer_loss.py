"""Only a confirmed disconnect drops a peer; a failed message fails alone.

Two full connectors in one process (``pair_harness``, real NIXL). A message of ours that
cannot be encoded (over the notification limit) fails that message, never the peer; a
burst of waiting requests heartbeats its prefill in chunks; a READ whose handle was
released while its prefill was merely unreachable stays quarantined (its blocks out of
the engine's hands) until the prefill is confirmed gone, and past
``extra.max_quarantined_mib`` no new load starts from that prefill.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import msgspec
import pytest

from kvbridge.connector.common.notifications import (
    MAX_NOTIFICATION_BYTES,
    Heartbeat,
    encode_notification,
)
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.outbox import split_heartbeat
from kvbridge.connector.worker.peers import PeerState
from kvbridge.layouts.allocation import CacheFormat
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
from tests.connector.test_block_ownership import _late_pair, _start_load

FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
PREFILL = ("prefill", 0)
NUM_WAITING = 1400  # a burst queued on one prefill (issue 38: ~1,300 broke it)


def vllm_request_id(i: int) -> str:
    """As long as vLLM's ids (``chatcmpl-`` + 32 hex + suffix): 48 characters."""
    return f"chatcmpl-{uuid.UUID(int=i).hex}-{i:06d}"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pair(clock: FakeClock) -> Iterator[tuple[Side, Side]]:
    prefill = make_side("kv_producer", "prefill", 16, FMT, "F", clock, num_blocks=1600)
    try:
        decode = make_side("kv_consumer", "decode", 16, FMT, "F", clock, num_blocks=1600)
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        yield prefill, decode
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_a_heartbeat_over_the_limit_is_split_into_messages_that_fit() -> None:
    ids = [vllm_request_id(i) for i in range(NUM_WAITING)]
    assert len(msgspec.msgpack.encode(Heartbeat(request_ids=ids))) > MAX_NOTIFICATION_BYTES
    chunks = split_heartbeat(ids)
    assert len(chunks) == 2
    assert all(len(encode_notification(m)) <= MAX_NOTIFICATION_BYTES for m in chunks)
    assert [rid for m in chunks for rid in m.request_ids] == ids


def test_1400_waiting_requests_keep_their_prefill_and_their_leases(clock, pair):
    """Decode heartbeats 1,400 requests waiting for blocks (vLLM-length ids) to one
    prefill every heartbeat_s for twice the lease: every heartbeat arrives, no lease runs
    out, the peer is never dropped, and then every load succeeds."""
    prefill, decode = pair
    waiting = []
    for i in range(NUM_WAITING):
        p = Request(vllm_request_id(i), token_ids(16, i), KVTransferParams(do_remote_decode=True))
        waiting.append(Request(f"d{i}", p.prompt_token_ids, prefill_finish(prefill, p)))
    for d in waiting:
        decode.sched.get_num_new_matched_tokens(d, 0)
    prefill.step()
    lease_s = prefill.sched.config.lease_s
    heartbeat_s = decode.sched.config.heartbeat_s
    for _ in range(int(2 * lease_s / heartbeat_s)):
        clock.now += heartbeat_s
        for d in waiting:
            decode.sched.request_waiting(d)
        decode.step()
        m = decode.worker.metrics
        run_until(
            [decode, prefill],
            lambda m=m: (
                m.notifications_sent == m.heartbeats_sent
                and prefill.worker.metrics.notifications_received == m.heartbeats_sent
            ),
            "every heartbeat to reach prefill",
            timeout_s=5.0,
        )
    assert decode.worker.metrics.heartbeats_sent >= 2 * int(2 * lease_s / heartbeat_s)
    assert decode.worker.metrics.notifications_failed == 0
    assert prefill.worker.metrics.leases_expired == 0 and not prefill.freed
    peer = decode.worker._peers.get(PREFILL)
    assert peer is not None and peer.state is PeerState.READY
    assert decode.worker._peers.handshakes == 1, "the prefill was dropped and handshaken again"

    for d in waiting:
        decode_admit(decode, d)
    run_until(
        [decode, prefill],
        lambda: all(loaded(decode, d.request_id) for d in waiting),
        "every load",
        timeout_s=120.0,
    )
    assert not any(failed(decode, d.request_id) for d in waiting)
    assert decode.worker._peers.handshakes == 1


def test_a_message_that_cannot_be_encoded_fails_alone(clock, pair):
    """A notification over the limit is not sent and says so; the peer stays READY with
    the same agent, and the next load needs no new handshake."""
    prefill, decode = pair
    p = Request("p0", token_ids(40), KVTransferParams(do_remote_decode=True))
    d = Request("d0", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: loaded(decode, "d0"), "the first load")
    peer = decode.worker._peers.get(PREFILL)
    assert peer is not None and peer.state is PeerState.READY
    agent = peer.agent

    huge = Heartbeat(request_ids=["x" * (MAX_NOTIFICATION_BYTES + 1)])
    assert decode.worker._outbox.send(peer, huge) is False
    assert decode.worker.metrics.notifications_failed == 1
    peer = decode.worker._peers.get(PREFILL)
    assert peer is not None and peer.state is PeerState.READY and peer.agent == agent

    p = Request("p1", token_ids(40, 1), KVTransferParams(do_remote_decode=True))
    d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: loaded(decode, "d1"), "the next load")
    assert not failed(decode, "d1")
    assert decode.worker._peers.handshakes == 1


# ------------------------------------------------------------------ quarantine


@pytest.fixture
def late_pair(clock: FakeClock) -> Iterator[tuple[Side, Side, LateTransport]]:
    yield from _late_pair(clock, "decode", {"lease_s": 120.0}, {"transfer_timeout_s": 5.0})


def _held(decode: Side) -> int:
    return decode.worker._receiver.num_held


def _drop_unconfirmed(decode: Side) -> str:
    """Forget the prefill while it is alive (no disconnect reported): its READ's handle
    is released, the READ itself still on the wire."""
    peer = decode.worker._peers.get(PREFILL)
    assert peer is not None
    agent = peer.agent
    decode.worker._peers.drop(PREFILL, "unreachable (test)")
    decode.settle()  # the agent's removal (which releases the READ's handle) ran
    return agent


def test_a_read_released_with_an_unconfirmed_peer_stays_quarantined(clock, late_pair):
    prefill, decode, late = late_pair
    _start_load(prefill, decode, late)
    agent = _drop_unconfirmed(decode)
    for _ in range(3):
        clock.now += 6.0  # past the load's deadline, and again
        decode.step()
    assert not failed(decode, "d1"), "a released READ of a live prefill counted as ended"
    assert decode.worker.metrics.loads_held == 1
    rows, num_bytes = decode.worker.metrics.quarantined[agent]
    assert rows > 0 and num_bytes > 0
    assert f'kvbridge_quarantined_bytes{{peer="{agent}"}}' in decode.worker.metrics.prometheus()

    for _ in range(3):
        clock.now += 600.0
        decode.step()
    assert not failed(decode, "d1"), "no clock gives the blocks back: only the peer's death"
    assert late.num_in_flight == 1 and _held(decode) == 1


def test_a_confirmed_dead_peers_released_reads_end(clock, late_pair):
    prefill, decode, late = late_pair
    _start_load(prefill, decode, late)
    agent = _drop_unconfirmed(decode)
    decode.step()
    assert not failed(decode, "d1") and _held(decode) == 1

    late.disconnect(agent)  # the prefill process died: nothing of it can land any more
    decode.step()
    [failure] = failed(decode, "d1")
    assert failure.num_valid_tokens == 0
    assert _held(decode) == 0 and decode.worker.metrics.quarantined == {}


def test_a_disconnect_seen_by_a_notification_drops_the_peer_and_ends_its_reads(clock, late_pair):
    """The outbox drops a peer only on a confirmed disconnect; the READs it owed end."""
    prefill, decode, late = late_pair
    _start_load(prefill, decode, late)
    peer = decode.worker._peers.get(PREFILL)
    assert peer is not None
    late.disconnect(peer.agent)
    assert decode.worker._outbox.send(peer, Heartbeat(request_ids=[])) is False
    assert decode.worker._peers.get(PREFILL).state is PeerState.FAILED
    decode.step()
    assert failed(decode, "d1") and _held(decode) == 0


def test_past_the_cap_no_new_load_starts_from_that_prefill(clock, late_pair):
    """One prefill's quarantined READs pass the cap: a new load from it fails by name at
    once; when the prefill is confirmed gone, the cap no longer applies."""
    prefill, decode, late = late_pair
    decode.worker._receiver._quarantine._max_peer_bytes = 1  # the cap: any held READ
    _start_load(prefill, decode, late)
    _drop_unconfirmed(decode)
    decode.step()
    assert _held(decode) == 1 and decode.worker.metrics.quarantine_caps == 1

    p = Request("p2", token_ids(40, 2), KVTransferParams(do_remote_decode=True))
    d = Request("d2", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: bool(failed(decode, "d2")), "the refused load")
    [failure] = failed(decode, "d2")
    assert "max_quarantined_mib" in failure.reason
    assert not loaded(decode, "d2")
