"""A peer's set-up held inside NIXL never holds the engine's step.

NIXL's ``add_remote_agent`` has held kvbridge workers for 17-98 s (docs/nixl-holds.md),
one of those times in CI with non-blocking connects in place and no cause found. Whatever
holds it, the engine's step must not wait: here decode's transfer engine holds every
``add_peer`` until the test lets it go. While it is held, decode's engine keeps stepping
(each step returns at once, its progress rounds deferred), a local decode request that
needs no peer goes on, and the load waits; once let go, the load lands byte for byte.
With ``add_peer`` back on the step (the code before this test), the first step that
applied the handshake waited the whole hold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

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
    failed,
    loaded,
    make_side,
    prefill_finish,
    run_until,
    token_ids,
)

FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
HOLD_LIMIT_S = 30.0  # the test lets the add go long before this
STEP_BOUND_S = 0.5  # one engine step while the add is held (a round takes milliseconds)


class HeldAdds:
    """Wraps a real engine; every ``add_peer`` waits until :attr:`let_go` is set."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self.let_go = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def add_peer(self, metadata: bytes) -> str:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.let_go.wait(HOLD_LIMIT_S), "add_peer held past the test's limit"
        return self.inner.add_peer(metadata)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pair(clock: FakeClock) -> Iterator[tuple[Side, Side, HeldAdds]]:
    held: list[HeldAdds] = []

    def factory(name: str) -> HeldAdds:
        held.append(HeldAdds(nixl_engine(name)))
        return held[-1]

    prefill = make_side("kv_producer", "prefill", 16, FMT, "F", clock, lease_s=120.0)
    try:
        decode = make_side("kv_consumer", "decode", 16, FMT, "F", clock, engine_factory=factory)
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        yield prefill, decode, held[0]
    finally:
        held[0].let_go.set()
        decode.worker.shutdown()
        prefill.worker.shutdown()


def _blocks(side: Side, req: Request) -> torch.Tensor:
    ids = torch.tensor(req.block_ids[0])
    return torch.stack([t[ids].clone() for t in side.buffers.tensors])


def _timed_step(side: Side) -> float:
    start = time.perf_counter()
    side.step()
    return time.perf_counter() - start


def test_a_held_add_peer_leaves_the_engine_stepping_and_the_load_lands_after(pair):
    prefill, decode, held = pair
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
    decode_admit(decode, d)
    worst = 0.0
    deadline = time.monotonic() + 10.0
    while not held.entered.is_set():  # the handshake comes back; its set-up starts
        assert time.monotonic() < deadline, "timed out waiting for decode's add_peer"
        worst = max(worst, _timed_step(decode))
        prefill.step()
    assert held.threads == ["kvbridge-peer-setup"]  # not the engine's thread

    # held: decode's engine keeps stepping; nothing of the load can move
    deferred_before = decode.worker.metrics.rounds_deferred
    for _ in range(50):
        worst = max(worst, _timed_step(decode))
        prefill.step()
    deferred = decode.worker.metrics.rounds_deferred - deferred_before
    print(f"held add_peer: slowest engine step {worst * 1e3:.1f} ms, {deferred} rounds deferred")
    assert worst < STEP_BOUND_S, f"an engine step took {worst:.3f} s while add_peer was held"
    assert deferred >= 50
    assert not loaded(decode, "d1") and not failed(decode, "d1")

    held.let_go.set()
    run_until([decode, prefill], lambda: loaded(decode, "d1"), "the load after the hold")
    assert not failed(decode, "d1")
    assert torch.equal(_blocks(decode, d), _blocks(prefill, p)[:, : len(d.block_ids[0])])
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free on Done")
    assert held.threads == ["kvbridge-peer-setup"]  # one add, made once


def test_a_step_never_calls_nixl_without_the_gate(pair):
    """Every NIXL call of a worker's engine checks the worker's agent gate: a call from a
    thread that does not hold it (a bug) fails by name instead of racing a set-up."""
    from kvbridge.connector.transfer.errors import TransferError

    prefill, _decode, _held = pair
    engine = prefill.worker._engine
    with pytest.raises(TransferError, match="without the owner's gate held"):
        engine.get_notifs()
    with prefill.worker._gate.setup():
        assert engine.get_notifs() == {}
