"""The progress thread's round that posts a push's WRITEs answers that push itself.

Over UCX's TCP path a WRITE completes on decode's acknowledgement, a round trip after the
post: traced on this project's VM, the one poll at the end of the posting round
(``Pusher.poll_posted``) came ~0.05 ms after the post and found the WRITE pending (done
~0.06 ms after it), so ``Pushed`` waited for the thread's next round, which the busy
interval, the share cap (as long again as the posting round) and a wake-up of the thread
put 0.7-1.2 ms later on an idle prefill (``docs/performance.md``, the handover's tax). A
round of the thread (``step=False``) now polls the WRITEs it posted until they are done,
for at most ``POSTED_WAIT_S``; the engine's own round polls them once (a wait there would
be the engine's). Two full connectors with real NIXL in one process (``pair_harness``);
prefill's engine reports each WRITE pending for its first polls, as over TCP, and moves
decode's UCX along before each poll (in one process nothing else would acknowledge it
while prefill's round runs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.transport import TransferEngine, XferHandle, XferState
from kvbridge.connector.worker import worker as worker_module
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
HELD_POLLS = 3  # a WRITE reads pending for its first polls, as over TCP


class Pumped:
    """Decode's real NIXL engine, whose UCX another side may move along (``pump``): what
    that reads is kept for decode's own next ``get_notifs``."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self._kept: dict[str, list[bytes]] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def pump(self) -> None:
        for agent, messages in self.inner.get_notifs().items():
            self._kept.setdefault(agent, []).extend(messages)

    def get_notifs(self) -> dict[str, list[bytes]]:
        self.pump()
        kept, self._kept = self._kept, {}
        return kept


class HeldWrites:
    """A real NIXL engine whose WRITEs read pending for their first ``HELD_POLLS`` polls;
    logs the WRITEs posted and each poll's answer, in order."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self.peer: Pumped | None = None  # decode's engine, moved along before each poll
        self.calls: list[str] = []
        self._writes: list[XferHandle] = []
        self._polls: Counter[int] = Counter()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def write(self, *args: object, **kwargs: object) -> XferHandle:
        handle = self.inner.write(*args, **kwargs)  # type: ignore[arg-type]
        self._writes.append(handle)
        self.calls.append("write")
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        if self.peer is not None:
            self.peer.pump()
        state = self.inner.poll(handle)
        if any(handle is w for w in self._writes):
            self._polls[id(handle)] += 1
            if self._polls[id(handle)] <= HELD_POLLS:
                state = XferState.PENDING
            self.calls.append(f"poll {state.value}")
        return state


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side, HeldWrites]]:
    clock = FakeClock()
    engines: list[HeldWrites] = []

    def factory(name: str) -> HeldWrites:
        engines.append(HeldWrites(nixl_engine(name)))
        return engines[-1]

    push = {"transfer_mode": "push"}
    prefill = make_side(
        "kv_producer",
        "prefill",
        16,
        FMT,
        "F",
        clock,
        lease_s=120.0,
        engine_factory=factory,
        extra=push,
    )
    decodes: list[Pumped] = []

    def decode_factory(name: str) -> Pumped:
        decodes.append(Pumped(nixl_engine(name)))
        return decodes[-1]

    try:
        decode = make_side(
            "kv_consumer", "decode", 16, FMT, "F", clock, engine_factory=decode_factory, extra=push
        )
    except BaseException:
        prefill.worker.shutdown()
        raise
    engines[0].peer = decodes[0]
    try:
        yield prefill, decode, engines[0]
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def _request(prefill: Side, decode: Side, n: int) -> Request:
    p = Request(f"p{n}", token_ids(150), KVTransferParams(do_remote_decode=True))
    d = Request(f"d{n}", p.prompt_token_ids, prefill_finish(prefill, p))
    prefill.step()  # the worker keeps p's blocks
    decode_admit(decode, d)
    return d


def _posting_round(prefill: Side, decode: Side, engine: HeldWrites, *, step: bool) -> list[str]:
    """Prefill's rounds (``step``: the engine's, else the thread's) until one posts the
    push's WRITE, decode stepping in between; that round's engine calls."""
    for _ in range(2000):
        decode.step()  # its first step sends the Push
        engine.calls = []
        assert prefill.worker._round(step=step)
        if "write" in engine.calls:
            return engine.calls
    raise AssertionError("no round of prefill posted the push's WRITE")


def test_the_threads_posting_round_polls_its_write_until_done(pair, monkeypatch):
    prefill, decode, engine = pair
    d = _request(prefill, decode, 1)  # the first load: handshakes, agents
    run_until([decode, prefill], lambda: loaded(decode, d.request_id), "load 1")
    monkeypatch.setattr(worker_module, "POSTED_WAIT_S", 60.0)  # no timing in this test
    d = _request(prefill, decode, 2)
    calls = _posting_round(prefill, decode, engine, step=False)
    # polled until done: held, then as long as the real WRITE ran
    assert calls[:1] == ["write"] and calls[-1:] == ["poll done"]
    assert set(calls[1:-1]) == {"poll pending"} and len(calls) >= 2 + HELD_POLLS
    pusher = prefill.worker._pusher
    assert pusher is not None and pusher.num_inflight == 0  # answered in that round
    run_until([decode, prefill], lambda: loaded(decode, d.request_id), "load 2")


def test_the_engines_posting_round_polls_its_write_once(pair, monkeypatch):
    prefill, decode, engine = pair
    d = _request(prefill, decode, 1)
    run_until([decode, prefill], lambda: loaded(decode, d.request_id), "load 1")
    monkeypatch.setattr(worker_module, "POSTED_WAIT_S", 60.0)
    d = _request(prefill, decode, 2)
    calls = _posting_round(prefill, decode, engine, step=True)
    assert calls == ["write", "poll pending"]
    pusher = prefill.worker._pusher
    assert pusher is not None and pusher.num_inflight == 1  # the next round answers it
    run_until([decode, prefill], lambda: loaded(decode, d.request_id), "load 2")
