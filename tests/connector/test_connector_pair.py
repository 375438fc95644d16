"""Request lifecycle with two real connectors (scheduler + worker + NIXL) in one process.

Every test ends with both block pools full: each block was freed exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvbridge.connector.common.notifications import Done, encode_notification
from kvbridge.connector.scheduler.lifecycle import SendState
from kvbridge.layouts.allocation import CacheFormat, read_group_token_major
from kvbridge.layouts.layout import KVLayout
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

PREFILL_FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
DECODE_FMT = CacheFormat(layout=KVLayout.HND, kernel_block_size=8)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# where both sides' caches live and what NIXL moves: (device, kv_buffer_device, forced staging)
PLACEMENTS = [
    pytest.param(("cpu", "auto", None), id="cpu"),
    pytest.param(("cpu", "auto", True), id="cpu-host-staged"),
    pytest.param(("cuda", "auto", None), id="cuda", marks=pytest.mark.gpu),
    pytest.param(("cuda", "cpu", None), id="cuda-host-staged", marks=pytest.mark.gpu),
]


def _pair(
    clock: FakeClock,
    kinds: str = "F",
    placement: tuple[str, str, bool | None] = ("cpu", "auto", None),
    **decode_extra: object,
) -> Iterator[tuple[Side, Side]]:
    device, buffer_device, staging = placement
    placed: dict = {"device": device, "host_staging": staging, "kv_buffer_device": buffer_device}
    prefill = make_side(
        "kv_producer", "prefill", 64, PREFILL_FMT, kinds, clock, lease_s=30.0, **placed
    )
    decode = make_side(
        "kv_consumer", "decode", 16, DECODE_FMT, kinds, clock, **placed, **decode_extra
    )
    try:
        yield prefill, decode
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


@pytest.fixture
def pair(clock: FakeClock) -> Iterator[tuple[Side, Side]]:
    yield from _pair(clock)


@pytest.fixture(params=PLACEMENTS)
def placed_pair(clock: FakeClock, request: pytest.FixtureRequest) -> Iterator[tuple[Side, Side]]:
    yield from _pair(clock, placement=request.param)


def _finish_decode(decode: Side, req: Request) -> None:
    delay, _ = decode.sched.request_finished(req, req.block_ids)
    if not delay:
        decode.pool.free([b for ids in req.block_ids for b in ids])


def _assert_pools_full(*sides: Side) -> None:
    for s in sides:
        s.pool.assert_all_free()


def _expect_equal(prefill: Side, decode: Side, p: Request, d: Request, group: int, tokens: slice):
    bs_p = prefill.config.groups[group].spec.block_size
    bs_d = decode.config.groups[group].spec.block_size
    n_p = -(-tokens.stop // bs_p)
    n_d = -(-tokens.stop // bs_d)
    want = read_group_token_major(prefill.buffers, group, np.array(p.block_ids[group][:n_p]))
    got = read_group_token_major(decode.buffers, group, np.array(d.block_ids[group][:n_d]))
    assert torch.equal(got[:, :, tokens], want[:, :, tokens])


def test_happy_path_loads_frees_and_restores(placed_pair):
    prefill, decode = placed_pair
    p = Request("p1", token_ids(200), None)
    p.kv_transfer_params = _remote_decode()
    params = prefill_finish(prefill, p)
    before = read_group_token_major(prefill.buffers, 0, np.array(p.block_ids[0]))
    d = Request("d1", p.prompt_token_ids, params)
    assert decode_admit(decode, d) == 199  # every prompt token but the last
    run_until([prefill, decode], lambda: loaded(decode, "d1") and "p1" in prefill.freed, "load")
    _expect_equal(prefill, decode, p, d, 0, slice(0, 199))
    # prefill's rewritten blocks were restored before being freed (prefix cache stays exact)
    assert torch.equal(read_group_token_major(prefill.buffers, 0, np.array(p.block_ids[0])), before)
    assert prefill.worker.metrics.sender_rewrites > 0
    assert prefill.worker.metrics.sender_restores == prefill.worker.metrics.sender_rewrites
    _finish_decode(decode, d)
    _assert_pools_full(prefill, decode)


def test_prefill_that_may_not_rewrite_is_read_natively(clock, monkeypatch):
    """vLLM's prefill: its prefix cache may read a held block, so it is never rewritten."""
    monkeypatch.setattr("kvbridge.handshake.plan.MIN_NATIVE_PIECE_BYTES", 64)  # tiny test heads
    fmt = CacheFormat(layout=KVLayout.HND)
    prefill = make_side(
        "kv_producer", "prefill", 64, fmt, "FS", clock, lease_s=30.0, rewrites_in_place=False
    )
    decode = make_side("kv_consumer", "decode", 16, DECODE_FMT, "FS", clock)
    try:
        p = Request("p1", token_ids(200), _remote_decode())
        params = prefill_finish(prefill, p)
        snapshot = [t.clone() for t in prefill.buffers.tensors]
        d = Request("d1", p.prompt_token_ids, params)
        assert decode_admit(decode, d) == 199
        run_until([prefill, decode], lambda: loaded(decode, "d1"), "load")
        _expect_equal(prefill, decode, p, d, 0, slice(0, 199))
        assert prefill.worker.metrics.sender_rewrites == 0
        for before, after in zip(snapshot, prefill.buffers.tensors, strict=True):
            assert torch.equal(before, after)
        # one descriptor per (layer, kernel sub-block, K/V, head): 8 tokens x 4 dims x 2 B
        m = decode.worker.metrics
        assert m.bytes_read == 64 * m.descriptors_posted
        run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill freed")
        _finish_decode(decode, d)
        _assert_pools_full(prefill, decode)
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_partial_prefix_hit_reads_only_the_rest(pair):
    prefill, decode = pair
    p = Request("p1", token_ids(200), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    n = decode_admit(decode, d, num_computed=64)
    assert n == 135
    marker = decode.buffers.tensors[0].clone()
    run_until(
        [prefill, decode], lambda: loaded(decode, "d1") and "p1" in prefill.freed, "partial load"
    )  # compare once prefill restored its blocks (they were rewritten for the reader)
    _expect_equal(prefill, decode, p, d, 0, slice(64, 199))
    # the locally computed blocks (first 64 tokens = 4 decode blocks) were not written
    after = decode.buffers.tensors[0]
    for b in d.block_ids[0][:4]:
        assert torch.equal(after[b], marker[b])
    assert decode.worker.metrics.descriptors_posted == 9 * 2  # 9 chunks, 2 layers each
    _finish_decode(decode, d)
    _assert_pools_full(prefill, decode)


def test_full_local_hit_still_frees_prefill(pair):
    prefill, decode = pair
    p = Request("p1", token_ids(200), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    assert decode_admit(decode, d, num_computed=199) == 0
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "release of a full hit")
    assert decode.worker.metrics.descriptors_posted == 0
    _finish_decode(decode, d)
    _assert_pools_full(prefill, decode)


def test_abort_before_load(pair):
    prefill, decode = pair
    p = Request("p1", token_ids(150), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    decode.sched.request_aborted("d1")
    if not decode.sched.defers_free("d1"):
        decode.pool.free([b for ids in d.block_ids for b in ids])
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill free after abort")
    assert not loaded(decode, "d1")
    if "d1" in decode.freed:
        pass
    _assert_pools_full(prefill, decode)


def test_abort_while_preparing(pair):
    prefill, decode = pair
    p = Request("p1", token_ids(150), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    # decode alone: handshake, then Prepare goes out; prefill has not answered yet
    run_until([decode], lambda: decode.worker.metrics.notifications_sent >= 1, "Prepare sent")
    decode.sched.request_aborted("d1")
    assert decode.sched.defers_free("d1")
    run_until(
        [prefill, decode],
        lambda: "p1" in prefill.freed and "d1" in decode.freed,
        "both sides free after an abort mid-load",
    )
    decode.pool.free([b for ids in d.block_ids for b in ids])
    assert not loaded(decode, "d1")
    _assert_pools_full(prefill, decode)


def test_lease_expiry_frees_prefill(pair, clock):
    prefill, decode = pair
    p = Request("p1", token_ids(100), _remote_decode())
    prefill_finish(prefill, p)
    prefill.step()
    assert "p1" not in prefill.freed
    clock.now += 31.0
    prefill.step()
    prefill.step()
    assert "p1" in prefill.freed
    _assert_pools_full(prefill, decode)


def test_heartbeats_extend_the_lease(pair, clock):
    prefill, decode = pair
    p = Request("p1", token_ids(100), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode.sched.get_num_new_matched_tokens(d, 0)
    prefill.step()
    for i in range(4):  # 4 x 20 s = 80 s waiting in decode's queue, lease is 30 s
        clock.now += 20.0
        decode.sched.request_waiting(d)
        decode.step()  # queues the heartbeat (sent once the handshake is done)
        assert decode.worker.metrics.heartbeats_sent == i + 1
        run_until(
            [decode, prefill],
            lambda n=i + 1: prefill.worker.metrics.notifications_received >= n,
            f"heartbeat {i + 1} delivery",
        )
        assert "p1" not in prefill.freed
    d.block_ids = decode.allocate(len(d.prompt_token_ids))
    n = decode.sched.get_num_new_matched_tokens(d, 0)[0]
    decode.sched.update_state_after_alloc(d, d.block_ids, n)
    run_until([prefill, decode], lambda: loaded(decode, "d1") and "p1" in prefill.freed, "load")
    _finish_decode(decode, d)
    _assert_pools_full(prefill, decode)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_failure_applies_the_policy(clock, policy):
    for prefill, decode in _pair(clock, failure_policy=policy):
        p = Request("p1", token_ids(150), _remote_decode())
        params = prefill_finish(prefill, p)
        prefill.worker.shutdown()  # prefill dies: its listener and agent are gone
        d = Request("d1", p.prompt_token_ids, params)
        decode_admit(decode, d)
        run_until([decode], lambda d=decode: bool(failed(d, "d1")), "load failure", timeout_s=15)
        ev = decode.events[-1]
        outcome = ev.recompute if policy == "recompute" else ev.failed
        assert [f.request_id for f in outcome] == ["d1"]
        assert outcome[0].num_valid_tokens == 0
        assert "handshake" in outcome[0].reason
        _finish_decode(decode, d)
        decode.pool.assert_all_free()
        prefill.pool.free(prefill.sched.take_blocks_to_free("p1") or ())
        prefill.sched.request_aborted("p1")
        prefill.pool.free(prefill.sched.take_blocks_to_free("p1"))


def test_unknown_and_duplicate_notifications_are_counted(pair, clock):
    """Garbage and a Done for a request that already ended here are counted at once; a Done
    for a request prefill never held is kept a while (it may come before the request, see
    kvbridge.connector.worker.prefill.sender) and counted when it expires unused."""
    from kvbridge.connector.worker.prefill.sender import EARLY_DONE_TTL_S

    prefill, decode = pair
    p = Request("p1", token_ids(150), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until([prefill, decode], lambda: loaded(decode, "d1") and "p1" in prefill.freed, "load")
    engine = decode.worker._engine
    peer = decode.worker._peers.get(("prefill", 0))
    with decode.worker._gate.setup():  # between rounds, as a round would
        for rid in ("p1", "nope"):  # duplicate Done, then an unknown request
            engine.send_notif(peer.agent, encode_notification(Done(request_id=rid)))
        engine.send_notif(peer.agent, b"\x00garbage")
    run_until([prefill], lambda: prefill.worker.metrics.bad_notifications >= 2, "garbage")
    assert prefill.worker.metrics.bad_notifications == 2  # the garbage, the duplicate Done
    clock.now += EARLY_DONE_TTL_S + 1
    run_until([prefill], lambda: prefill.worker.metrics.bad_notifications >= 3, "expiry")
    assert prefill.worker.metrics.bad_notifications == 3
    assert prefill.freed.count("p1") == 1
    _finish_decode(decode, d)
    _assert_pools_full(prefill, decode)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_hybrid_groups_full_window_state(clock, placement):
    for prefill, decode in _pair(clock, kinds="FSM", placement=placement):
        p = Request("p1", token_ids(300), _remote_decode())
        params = prefill_finish(prefill, p)
        # no resume block from this engine: decode resumes at the last state boundary
        assert params.resume_tokens == 256
        assert len(params.remote_block_ids[0]) == 4
        d = Request("d1", p.prompt_token_ids, params)
        assert decode_admit(decode, d) == 256
        run_until(
            [prefill, decode],
            lambda p_=prefill, d_=decode: loaded(d_, "d1") and "p1" in p_.freed,
            "load",
        )
        _expect_equal(prefill, decode, p, d, 0, slice(0, 256))
        _expect_equal(prefill, decode, p, d, 1, slice(256 - 24, 256))
        # state after token 256: prefill block 256/64-1 = 3, decode block 256/16-1 = 15
        for name in ("g2.a", "g2.b"):
            lv = decode.buffers.state_views(name)
            rv = prefill.buffers.state_views(name)
            for a, b in zip(lv, rv, strict=True):
                got = a[d.block_ids[2][15]].contiguous().view(torch.uint8)
                want = b[p.block_ids[2][3]].contiguous().view(torch.uint8)
                assert torch.equal(got, want)
        _finish_decode(decode, d)
        _assert_pools_full(prefill, decode)


@pytest.mark.parametrize("num_tokens", [300, 257])
def test_a_resume_block_lets_decode_resume_at_the_last_prompt_token(clock, num_tokens):
    """Prefill 64 / decode 16 with a state group: the engine's resume block (state after
    N - 1 tokens) lands in decode's block of token N - 2; attention KV moves up to N - 1,
    the last blocks partial on both sides."""
    for prefill, decode in _pair(clock, kinds="FSM"):
        p = Request("p1", token_ids(num_tokens), _remote_decode())
        p.block_ids = prefill.allocate(num_tokens)
        [resume] = prefill.pool.allocate(1)
        delay, params = prefill.sched.request_finished(
            p, p.block_ids, resume_state_block_ids={2: resume}
        )
        assert delay and params is not None
        prefill.pool.free(prefill.sched.take_blocks_to_free("p1"))
        end = num_tokens - 1
        assert params.resume_tokens == end
        assert params.remote_block_ids[2] == [resume]
        d = Request("d1", p.prompt_token_ids, params)
        assert decode_admit(decode, d) == end
        run_until(
            [prefill, decode],
            lambda p_=prefill, d_=decode: loaded(d_, "d1") and "p1" in p_.freed,
            "load",
        )
        _expect_equal(prefill, decode, p, d, 0, slice(0, end))
        _expect_equal(prefill, decode, p, d, 1, slice(end - 24, end))
        for name in ("g2.a", "g2.b"):
            for a, b in zip(
                decode.buffers.state_views(name), prefill.buffers.state_views(name), strict=True
            ):
                got = a[d.block_ids[2][(end - 1) // 16]].contiguous().view(torch.uint8)
                assert torch.equal(got, b[resume].contiguous().view(torch.uint8))
        _finish_decode(decode, d)
        _assert_pools_full(prefill, decode)


def _remote_decode():
    from kvbridge.connector.common.params import KVTransferParams

    return KVTransferParams(do_remote_decode=True)


def test_sender_that_may_not_rewrite_refuses_a_prepare_with_rewrites(clock):
    from kvbridge.connector.common.metadata import SendSpec
    from kvbridge.connector.common.metrics import ConnectorMetrics
    from kvbridge.connector.common.notifications import GroupRewrite, Prepare, WireArrangement
    from kvbridge.connector.worker.prefill.sender import Sender
    from kvbridge.layouts.arrangement import BlockArrangement

    prefill = make_side("kv_producer", "prefill", 64, CacheFormat(layout=KVLayout.HND), "F", clock)
    try:
        snapshot = [t.clone() for t in prefill.buffers.tensors]
        sender = Sender(prefill.buffers, ConnectorMetrics(), clock=clock, rewrites_in_place=False)
        sender.add(SendSpec(request_id="r", block_ids=((3, 4),), first_block=(0,), lease_s=30.0))
        src = WireArrangement.of(BlockArrangement(layout=KVLayout.HND))
        dst = WireArrangement.of(BlockArrangement(layout=KVLayout.HND, num_chunks=4))
        reply = sender.on_prepare(Prepare(request_id="r", rewrites=[GroupRewrite(0, src, dst)]))
        assert not reply.ok and "does not rewrite blocks in place" in reply.reason
        for before, after in zip(snapshot, prefill.buffers.tensors, strict=True):
            assert torch.equal(before, after)
    finally:
        prefill.worker.shutdown()


def test_packed_pages_reach_the_engines_repacker(clock):
    """Engine-packed pages into larger decode blocks: the engine's repacker gets the
    loaded blocks (vLLM's real repack is tested in tests/connector/vllm)."""
    packed = CacheFormat(layout=KVLayout.HND, block_packing="engine-order")
    prefill = make_side("kv_producer", "prefill", 16, packed, "F", clock, lease_s=30.0)
    repacker = RecordingRepacker()
    decode = make_side(
        "kv_consumer",
        "decode",
        64,
        packed,
        "F",
        clock,
        repacker=repacker,
    )
    try:
        p = Request("p1", token_ids(200), _remote_decode())
        params = prefill_finish(prefill, p)
        d = Request("d1", p.prompt_token_ids, params)
        assert decode_admit(decode, d) == 199
        run_until([prefill, decode], lambda: loaded(decode, "d1"), "load")
        assert repacker.merges == [(0, sorted(d.block_ids[0][:4]), 16)]
        assert repacker.splits == []
        # the pages arrived side by side: local block i holds remote blocks 4i .. 4i+3
        page = prefill.buffers.layer_bytes("g0.a").shape[1]
        for i, lb in enumerate(d.block_ids[0][:3]):
            got = decode.buffers.layer_bytes("g0.a")[lb]
            for j in range(4):
                want = prefill.buffers.layer_bytes("g0.a")[p.block_ids[0][4 * i + j]]
                assert torch.equal(got[j * page : (j + 1) * page], want)
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


class RecordingRepacker:
    """Stands in for the engine's packer: records what kvbridge hands it (vLLM's real
    merge and split are tested against its kernel in tests/connector/vllm)."""

    def __init__(self) -> None:
        self.merges: list[tuple[int, list[int], int]] = []
        self.splits: list[tuple[int, list[torch.Tensor], int, np.ndarray]] = []

    def merge(self, group_id: int, block_ids: np.ndarray, remote_block_size: int) -> None:
        self.merges.append((group_id, sorted(int(b) for b in block_ids), remote_block_size))

    def split(self, group_id, pages, remote_block_size, slots, heads=None, layers=()) -> None:
        assert heads is None and not layers, (heads, layers)  # one rank, every layer
        self.splits.append((group_id, [p.clone() for p in pages], remote_block_size, slots.copy()))


PACKED = CacheFormat(layout=KVLayout.HND, block_packing="engine-order")


def _staged_pair(clock: FakeClock, staging_slots: float, kinds: str = "F"):
    """Prefill blocks of 64, decode blocks of 16, both engine-packed; decode's staging
    pool holds ``staging_slots`` remote blocks (every layer of the group)."""
    prefill = make_side("kv_producer", "prefill", 64, PACKED, kinds, clock, lease_s=30.0)
    slot = sum(
        prefill.buffers.layer_bytes(n).shape[1] for n in prefill.config.groups[0].layer_names
    )
    repacker = RecordingRepacker()
    decode = make_side(
        "kv_consumer",
        "decode",
        16,
        PACKED,
        kinds,
        clock,
        repacker=repacker,
        extra={"staging_mib": staging_slots * slot / (1 << 20)},
    )
    return prefill, decode, repacker


@pytest.mark.parametrize("num_computed", [0, 16])
def test_larger_packed_pages_are_staged_in_rounds_and_split_by_the_engine(clock, num_computed):
    """Four 64-token prefill pages through a two-slot staging pool: two rounds; the
    engine gets each page whole and the decode slot of every token it must write (a
    prefix hit of one decode block leaves that block's tokens out)."""
    prefill, decode, repacker = _staged_pair(clock, staging_slots=2.5)
    try:
        p = Request("p1", token_ids(200), _remote_decode())
        params = prefill_finish(prefill, p)
        d = Request("d1", p.prompt_token_ids, params)
        assert decode_admit(decode, d, num_computed) == 199 - num_computed
        run_until([prefill, decode], lambda: loaded(decode, "d1"), "the staged load")
        assert [len(call[1][0]) for call in repacker.splits] == [2, 2]  # pages per round
        assert repacker.merges == []
        layers = prefill.config.groups[0].layer_names
        for r, (gid, pages, size, slots) in enumerate(repacker.splits):
            assert (gid, size, len(pages)) == (0, 64, len(layers))
            for j in range(slots.shape[0]):
                rb = 2 * r + j  # remote logical block
                for name, layer_pages in zip(layers, pages, strict=True):
                    want = prefill.buffers.layer_bytes(name)[p.block_ids[0][rb]]
                    assert torch.equal(layer_pages[j], want)
                t = rb * 64 + np.arange(64)
                lids = np.asarray(d.block_ids[0])
                wanted = (t >= num_computed) & (t < 199)
                want_slots = np.where(wanted, lids[np.minimum(t, 198) // 16] * 16 + t % 16, -1)
                assert np.array_equal(slots[j], want_slots)
        assert decode.worker.metrics.receiver_rewrites == -(-(199 - num_computed) // 16)
        _finish_decode(decode, d)
        run_until([prefill, decode], lambda: prefill.sched.num_held_sends == 0, "prefill to free")
        _assert_pools_full(prefill, decode)
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_staging_pool_too_small_for_one_page_fails_the_load_by_name(clock):
    prefill, decode, repacker = _staged_pair(clock, staging_slots=0.5)
    try:
        p = Request("p1", token_ids(200), _remote_decode())
        params = prefill_finish(prefill, p)
        d = Request("d1", p.prompt_token_ids, params)
        decode_admit(decode, d)
        run_until([prefill, decode], lambda: bool(failed(decode, "d1")), "the load to fail")
        (failure,) = failed(decode, "d1")
        assert "raise extra.staging_mib" in failure.reason
        assert repacker.splits == []
        run_until([prefill, decode], lambda: prefill.sched.num_held_sends == 0, "prefill to free")
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_a_done_that_arrives_before_its_request_frees_it_when_it_comes(pair):
    """An idle engine hands its worker a finished request only with its next step; decode
    may have read and said Done already. The request is freed as soon as it arrives."""
    from kvbridge.connector.common.metadata import ConnectorMetadata, SendSpec
    from kvbridge.connector.worker.peers import PeerState

    prefill, decode = pair
    engine, peers = decode.worker._engine, decode.worker._peers
    peers.ensure(("prefill", 0), "127.0.0.1", prefill.worker.side_channel_port)
    run_until(
        [prefill, decode],
        lambda: peers.get(("prefill", 0)).state is PeerState.READY,
        "handshake",
    )
    peer = decode.worker._peers.get(("prefill", 0))
    with decode.worker._gate.setup():  # between rounds, as a round would
        engine.send_notif(peer.agent, encode_notification(Done(request_id="early")))
    run_until([prefill, decode], lambda: prefill.worker.metrics.notifications_received >= 1, "Done")
    assert prefill.worker.readers_done("early") is None
    spec = SendSpec(request_id="early", block_ids=((1, 2),), first_block=(0,), lease_s=30.0)
    prefill.worker.bind_connector_metadata(ConnectorMetadata(reqs_to_send=(spec,)))
    prefill.worker.start_load_kv()
    assert "early" in prefill.worker.get_finished().finished_sending
    assert prefill.worker.metrics.bad_notifications == 0


def test_an_incompatible_decode_tells_prefill_to_free_at_once(clock):
    """Decode cannot bridge prefill's engine-packed pages: each load fails (recompute)
    and prefill frees the request's blocks right away, never waiting for the lease (the
    fake clock never moves). The second load handshakes again."""
    prefill = make_side("kv_producer", "prefill", 64, PACKED, "F", clock, lease_s=30.0)
    decode = make_side("kv_consumer", "decode", 16, DECODE_FMT, "F", clock)
    try:
        for i in range(2):
            p = Request(f"p{i}", token_ids(200), _remote_decode())
            params = prefill_finish(prefill, p)
            d = Request(f"d{i}", p.prompt_token_ids, params)
            assert decode_admit(decode, d) == 199
            run_until(
                [prefill, decode],
                lambda p_=p, d_=d: (
                    bool(failed(decode, d_.request_id)) and p_.request_id in prefill.freed
                ),
                "the failed load and prefill's free",
            )
            [failure] = failed(decode, d.request_id)
            assert "block_packing" in failure.reason
            _finish_decode(decode, d)
            _assert_pools_full(prefill, decode)  # right after the run, lease untouched
        assert prefill.sched.send_outcomes == {SendState.DONE: 2}
        assert decode.worker.metrics.bytes_read == 0
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


SAME_FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)


def _same_format_pair(clock):
    prefill = make_side("kv_producer", "prefill", 16, SAME_FMT, "F", clock, lease_s=30.0)
    decode = make_side("kv_consumer", "decode", 16, SAME_FMT, "F", clock)
    return prefill, decode


def test_near_the_first_lease_end_decode_claims_the_blocks_before_reading(clock):
    """No rewrite is due, so decode would read at once; 25 s into prefill's 30 s lease it
    first claims the blocks (an empty Prepare, which also renews the lease), then reads."""
    prefill, decode = _same_format_pair(clock)
    try:
        p = Request("p1", token_ids(100), _remote_decode())
        params = prefill_finish(prefill, p)
        assert params.expires_at == clock.now + 30.0
        clock.now += 25.0
        d = Request("d1", p.prompt_token_ids, params)
        assert decode_admit(decode, d) == 99
        run_until([prefill, decode], lambda: loaded(decode, "d1"), "the claimed load")
        _expect_equal(prefill, decode, p, d, 0, slice(0, 99))
        _finish_decode(decode, d)
        run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free")
        assert prefill.worker.metrics.notifications_received == 2  # the claim, then Done
        _assert_pools_full(prefill, decode)
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_blocks_whose_lease_ran_out_are_never_read(clock):
    """Decode took the request at 25 s; prefill's lease (on its worker's clock, from when
    the worker got the request) ran out at 30 s before the load started. The claim is
    refused, nothing is read, decode recomputes."""
    prefill, decode = _same_format_pair(clock)
    try:
        p = Request("p1", token_ids(100), _remote_decode())
        params = prefill_finish(prefill, p)
        prefill.step()  # the worker holds it from now
        clock.now += 25.0
        d = Request("d1", p.prompt_token_ids, params)
        assert decode_admit(decode, d) == 99
        clock.now += 6.0  # before either side steps: prefill's lease is over
        run_until([prefill, decode], lambda: bool(failed(decode, "d1")), "the refused claim")
        [failure] = failed(decode, "d1")
        assert "lease expired" in failure.reason
        assert decode.worker.metrics.bytes_read == 0
        assert prefill.sched.send_outcomes == {SendState.EXPIRED: 1}
        _finish_decode(decode, d)
        _assert_pools_full(prefill, decode)
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_expired_params_are_refused_when_decode_first_sees_them(clock):
    from kvbridge.connector.common.signing import ParamsSignatureError

    prefill, decode = _same_format_pair(clock)
    try:
        p = Request("p1", token_ids(100), _remote_decode())
        params = prefill_finish(prefill, p)
        clock.now += 31.0
        with pytest.raises(ParamsSignatureError, match=r"expired 1\.0 s ago"):
            decode.sched.get_num_new_matched_tokens(Request("d1", p.prompt_token_ids, params), 0)
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


@pytest.mark.parametrize(("idle_ms", "busy_us"), [(0, 0), (2, 0), (0, 200)])
def test_an_idle_prefill_answers_prepare_from_its_idle_progress_thread(clock, idle_ms, busy_us):
    """Prefill's engine never steps after the request finished (vLLM waits for new
    requests, or runs one long forward). Decode's Prepare is answered only by the
    progress thread: its idle rounds, or its busy rounds (a request lent to readers)."""
    prefill = make_side(
        "kv_producer",
        "prefill",
        64,
        PREFILL_FMT,
        "F",
        clock,
        lease_s=30.0,
        extra={"idle_progress_ms": idle_ms, "busy_progress_us": busy_us},
    )
    decode = make_side("kv_consumer", "decode", 16, DECODE_FMT, "F", clock)
    try:
        p = Request("p1", token_ids(200), _remote_decode())
        params = prefill_finish(prefill, p)
        prefill.step()  # the step that ends the request hands the worker its SendSpec
        d = Request("d1", p.prompt_token_ids, params)
        assert decode_admit(decode, d) == 199
        if not idle_ms and not busy_us:  # nothing answers: the load waits (bounded here)
            with pytest.raises(AssertionError, match=r"timed out after 1\.5 s"):
                run_until([decode], lambda: loaded(decode, "d1"), "the load", timeout_s=1.5)
            return
        run_until([decode], lambda: loaded(decode, "d1"), "the load, prefill idle")
        run_until(
            [decode],
            lambda: prefill.worker.readers_done("p1") is None,
            "prefill's worker to take decode's Done while idle",
        )
        prefill.step()  # the engine's next step frees the blocks
        assert "p1" in prefill.freed
        _expect_equal(prefill, decode, p, d, 0, slice(0, 199))
        _finish_decode(decode, d)
        _assert_pools_full(prefill, decode)
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_a_prepare_that_arrives_before_the_request_waits_for_it(clock):
    """vLLM hands its worker a finished request one step later; an idle-progress thread
    may read a decode's Prepare (here a claim) before that. It is answered once the
    request is added, not refused as unknown."""
    prefill = make_side(
        "kv_producer",
        "prefill",
        16,
        SAME_FMT,
        "F",
        clock,
        lease_s=30.0,
        extra={"idle_progress_ms": 2},
    )
    decode = make_side("kv_consumer", "decode", 16, SAME_FMT, "F", clock)
    try:
        p = Request("p1", token_ids(100), _remote_decode())
        params = prefill_finish(prefill, p)  # the SendSpec waits for prefill's next step
        clock.now += 25.0  # near the lease end: decode claims first
        d = Request("d1", p.prompt_token_ids, params)
        assert decode_admit(decode, d) == 99
        run_until(
            [decode],
            lambda: prefill.worker.metrics.notifications_received >= 1,
            "prefill's idle thread to read the claim",
        )
        assert not failed(decode, "d1")
        run_until([prefill, decode], lambda: loaded(decode, "d1"), "the load")
        _expect_equal(prefill, decode, p, d, 0, slice(0, 99))
        _finish_decode(decode, d)
        run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free")
        _assert_pools_full(prefill, decode)
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()
