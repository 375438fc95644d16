"""Packed reads (``extra.gather_mib``): a load of many small rows moves as one range.

Real NIXL pairs: prefill packs the rows decode reads into its gather arena, decode READs
that range once and puts the rows in place; the KV decode holds is prefill's, byte for
byte, across formats, and every page goes back. A prefill without room, or without an
arena, is read row by row."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

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
    make_side,
    prefill_finish,
    run_until,
    token_ids,
)

BF = SideFormat(16)
KS = SideFormat(16, packing=KVPacking.KV_SPLIT)
BF_HND = SideFormat(16, layout=KVLayout.HND)
BF_32 = SideFormat(32)
GATHER = {"gather_mib": 4}
TIMEOUT_S = 5.0


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every READ a NIXL engine posts: (descriptors it asked for, bytes)."""
    posted: list[tuple[int, int]] = []
    real = NixlTransferEngine.read

    def read(self, local, local_idx, remote, remote_idx, notif=b""):
        handle = real(self, local, local_idx, remote, remote_idx, notif)
        posted.append((handle.num_descs, handle.num_bytes))
        return handle

    monkeypatch.setattr(NixlTransferEngine, "read", read)
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


@pytest.mark.parametrize(
    ("pfmt", "dfmt", "kinds"),
    [(BF, BF, "F"), (KS, BF, "FWS"), (BF, BF_HND, "FW"), (BF_32, BF, "FS")],
    ids=str,
)
def test_a_load_of_many_rows_moves_as_one_packed_range(cluster, monkeypatch, pfmt, dfmt, kinds):
    posted = _reads(monkeypatch)
    prefill = cluster.new_node("kv_producer", pfmt, kinds, extra=GATHER)
    decode = cluster.new_node("kv_consumer", dfmt, kinds, extra=GATHER)  # verifies every load
    for seed in (1, 2):  # the second load lands in pages the first gave back
        del posted[:]
        _load(cluster, prefill, decode, seed)
        # one READ of the packed range: the whole pages it spans, adjacent on both sides
        assert len(posted) == 1, posted
        packed = prefill.worker.metrics.packed_bytes // seed  # the same load twice
        pages = -(-packed // PAGE_BYTES)
        assert packed > 0 and posted[0] == (pages, pages * PAGE_BYTES)
    dm, pm = decode.worker.metrics, prefill.worker.metrics
    assert dm.packed_reads == 2 and dm.packed_fallbacks == 0
    assert dm.loads_verified == 2  # decode's digests of its blocks equal prefill's
    assert pm.packed_refused == 0
    cluster.pump(
        [prefill, decode],
        lambda: prefill.worker._sender.num_pending == 0,
        "prefill's holds to end",
    )
    gather = prefill.worker._sender._gather
    assert gather is not None and gather.num_lent_bytes == 0  # every range went back


def test_a_prefill_without_room_is_read_row_by_row(cluster, monkeypatch):
    posted = _reads(monkeypatch)
    prefill = cluster.new_node("kv_producer", BF, "F", extra={"gather_mib": 0.0625})  # 1 page
    decode = cluster.new_node("kv_consumer", BF, "F", extra=GATHER)
    prefill.worker._sender._gather._arena.lease(PAGE_BYTES, 1)  # its one page is lent
    _load(cluster, prefill, decode, seed=5)
    assert sum(descs for descs, _ in posted) >= packed_reads.MIN_ROWS  # the rows, one by one
    assert decode.worker.metrics.packed_fallbacks == 1 and decode.worker.metrics.packed_reads == 0
    assert prefill.worker.metrics.packed_refused == 1


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_no_packed_read_unless_both_sides_have_an_arena(cluster, monkeypatch, side):
    posted = _reads(monkeypatch)
    prefill = cluster.new_node("kv_producer", BF, "F", extra=GATHER if side == "decode" else {})
    decode = cluster.new_node("kv_consumer", BF, "F", extra=GATHER if side == "prefill" else {})
    _load(cluster, prefill, decode, seed=6)
    assert sum(descs for descs, _ in posted) >= packed_reads.MIN_ROWS  # the rows, one by one
    dm = decode.worker.metrics
    assert (dm.packed_reads, dm.packed_fallbacks, prefill.worker.metrics.packed_bytes) == (0, 0, 0)


def test_a_negative_arena_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"extra\.gather_mib=-1"):
        ExtraConfig(gather_mib=-1)


# ------------------------------------------------ a failed load's landing stays held


@pytest.fixture
def late_pair() -> Iterator[tuple[Side, Side, LateTransport, FakeClock]]:
    """A prefill and a decode with gather arenas; decode's READs land when the test says."""
    clock = FakeClock()
    transports: list[LateTransport] = []

    def factory(name: str) -> LateTransport:
        transports.append(LateTransport(nixl_engine(name)))
        return transports[-1]

    fmt = CacheFormat(layout=KVLayout.NHD)  # per layer: a row per block and layer
    prefill = make_side("kv_producer", "prefill", 16, fmt, "F", clock, lease_s=120.0, extra=GATHER)
    try:
        decode = make_side(
            "kv_consumer",
            "decode",
            16,
            fmt,
            "F",
            clock,
            engine_factory=factory,
            transfer_timeout_s=TIMEOUT_S,
            extra={**GATHER, "verify": "off"},
        )
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        yield prefill, decode, transports[0], clock
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def _landing_bytes(decode: Side) -> int:
    packed = decode.worker._receiver._packed
    assert packed is not None
    return packed._pool._arena.num_leased_bytes


def test_a_failed_packed_read_holds_its_landing_until_the_read_ended(late_pair):
    prefill, decode, late, clock = late_pair
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: late.num_in_flight > 0, "decode's packed READ")
    assert [q.local_idx.size for q in late.queued] == [1]  # one page: the packed range
    leased = _landing_bytes(decode)
    assert leased == PAGE_BYTES

    clock.now += TIMEOUT_S + 1  # the deadline passes with the READ on the wire
    decode.step()
    assert not failed(decode, "d1") and decode.worker.metrics.loads_held == 1
    assert _landing_bytes(decode) == leased, "the landing went back with its READ out"

    late.land(prefill.step)  # the released READ lands after all
    run_until([decode, prefill], lambda: bool(failed(decode, "d1")), "the held failure")
    assert _landing_bytes(decode) == 0  # the READ ended: the pages are free again
    assert decode.worker.metrics.packed_reads == 0  # nothing was scattered
