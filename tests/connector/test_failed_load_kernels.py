"""A load that fails after kvbridge queued kernels on its blocks is reported only once those
kernels finished: shown on CPU with the recording fake DeviceOrder.

On a GPU the packed scatter (``PackedReads.land``) writes a load's blocks with kernels on
the calling thread's stream and takes a mark the host never waits for. If the load then
fails (here: the claim's verdict after the READ, ``Claims.reads_ended``), the engine may
get the blocks back and lend them to another request, whose own READ (UCX's copy, on no
stream of ours) can land before the scatter does: the late scatter overwrites it. A landed
load waits for its mark ("load complete"); a failed one must wait for the marks of what it
queued as well (``Outcomes.fail``: a mark when the load's kernels ran). Here end to end:
two real workers, the packed scatter, the claim's verdict failing the load after it.
"""

from __future__ import annotations

import pytest
import torch

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.decode import claims, packed_reads
from kvbridge.layouts.allocation import CacheFormat
from kvbridge.layouts.layout import KVLayout
from tests.connector.pair_harness import (
    FakeClock,
    Request,
    decode_admit,
    failed,
    make_side,
    prefill_finish,
    run_until,
    token_ids,
)
from tests.connector.test_device_order import RecordingOrder

GATHER = {"gather_mib": 4, "transfer_mode": "pull"}
HOLD_ENDED = "read ended after the hold prefill promised (test)"


def test_a_load_failed_after_its_scatter_is_reported_once_the_scatter_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packed_reads, "MIN_ROWS", 8)  # the test model's loads are small
    clock = FakeClock()
    orders: list[RecordingOrder] = []

    def held_order(device: torch.device) -> RecordingOrder:
        orders.append(RecordingOrder(device, [], hold=True))
        return orders[-1]

    def verdict_after_the_hold(self: claims.Claims, src: object) -> str:
        return HOLD_ENDED  # the READ ended, but after prefill's hold: the load fails

    monkeypatch.setattr(claims.Claims, "reads_ended", verdict_after_the_hold)
    fmt = CacheFormat(layout=KVLayout.NHD)
    prefill = make_side("kv_producer", "prefill", 16, fmt, "F", clock, lease_s=30.0, extra=GATHER)
    try:
        decode = make_side(
            "kv_consumer",
            "decode",
            16,
            fmt,
            "F",
            clock,
            device_order=held_order,
            extra={**GATHER, "verify": "off"},
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
        scatter = next(m for m in order.marks if m.why == "packed scatter")
        for _ in range(10):
            decode.step()
            prefill.step()
        assert not scatter.done()  # the scatter's kernels still run on the device
        assert not failed(decode, "d1"), "reported while the scatter may still write its blocks"
        order.complete()
        decode.step()
        assert [f.reason for f in failed(decode, "d1")] == [HOLD_ENDED]
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()
