"""Verified loads (``extra.verify``): decode proves it holds what prefill sent, or fails.

Two full connectors in one process with real NIXL (``pair_harness``). A verified load
asks prefill for the digests of exactly the rows it moves (with its claim, or its Push);
decode digests what landed, before its own rewrites, and compares. The transfers go
through a ``LateTransport`` so a test can change decode's blocks between the moment the
bytes landed and the moment decode checks them: a swapped block, a block of another
request and a partly overwritten block must each fail the load, never be reported loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.nixl_setup import nixl_engine
from kvbridge.layouts.allocation import CacheFormat
from kvbridge.layouts.layout import KVLayout
from tests.connector.late_transport import LateTransport
from tests.connector.packed_engine import PACKED, HndRepacker
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

NHD = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
HND = CacheFormat(layout=KVLayout.HND, kernel_block_size=8)
# (prefill block size, prefill format, decode format, kinds): the same format; one where
# prefill rewrites its blocks for decode (64-token NHD -> 16-token HND chunks) and decode
# reads per layer, with a sliding-window and a state group beside full attention
PAIRS = {
    "same": (16, NHD, NHD, "F"),
    "rewrite": (64, NHD, HND, "FSM"),
    # engine-packed 128-token pages land whole in decode's staging slots and the engine
    # repacks them into 32-token blocks (digested as they landed, before the repack)
    "staged": (128, PACKED, PACKED, "F"),
}


@contextmanager
def _pair(mode: str, pair: str, late: str) -> Iterator[tuple[Side, Side, LateTransport]]:
    clock = FakeClock()
    block_size, pfmt, dfmt, kinds = PAIRS[pair]
    transports: list[LateTransport] = []

    def factory(name: str) -> LateTransport:
        transports.append(LateTransport(nixl_engine(name)))
        return transports[-1]

    extra = {"transfer_mode": mode, "verify": "all"}
    engines = {late: {"engine_factory": factory}}
    repack = {"repacker_for": HndRepacker} if pair == "staged" else {}
    prefill = make_side(
        "kv_producer",
        "prefill",
        block_size,
        pfmt,
        kinds,
        clock,
        extra=extra,
        **engines.get("prefill", {}),
    )
    try:
        decode = make_side(
            "kv_consumer",
            "decode",
            32 if pair == "staged" else 16,
            dfmt,
            kinds,
            clock,
            extra=extra,
            **repack,
            **engines.get("decode", {}),
        )
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        yield prefill, decode, transports[0]
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


@pytest.fixture(params=["pull", "push"])
def mode(request) -> str:
    return request.param


def _landed(prefill: Side, decode: Side, late: LateTransport, mode: str) -> tuple[Request, Request]:
    """A load whose bytes have landed in decode's blocks and whose digests decode holds,
    decode not yet stepped past the landing (its blocks are still the test's to spoil);
    and another request prefill keeps (whose blocks are not the load's)."""
    other = Request("p0", token_ids(40, seed=1), KVTransferParams(do_remote_decode=True))
    prefill_finish(prefill, other)
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    if mode == "pull":
        run_until([decode, prefill], lambda: late.num_in_flight > 0, "decode's READs")
        run_until(
            [prefill, decode],
            lambda: decode.worker.metrics.notifications_received >= 1,
            "prefill's answer to the claim (with its digests)",
        )
        late.land(prefill.step)
    else:  # prefill WRITEs late; it answers Pushed (with its digests) once they ended
        run_until([decode, prefill], lambda: late.num_in_flight > 0, "prefill's WRITEs")
        late.land(decode.step)
        run_until([prefill], lambda: late.num_in_flight == 0, "the WRITEs to end")
    return d, other


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_a_verified_load_lands_and_is_counted(mode, pair):
    late = "decode" if mode == "pull" else "prefill"
    with _pair(mode, pair, late) as (prefill, decode, transport):
        d, _ = _landed(prefill, decode, transport, mode)
        run_until([decode, prefill], lambda: loaded(decode, "d1"), "the verified load")
        m = decode.worker.metrics
        assert (m.loads_verified, m.load_verify_failures, m.verify_unverified_groups) == (1, 0, 0)
        assert (m.staging_rounds > 0) == (pair == "staged")
        assert not failed(decode, d.request_id)
        if mode == "pull":
            assert prefill.worker.metrics.digests_sent >= 1


def _swap(decode: Side, d: Request) -> None:
    a, b = d.block_ids[0][0], d.block_ids[0][1]
    for t in decode.buffers.tensors:
        t[[a, b]] = t[[b, a]]


def _foreign(decode: Side, d: Request, prefill: Side, other: Request) -> None:
    """A block of another request prefill keeps lands where the load's third block goes."""
    for mine, theirs in zip(decode.buffers.tensors, prefill.buffers.tensors, strict=True):
        mine[d.block_ids[0][2]] = theirs[other.block_ids[0][0]]


def _partial(decode: Side, d: Request) -> None:
    decode.buffers.tensors[0][d.block_ids[0][1], 5] ^= 0x40


@pytest.mark.parametrize("spoil", ["swapped block", "foreign block", "partial overwrite"])
def test_a_spoiled_landing_fails_the_load(mode, spoil):
    late = "decode" if mode == "pull" else "prefill"
    with _pair(mode, "same", late) as (prefill, decode, transport):
        d, other = _landed(prefill, decode, transport, mode)
        if spoil == "swapped block":
            _swap(decode, d)
        elif spoil == "foreign block":
            _foreign(decode, d, prefill, other)
        else:
            _partial(decode, d)
        run_until([decode, prefill], lambda: bool(failed(decode, "d1")), "the load to fail")
        [failure] = failed(decode, "d1")
        assert "verify: the landed bytes are not what prefill" in failure.reason
        assert "group 0" in failure.reason
        assert not loaded(decode, "d1")
        assert decode.worker.metrics.load_verify_failures == 1
        run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free p1")


def test_an_unverified_load_is_not_checked():
    """``verify: "off"`` asks no digests and checks nothing (the spoiled block loads)."""
    clock = FakeClock()
    prefill = make_side("kv_producer", "prefill", 16, NHD, "F", clock)
    decode = make_side("kv_consumer", "decode", 16, NHD, "F", clock, extra={"verify": "off"})
    try:
        p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
        d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
        decode_admit(decode, d)
        run_until([decode, prefill], lambda: loaded(decode, "d1"), "the load")
        assert decode.worker.metrics.loads_verified == 0
        assert prefill.worker.metrics.digests_sent == 0
        ids = torch.tensor(d.block_ids[0][:-1])
        assert torch.equal(
            decode.buffers.tensors[0][ids],
            prefill.buffers.tensors[0][torch.tensor(p.block_ids[0][:-1])],
        )
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_a_spoiled_staging_slot_fails_the_load(mode):
    """Staged pages are digested as they landed in decode's slots, before the engine
    repacks them: one byte changed in the slots fails the load."""
    late = "decode" if mode == "pull" else "prefill"
    with _pair(mode, "staged", late) as (prefill, decode, transport):
        _landed(prefill, decode, transport, mode)
        arena = decode.worker._receiver._staged._pools._arena  # the slots' memory
        assert arena is not None
        arena.buf[: arena.buf.numel() // 2] ^= 0x08  # the first slots hold this round
        run_until([decode, prefill], lambda: bool(failed(decode, "d1")), "the load to fail")
        [failure] = failed(decode, "d1")
        assert "verify: the landed bytes are not what prefill" in failure.reason
        assert "group 0: 4 rows digest" in failure.reason  # digested here too, and differs
        assert decode.worker.metrics.load_verify_failures == 1
