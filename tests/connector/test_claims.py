"""The hold a claim proves, on decode's clock: counted from when the claim was *sent*."""

from __future__ import annotations

from kvbridge.connector.common.notifications import Prepared
from kvbridge.connector.worker.decode.claims import Claims
from kvbridge.connector.worker.decode.inflight import Source


def _answered(src: Source, held_s: float) -> str:
    """An unnumbered answer (as an older prefill sends): counts from the first claim in
    flight, ``src.claim_sent``."""
    claims = Claims(send=lambda peer, msg: True, metrics=None, clock=lambda: 0.0)  # type: ignore[arg-type]
    return claims.answered(src, Prepared(request_id="r", ok=True, held_s=held_s))


def test_the_hold_counts_from_the_claims_send_not_its_answer() -> None:
    src = Source(key=("p", 0), claim_sent=100.0)
    # prefill answered 7 s after we sent (a slow notification): it promised 30 s from
    # *its* answer, so 30 s from our send is the most we may assume
    assert _answered(src, 30.0) == ""
    assert (src.held_until, src.held_s, src.claim_sent) == (130.0, 30.0, 0.0)
    src.reads_done = 129.9
    assert Claims.verdict(src) is True
    src.reads_done = 130.1
    assert Claims.verdict(src) is False  # after the hold, no claim in flight: not kept


def test_a_refresh_extends_and_never_shortens_the_hold() -> None:
    src = Source(key=("p", 0), claim_sent=100.0)
    _answered(src, 30.0)
    claims = Claims(send=lambda peer, msg: True, metrics=None, clock=lambda: 0.0)  # type: ignore[arg-type]
    assert not claims.due(src, 114.9) and claims.due(src, 115.0)  # half the hold
    src.claim_sent = 115.0
    src.reads_done = 140.0
    assert Claims.verdict(src) is None  # past the hold but a claim is in flight: wait
    _answered(src, 30.0)
    assert src.held_until == 145.0 and Claims.verdict(src) is True
    src.claim_sent = 120.0
    _answered(src, 5.0)  # a shorter answer later cannot take the proven hold back
    assert src.held_until == 145.0


def test_an_answer_without_a_hold_is_not_trusted() -> None:
    src = Source(key=("p", 0), claim_sent=100.0)
    assert "did not say how long" in _answered(src, 0.0)
    assert src.held_until == 0.0
