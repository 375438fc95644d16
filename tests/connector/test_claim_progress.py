"""A prefill round that answered a claim reads its notifications once more at its end.

Over UCX's TCP path a GET is served by the target's progress: traced on this project's
VM, a pull's READ (posted right after its claim) stayed pending until prefill's *next*
round, 0.2-1 ms later, although the claim's answer had left. Reading notifications moves
UCX along, so the round that answers a claim does it once more at its end, after its
replies went out; a round that answered none does not (``docs/performance.md``, "What a
READ waits for over TCP"), unless NIXL runs its own progress thread, whose presence stops
``get_notifs`` from moving UCX at all. Two full connectors with real NIXL in one process
(``pair_harness``); prefill's engine records its calls.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.connector.common.notifications import decode_notification
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.nixl_setup import nixl_engine
from kvbridge.layouts.allocation import CacheFormat
from kvbridge.layouts.layout import KVLayout
from tests.connector.pair_harness import (
    FakeClock,
    Request,
    Side,
    decode_admit,
    loaded,
    make_side,
    prefill_finish,
    run_until,
    token_ids,
)

FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)


class Recording:
    """A real NIXL engine that logs its notification calls, in order."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def get_notifs(self) -> dict[str, list[bytes]]:
        self.calls.append("get_notifs")
        return self.inner.get_notifs()

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.calls.append(f"send {type(decode_notification(msg)).__name__}")
        self.inner.send_notif(peer, msg)


@pytest.fixture(params=[0, 1000], ids=["no-nixl-thread", "nixl-thread"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Side, Side, Recording]]:
    """``request.param``: prefill's ``extra.nixl_progress_us`` (the worker's engine here
    never runs NIXL's thread; the worker goes by its setting)."""
    clock = FakeClock()
    engines: list[Recording] = []

    def factory(name: str) -> Recording:
        engines.append(Recording(nixl_engine(name)))
        return engines[-1]

    prefill = make_side(
        "kv_producer",
        "prefill",
        16,
        FMT,
        "F",
        clock,
        lease_s=120.0,
        engine_factory=factory,
        extra={"nixl_progress_us": request.param},
    )
    try:
        decode = make_side("kv_consumer", "decode", 16, FMT, "F", clock)
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        yield prefill, decode, engines[0]
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def _rounds(prefill: Side, engine: Recording) -> list[list[str]]:
    """Prefill's progress rounds from now on, each as the engine calls it made."""
    rounds: list[list[str]] = []
    round_ = prefill.worker._round

    def recorded(*, step: bool = True) -> bool:
        engine.calls = []
        try:
            return round_(step=step)
        finally:
            rounds.append(engine.calls)

    prefill.worker._round = recorded  # type: ignore[method-assign]
    return rounds


def _load(prefill: Side, decode: Side, n: int) -> None:
    p = Request(f"p{n}", token_ids(150), KVTransferParams(do_remote_decode=True))
    d = Request(f"d{n}", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: loaded(decode, d.request_id), f"load {n}")


def test_the_round_that_answers_a_claim_moves_ucx_again_after_its_answer(pair):
    prefill, decode, engine = pair
    _load(prefill, decode, 1)  # prefill learns decode's agent (its answer waited for it)
    rounds = _rounds(prefill, engine)
    _load(prefill, decode, 2)
    [answering] = [r for r in rounds if "send Prepared" in r]
    if prefill.worker.config.extra.nixl_progress_us:  # get_notifs moves nothing then
        assert answering == ["get_notifs", "send Prepared"]
    else:
        assert answering == ["get_notifs", "send Prepared", "get_notifs"]
    others = [r for r in rounds if "send Prepared" not in r]
    assert others and all(r.count("get_notifs") == 1 for r in others)
