"""No byte after give-back: a failed load's blocks stay held while a READ may still land.

Two full connectors in one process (``pair_harness``); decode's transfer engine is a
``LateTransport``: its READs land only when the test says so, and a released READ still
lands (as with UCX, which cannot cancel a GET in flight). The engine must hear of a failed
load only once nothing can write its blocks any more.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.worker_setup import nixl_engine
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

FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
TIMEOUT_S = 5.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pair(clock: FakeClock) -> Iterator[tuple[Side, Side, LateTransport]]:
    transports: list[LateTransport] = []

    def late(name: str) -> LateTransport:
        transports.append(LateTransport(nixl_engine(name)))
        return transports[-1]

    prefill = make_side("kv_producer", "prefill", 16, FMT, "F", clock, lease_s=120.0)
    decode = make_side(
        "kv_consumer", "decode", 16, FMT, "F", clock, engine_factory=late,
        transfer_timeout_s=TIMEOUT_S,
    )
    try:
        yield prefill, decode, transports[0]
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def _blocks(side: Side, req: Request) -> torch.Tensor:
    ids = torch.tensor(req.block_ids[0])
    return torch.stack([t[ids].clone() for t in side.buffers.tensors])


def _start_load(prefill: Side, decode: Side, late: LateTransport) -> Request:
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: late.num_in_flight > 0, "decode's READ to be posted")
    assert _blocks(decode, d).ne(_blocks(prefill, p)[:, : len(d.block_ids[0])]).any()
    return d


def test_a_read_past_its_deadline_holds_its_blocks_until_it_lands(clock, pair):
    prefill, decode, late = pair
    d = _start_load(prefill, decode, late)

    clock.now += TIMEOUT_S + 1  # decode's deadline passes; the READ is still on the wire
    decode.step()
    assert not failed(decode, "d1"), "a failed load was reported while its READ could land"
    assert decode.worker.metrics.loads_held == 1
    assert "p1" not in prefill.freed  # Done(ok=False) waits too

    late.land(prefill.step)  # the abandoned READ arrives after all
    run_until([decode, prefill], lambda: bool(failed(decode, "d1")), "the held failure")
    assert not loaded(decode, "d1")
    given_back = _blocks(decode, d)  # from here on the engine owns them
    assert late.num_in_flight == 0
    late.land(prefill.step)
    for _ in range(3):
        decode.step()
    assert torch.equal(_blocks(decode, d), given_back)
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free p1 on Done")


def test_a_read_that_runs_on_keeps_its_load_held_however_long(clock, pair):
    """No clock of decode's gives the blocks back: only the READ's end does (tearing the
    peer down does not stop a READ in flight; see test_worker_multiprocess)."""
    prefill, decode, late = pair
    d = _start_load(prefill, decode, late)

    for _ in range(5):  # far past the deadline: held, overdue once, never reported
        clock.now += TIMEOUT_S + 1
        decode.step()
    assert not failed(decode, "d1")
    assert decode.worker.metrics.loads_held == 1
    assert decode.worker.metrics.held_overdue == 1
    assert late.num_in_flight == 1 and late.num_torn_down == 0

    late.land(prefill.step)
    run_until([decode, prefill], lambda: bool(failed(decode, "d1")), "the held failure")
    assert [f.request_id for ev in decode.events for f in (*ev.recompute, *ev.failed)] == ["d1"]
    given_back = _blocks(decode, d)
    late.land(prefill.step)  # nothing is left that could land
    decode.step()
    assert torch.equal(_blocks(decode, d), given_back)
