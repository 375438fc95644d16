"""Packed reads (``extra.gather_mib``): a load of many small rows moves as one range.

Real NIXL pairs: prefill packs the rows decode reads into its gather arena, decode READs
that range once and puts the rows in place; the KV decode holds is prefill's, byte for
byte, across formats, and every page goes back. A prefill without room, or without an
arena, is read row by row."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvbridge.connector.common.config import ConfigError, ExtraConfig
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.nixl_engine import NixlTransferEngine
from kvbridge.connector.worker.decode import packed_reads
from kvbridge.connector.worker.nixl_setup import nixl_engine
from kvbridge.connector.worker.prefill.gather_arena import PAGE_BYTES
from kvbridge.layouts.allocation import CacheFormat
from kvbridge.layouts.layout import KVLayout, KVPacking
from tests.connector.conftest import (
    Cluster,
    SideFormat,
    check_loaded,
    expectations,
    plan_request,
)
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
from tests.connector.test_device_order import RecordingOrder

BF = SideFormat(16)
KS = SideFormat(16, packing=KVPacking.KV_SPLIT)
BF_HND = SideFormat(16, layout=KVLayout.HND)
BF_32 = SideFormat(32)
GATHER = {"gather_mib": 4}
TIMEOUT_S = 5.0


def _transfers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every READ and WRITE a NIXL engine posts: (op, descriptors it asked for, bytes)."""
    posted: list[tuple[str, int, int]] = []
    for op in ("read", "write"):
        real = getattr(NixlTransferEngine, op)

        def post(self, local, local_idx, remote, remote_idx, notif=b"", _op=op, _real=real):
            handle = _real(self, local, local_idx, remote, remote_idx, notif)
            posted.append((_op, handle.num_descs, handle.num_bytes))
            return handle

        monkeypatch.setattr(NixlTransferEngine, op, post)
    return posted


def _load(cluster: Cluster, prefill, decode, seed: int, end: int = 160) -> None:
    prefill.fill(seed)
    req = plan_request(prefill, decode, 0, end, np.random.default_rng(seed))
    before = expectations(prefill, decode, req)
    cluster.transfer(prefill, decode, req)
    check_loaded(prefill, decode, req, before)


@pytest.fixture(autouse=True)
def _few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_reads, "MIN_ROWS", 8)  # the test model's loads are small


