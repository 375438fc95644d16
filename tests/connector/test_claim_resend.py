"""A claim whose answer does not come is sent again, and the hold still counts from the
first one.

CI once saw a decode's first load from a fresh prefill wait 30 s for the answer to its
claim although its READs had ended in half a second; the answer came right after the load
had failed (``docs/handover.md``). A claim is idempotent on prefill, so decode sends an
unanswered one again every ``RESEND_S``. Two full connectors with real NIXL in one process
(``pair_harness``); prefill's transport drops its first notification, as a stuck or lost
``Prepared`` would be.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from kvbridge.connector.common.notifications import Prepared
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.decode.claims import RESEND_S, Claims
from kvbridge.connector.worker.decode.load_records import Source
from kvbridge.connector.worker.worker_setup import nixl_engine
from kvbridge.layouts.allocation import CacheFormat
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

FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)


class DropsNotifications:
    """A real NIXL engine whose next ``drop`` notifications are lost, and which holds
    back every notification while ``hold`` is set (sent by ``release``)."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self.drop = 0
        self.dropped = 0
        self.hold = False
        self.held: list[tuple[str, bytes]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def send_notif(self, peer: str, msg: bytes) -> None:
        if self.drop > 0:
            self.drop -= 1
            self.dropped += 1
        elif self.hold:
            self.held.append((peer, msg))
        else:
            self.inner.send_notif(peer, msg)

    def release(self) -> int:
        held, self.held, self.hold = self.held, [], False
        for peer, msg in held:
            self.inner.send_notif(peer, msg)
        return len(held)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pair(clock: FakeClock) -> Iterator[tuple[Side, Side, DropsNotifications]]:
    engines: list[DropsNotifications] = []

    def factory(name: str) -> DropsNotifications:
        engines.append(DropsNotifications(nixl_engine(name)))
        return engines[-1]

    prefill = make_side(
        "kv_producer", "prefill", 16, FMT, "F", clock, lease_s=120.0, engine_factory=factory
    )
    try:
        decode = make_side("kv_consumer", "decode", 16, FMT, "F", clock, transfer_timeout_s=30.0)
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        yield prefill, decode, engines[0]
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def _blocks(side: Side, req: Request) -> torch.Tensor:
    ids = torch.tensor(req.block_ids[0])
    return torch.stack([t[ids].clone() for t in side.buffers.tensors])


def test_an_unanswered_claim_goes_out_again_and_the_load_lands(clock, pair, caplog):
    prefill, decode, drops = pair
    drops.drop = 1  # prefill's answer to the first claim is lost
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: drops.dropped == 1, "prefill's first answer")
    # the READs ended (CPU memory: inside the post), the claim is unanswered: not loaded
    for _ in range(20):
        decode.step()
        prefill.step()
    assert not loaded(decode, d.request_id) and not failed(decode, d.request_id)
    m = decode.worker.metrics
    assert (m.claims_sent, m.claims_resent) == (1, 0)
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        clock.now += RESEND_S
        run_until([decode, prefill], lambda: loaded(decode, d.request_id), "the load")
    assert (m.claims_sent, m.claims_resent) == (2, 1)
    assert "unanswered for 2.0 s (its READs ended); sending it again" in caplog.text
    assert not failed(decode, d.request_id)
    assert torch.equal(_blocks(decode, d), _blocks(prefill, p)[:, : len(d.block_ids[0])])
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free on Done")
    assert m.bad_notifications == 0


def test_late_answers_to_a_load_that_timed_out_are_logged_not_counted_bad(clock, pair, caplog):
    prefill, decode, slow = pair
    slow.hold = True  # prefill's answers are stuck until the load has failed
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: len(slow.held) == 1, "prefill's first answer")
    start = clock.now
    while not failed(decode, d.request_id):  # sent again every RESEND_S until the deadline
        clock.now += RESEND_S
        decode.step()
        prefill.step()
        assert clock.now - start < 60.0, "the load did not time out"
    [failure] = failed(decode, d.request_id)
    assert "reading; READs ended; claim unanswered for 32.0 s (16 sent)" in failure.reason
    m = decode.worker.metrics
    assert m.claims_sent == len(slow.held) == 16 and m.claims_resent == 15
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        assert slow.release() == 16
        run_until(
            [decode, prefill],
            lambda: m.notifications_received >= 16,
            "the 16 late answers",
        )
    assert m.bad_notifications == 0
    assert "answered the claim on p1" in caplog.text and "after the load had ended" in caplog.text


def _claimed_twice() -> tuple[Claims, Source, list[float]]:
    """Claims on a clock at 102.0 whose source sent a claim at 100.0 and again at 102.0."""
    now = [100.0]
    claims = Claims(send=lambda peer, msg: True, metrics=_Metrics(), clock=lambda: now[0])  # type: ignore[arg-type]
    src = Source(key=("p", 0))
    assert claims.send(_load(), src, None)  # type: ignore[arg-type]
    now[0] = 102.0
    assert claims.resend_due(src, now[0])
    assert claims.send(_load(), src, None)  # type: ignore[arg-type]
    return claims, src, now


def test_the_hold_counts_from_the_first_unanswered_claim() -> None:
    claims, src, _ = _claimed_twice()
    assert (src.claim_sent, src.claim_last, src.claims_unanswered) == (100.0, 102.0, 2)
    assert not claims.resend_due(src, 103.9)
    # the answer (to whichever claim) is counted from the first send: never more than
    # prefill promised
    assert Claims.answered(src, Prepared(request_id="r", ok=True, held_s=30.0)) == ""
    assert (src.held_until, src.claim_sent, src.extra_answers) == (130.0, 0.0, 1)
    assert claims.extra_answer("r", src) == 0.0  # the second answer: expected, dropped
    assert claims.extra_answer("r", src) is None  # a third: nobody sent for it


def test_answers_to_a_load_that_ended_are_expected_once_each() -> None:
    claims, src, now = _claimed_twice()
    claims.forget("r", [src])  # the load failed with two claims unanswered
    now[0] = 131.0
    assert claims.extra_answer("r", None) == 31.0  # seconds since the first claim
    assert claims.extra_answer("r", None) == 31.0
    assert claims.extra_answer("r", None) is None
    assert claims.extra_answer("other", None) is None


def test_an_extra_answer_after_a_load_that_landed_is_quiet() -> None:
    claims, src, now = _claimed_twice()
    assert Claims.answered(src, Prepared(request_id="r", ok=True, held_s=30.0)) == ""
    claims.forget("r", [src])  # the load landed; the resent claim's answer is still due
    now[0] = 103.0
    assert claims.extra_answer("r", None) == 0.0  # expected: not late, not bad
    assert claims.extra_answer("r", None) is None


class _Metrics:
    claims_sent = 0
    claims_resent = 0


def _load() -> object:
    class _Params:
        remote_request_id = "r"

    class _Spec:
        params = _Params()

    class _Load:
        spec = _Spec()
        deadline = 130.0

    return _Load()
