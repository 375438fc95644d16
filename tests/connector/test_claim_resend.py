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

import msgspec
import pytest
import torch

from kvbridge.connector.common.notifications import Prepared, decode_notification
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.decode.claims import RESEND_S, Claims
from kvbridge.connector.worker.decode.inflight import Source
from kvbridge.connector.worker.nixl_setup import nixl_engine
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
        self.sent: list[object] = []  # every notification asked for, decoded

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.sent.append(decode_notification(msg))
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
    answers = [m for m in drops.sent if isinstance(m, Prepared)]
    assert [(a.claim, a.ok) for a in answers] == [(1, True), (2, True)]  # echoed numbers
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
    assert "answered a claim on p1" in caplog.text and "after the load had ended" in caplog.text


def _claimed_twice() -> tuple[Claims, Source, list[float]]:
    """Claims on a clock at 102.0 whose source sent claim 1 at 100.0 and claim 2 at 102.0."""
    now = [100.0]
    claims = Claims(send=lambda peer, msg: True, metrics=_Metrics(), clock=lambda: now[0])  # type: ignore[arg-type]
    src = Source(key=("p", 0))
    assert claims.send(_load(), src, None)  # type: ignore[arg-type]
    now[0] = 102.0
    assert not claims.resend_due(src, now[0], numbered=False)  # an older prefill: never
    assert claims.resend_due(src, now[0], numbered=True)
    assert claims.send(_load(), src, None)  # type: ignore[arg-type]
    return claims, src, now


def _ok(claim: int) -> Prepared:
    return Prepared(request_id="r", ok=True, held_s=30.0, claim=claim)


def test_an_answer_counts_from_its_own_claims_send() -> None:
    claims, src, _ = _claimed_twice()
    assert (src.claims, src.claim_sent, src.claim_last) == ({1: 100.0, 2: 102.0}, 100.0, 102.0)
    assert not claims.resend_due(src, 103.9, numbered=True)
    assert Claims.answers(src, _ok(2)) and not Claims.answers(src, _ok(3))
    assert claims.answered(src, _ok(2)) == ""  # claim 2's answer: 30 s from 102.0
    assert (src.held_until, src.claim_sent, src.claims) == (132.0, 0.0, {})
    assert not Claims.answers(src, _ok(1))  # settled: claim 1's answer is no claim's now
    assert claims.late_answer(_ok(1)) == 0.0  # expected, dropped quietly
    assert claims.late_answer(_ok(1)) is None  # a second time: nobody sent for it
    assert claims.late_answer(_ok(0)) is None  # unnumbered, nothing in flight: bad


def test_an_old_answer_is_never_taken_for_a_newer_claims() -> None:
    """Claim 1 sent again as claim 2; 2's answer comes; a refresh (claim 3) goes out; then
    1's answer arrives late: it answers claim 1 only, and cannot stretch claim 3's hold."""
    claims, src, now = _claimed_twice()
    claims.answered(src, _ok(2))
    now[0] = 120.0
    claims.send(_load(), src, None)  # type: ignore[arg-type]  # the refresh: claim 3
    assert not Claims.answers(src, _ok(1))
    assert claims.late_answer(_ok(1)) == 0.0
    assert src.held_until == 132.0 and src.claims == {3: 120.0}
    assert claims.answered(src, _ok(3)) == "" and src.held_until == 150.0


def test_answers_to_a_load_that_ended_unanswered_are_logged_as_late() -> None:
    claims, src, now = _claimed_twice()
    claims.settle(src, ended=True)  # the load failed with both claims unanswered
    now[0] = 131.0
    assert claims.late_answer(_ok(1)) == 31.0  # seconds since claim 1 was sent
    assert claims.late_answer(_ok(2)) == 29.0
    assert claims.late_answer(_ok(2)) is None
    assert claims.late_answer(_ok(7)) is None


def test_an_unnumbered_answer_counts_from_the_first_claim_in_flight() -> None:
    claims, src, _ = _claimed_twice()
    assert Claims.answers(src, _ok(0))
    assert claims.answered(src, _ok(0)) == "" and src.held_until == 130.0


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
        verify = False

    return _Load()


def test_a_prefill_that_does_not_number_its_answers_is_never_claimed_twice(clock, pair):
    """An older prefill answers without the claim's number: an answer could not say which
    of two claims it answers, so decode waits for the one claim it sent."""
    prefill, decode, slow = pair
    slow.hold = True
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: len(slow.held) == 1, "prefill's first answer")
    [peer] = [peer for peer in decode.worker._peers._peers.values()]
    peer.description = msgspec.structs.replace(peer.description, numbered_claims=False)
    for _ in range(5):
        clock.now += RESEND_S
        decode.step()
    assert decode.worker.metrics.claims_resent == 0
    slow.release()
    run_until([decode, prefill], lambda: loaded(decode, d.request_id), "the load")
    assert torch.equal(_blocks(decode, d), _blocks(prefill, p)[:, : len(d.block_ids[0])])