PLACES = [
    pytest.param({}, id="cpu"),
    pytest.param({"host_staging": True}, id="host-staged"),  # packed from / into the mirrors
    pytest.param({"device": "cuda"}, id="cuda", marks=pytest.mark.gpu),
    pytest.param(
        {"device": "cuda", "kv_buffer_device": "cpu"}, id="cuda-host-staged", marks=pytest.mark.gpu
    ),
]


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    ("pfmt", "dfmt", "kinds"),
    [(BF, BF, "F"), (KS, BF, "FWS"), (BF, BF_HND, "FW"), (BF_32, BF, "FS")],
    ids=str,
)
def test_a_load_of_many_rows_moves_as_one_packed_range(
    cluster, monkeypatch, pfmt, dfmt, kinds, mode, where
):
    posted = _transfers(monkeypatch)
    extra = {**GATHER, "transfer_mode": mode}
    prefill = cluster.new_node("kv_producer", pfmt, kinds, extra=extra, **where)
    decode = cluster.new_node("kv_consumer", dfmt, kinds, extra=extra, **where)  # verifies
    op = "read" if mode == "pull" else "write"
    for seed in (1, 2):  # the second load lands in pages the first gave back
        del posted[:]
        _load(cluster, prefill, decode, seed)
        # one transfer of the packed range: the whole pages it spans, adjacent on both sides
        packed = prefill.worker.metrics.packed_bytes // seed  # the same bytes each load
        pages = -(-packed // PAGE_BYTES)
        assert packed > 0 and posted == [(op, pages, pages * PAGE_BYTES)], posted
    dm, pm = decode.worker.metrics, prefill.worker.metrics
    assert dm.packed_loads == 2 and dm.packed_fallbacks == 0
    assert dm.loads_verified == 2  # decode's digests of its blocks equal prefill's
    assert pm.packed_refused == 0
    cluster.pump(
        [prefill, decode],
        lambda: prefill.worker._sender.num_pending == 0,
        "prefill's holds to end",
    )
    assert _arena_bytes(prefill) == 0 and _arena_bytes(decode) == 0  # every page went back


def _arena_bytes(node) -> int:
    """Bytes of the worker's gather arena lent (prefill's ranges and decode's landings)."""
    gather = node.worker._sender._gather
    assert gather is not None
    return gather.num_lent_bytes


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_prefill_without_room_moves_the_rows_as_they_are(cluster, monkeypatch, mode):
    posted = _transfers(monkeypatch)
    small = {"gather_mib": 0.0625, "transfer_mode": mode}  # one page
    prefill = cluster.new_node("kv_producer", BF, "F", extra=small)
    decode = cluster.new_node("kv_consumer", BF, "F", extra={**GATHER, "transfer_mode": mode})
    prefill.worker._sender._gather._arena.lease(PAGE_BYTES, 1)  # its one page is lent
    _load(cluster, prefill, decode, seed=5)
    assert sum(descs for _, descs, _ in posted) >= packed_reads.MIN_ROWS  # the rows, one by one
    assert decode.worker.metrics.packed_fallbacks == 1 and decode.worker.metrics.packed_loads == 0
    assert prefill.worker.metrics.packed_refused == 1
    assert _arena_bytes(decode) == 0  # its landing went back


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_nothing_moves_packed_unless_both_sides_have_an_arena(cluster, monkeypatch, side, mode):
    posted = _transfers(monkeypatch)
    with_arena, without = {**GATHER, "transfer_mode": mode}, {"transfer_mode": mode}
    prefill = cluster.new_node(
        "kv_producer", BF, "F", extra=with_arena if side == "decode" else without
    )
    decode = cluster.new_node(
        "kv_consumer", BF, "F", extra=with_arena if side == "prefill" else without
    )
    _load(cluster, prefill, decode, seed=6)
    assert sum(descs for _, descs, _ in posted) >= packed_reads.MIN_ROWS  # the rows, one by one
    dm = decode.worker.metrics
    assert (dm.packed_loads, dm.packed_fallbacks, prefill.worker.metrics.packed_bytes) == (0, 0, 0)


@pytest.mark.parametrize("mib", [0, 4])
def test_params_naming_too_few_prefill_blocks_fail_the_load_by_name(cluster, mib):
    """The rows are planned when the load starts (to size the landing): a load whose params
    name too few blocks fails, as it does unpacked, and the worker keeps serving."""
    prefill = cluster.new_node("kv_producer", BF, "F", extra={"gather_mib": mib})
    decode = cluster.new_node("kv_consumer", BF, "F", extra={"gather_mib": mib})
    prefill.fill(7)
    req = plan_request(prefill, decode, 0, 160, np.random.default_rng(7))
    req.remote_ids[0] = req.remote_ids[0][:-2]  # two blocks short of the tokens
    prefill.send(req.send_id, req.remote_ids, req.remote_first)
    decode.load(req.spec(prefill))
    cluster.pump([prefill, decode], lambda: req.load_id in decode.failed, "the load to fail")
    assert "need remote logical blocks" in decode.failed[req.load_id].reason
    if mib:
        assert _arena_bytes(decode) == 0  # no landing kept
    _load(cluster, prefill, decode, seed=8)  # and the next load is exact


@pytest.mark.parametrize("mib", [-1, 0.01])
def test_an_arena_of_less_than_a_page_is_refused_by_name(mib):
    with pytest.raises(ConfigError, match=rf"extra\.gather_mib={mib:g} must be 0 .* 64 KiB"):
        ExtraConfig(gather_mib=mib)


# ------------------------------------------------ a failed load's landing stays held


@pytest.fixture(params=["pull", "push"])
def late_pair(request) -> Iterator[tuple[Side, Side, LateTransport, FakeClock]]:
    """A prefill and a decode with gather arenas; the side that moves the bytes (decode's
    READ, prefill's WRITE) moves them when the test says."""
    mode = request.param
    clock = FakeClock()
    transports: list[LateTransport] = []

    def factory(name: str) -> LateTransport:
        transports.append(LateTransport(nixl_engine(name)))
        return transports[-1]

    fmt = CacheFormat(layout=KVLayout.NHD)  # per layer: a row per block and layer
    extra = {**GATHER, "transfer_mode": mode}
    late = {"engine_factory": factory}
    prefill = make_side(
        "kv_producer",
        "prefill",
        16,
        fmt,
        "F",
        clock,
        lease_s=120.0,
        extra=extra,
        **(late if mode == "push" else {}),
    )
    try:
        decode = make_side(
            "kv_consumer",
            "decode",
            16,
            fmt,
            "F",
            clock,
            transfer_timeout_s=TIMEOUT_S,
            extra={**extra, "verify": "off"},
            **(late if mode == "pull" else {}),
        )
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        yield prefill, decode, transports[0], clock
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_a_failed_packed_load_holds_its_landing_until_its_transfer_ended(late_pair):
    prefill, decode, late, clock = late_pair
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: late.num_in_flight > 0, "the packed READ or WRITE")
    assert [q.local_idx.size for q in late.queued] == [1]  # one page: the packed range
    leased = _arena_bytes(decode)
    assert leased == PAGE_BYTES

    clock.now += TIMEOUT_S + 1  # the deadline passes with the transfer on the wire
    for _ in range(3):
        decode.step()
        prefill.step()  # push: gets Done(ok=False), but its WRITE still runs
    assert not failed(decode, "d1") and decode.worker.metrics.loads_held == 1
    assert _arena_bytes(decode) == leased, "the landing went back with a transfer out"

    late.land(lambda: (decode.step(), prefill.step()))  # it lands after all
    run_until([decode, prefill], lambda: bool(failed(decode, "d1")), "the held failure")
    assert _arena_bytes(decode) == 0  # it ended: the pages are free again
    assert decode.worker.metrics.packed_loads == 0  # nothing was scattered
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free p1")
    assert _arena_bytes(prefill) == 0  # push: its own pages went back with the WRITE


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_landing_goes_back_once_the_scatter_finished_never_waited_for(mode):
    """On a GPU the scatter's kernels may still run when the load is done with NIXL: the
    landing goes back (the next packed load may land there) only once their mark
    completed, looked at each step, and the host never waits for it."""
    clock = FakeClock()
    orders: list[RecordingOrder] = []

    def held_order(device: torch.device) -> RecordingOrder:
        orders.append(RecordingOrder(device, [], hold=True))
        return orders[-1]

    fmt = CacheFormat(layout=KVLayout.NHD)
    extra = {**GATHER, "transfer_mode": mode}
    prefill = make_side("kv_producer", "prefill", 16, fmt, "F", clock, lease_s=30.0, extra=extra)
    try:
        decode = make_side(
            "kv_consumer", "decode", 16, fmt, "F", clock, device_order=held_order, extra=extra
        )
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
        d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
        decode_admit(decode, d)
        order = orders[0]

        def scattered() -> bool:
            return any(m.why == "packed scatter" for m in order.marks)

        run_until([prefill, decode], scattered, "the packed scatter")
        for _ in range(10):
            decode.step()
            prefill.step()
        scatter = next(m for m in order.marks if m.why == "packed scatter")
        assert not scatter.waited and not scatter.done()
        assert _arena_bytes(decode) == PAGE_BYTES  # still the scatter's
        assert not loaded(decode, "d1")  # its kernels are the load's too
        order.complete()
        decode.step()
        assert _arena_bytes(decode) == 0 and loaded(decode, "d1")
        assert not any(m.waited for m in order.marks)
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()
