"""kvbridge's kernels and NIXL's transfers in order, shown on CPU with a recording fake.

``RecordingOrder`` stands in for :class:`DeviceOrder` (whose marks are CUDA events on the
calling thread's stream, complete at once on CPU) and logs each mark next to what the test
records around it: NIXL reporting a READ done (a transfer engine that logs its polls), the
receiver's and sender's rewrite kernels (``rewrite_group``, wrapped), the notifications
prefill sends, and the moment the engine hears of the load. On a GPU the same marks are real
(``test_a_fence_waits_for_its_own_stream_not_the_engines``, gpu tier).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kvbridge.connector.common.notifications import Prepared
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.transport import TransferEngine, XferHandle, XferOp, XferState
from kvbridge.connector.worker.device_order import DeviceOrder, Mark
from kvbridge.connector.worker.nixl_setup import nixl_engine
from kvbridge.connector.worker.staging.arenas import StagingPool
from kvbridge.layouts.allocation import CacheFormat
from kvbridge.layouts.layout import KVLayout
from tests.connector.packed_engine import PACKED
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
from tests.connector.test_connector_pair import RecordingRepacker

Log = list[tuple[str, str]]
WAIT_S = 10.0


class RecordingOrder(DeviceOrder):
    """Logs each mark (a fence is a mark waited on) and whether it was waited on; with
    ``hold``, marks stay incomplete until :meth:`complete` (kernels still on the device)."""

    def __init__(self, device: torch.device, log: Log, *, hold: bool = False) -> None:
        super().__init__(device)
        self.log = log
        self.hold = hold
        self.marks: list[HeldMark] = []

    def mark(self, why: str) -> Mark:
        self.log.append(("fence", why))
        self.marks.append(HeldMark(why, self))
        return self.marks[-1]

    def complete(self) -> None:
        """The device caught up: every mark taken so far has completed."""
        self.hold = False
        for m in self.marks:
            m.pending = False


class HeldMark(Mark):
    __slots__ = ("pending", "waited")

    def __init__(self, why: str, order: RecordingOrder) -> None:
        super().__init__(why)
        self.pending = order.hold
        self.waited = False

    def done(self) -> bool:
        return not self.pending

    def wait(self) -> None:
        self.waited = True
        self.pending = False


class PollLog:
    """A transfer engine that logs when NIXL first reports a READ done."""

    def __init__(self, inner: TransferEngine, log: Log) -> None:
        self.inner = inner
        self.log = log
        self._seen: set[int] = set()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def poll(self, handle: XferHandle) -> XferState:
        state = self.inner.poll(handle)
        if state is XferState.DONE and handle.op is XferOp.READ and id(handle) not in self._seen:
            self._seen.add(id(handle))
            self.log.append(("read done", ""))
        return state


def _logged(monkeypatch: pytest.MonkeyPatch, module: str, what: str, log: Log) -> None:
    """Log every ``rewrite_group`` call made from ``module``."""
    real: Callable = __import__(module, fromlist=["rewrite_group"]).rewrite_group

    def rewrite_group(*args, **kwargs):
        log.append((what, ""))
        return real(*args, **kwargs)

    monkeypatch.setattr(f"{module}.rewrite_group", rewrite_group)


class LoggingRepacker(RecordingRepacker):
    """The engine's packer, logging when kvbridge hands it loaded pages to split."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log = log

    def split(self, group_id, pages, remote_block_size, slots, heads=None, layers=()) -> None:
        self.log.append(("split", ""))
        super().split(group_id, pages, remote_block_size, slots, heads, layers)


def _packed_pair(
    clock: FakeClock,
    log: Log,
    device_order: Callable[[torch.device], DeviceOrder],
    **decode_extra: object,
) -> tuple[Side, Side]:
    """Prefill pages of 64 tokens, engine-packed, into decode blocks of 16 through a
    staging arena of 2.5 pages: two rounds, each split by the (logging) engine."""
    prefill = make_side("kv_producer", "prefill", 64, PACKED, "F", clock, lease_s=30.0)
    slot = sum(
        prefill.buffers.layer_bytes(n).shape[1] for n in prefill.config.groups[0].layer_names
    )
    decode = make_side(
        "kv_consumer",
        "decode",
        16,
        PACKED,
        "F",
        clock,
        repacker=LoggingRepacker(log),
        device_order=device_order,
        extra={"staging_mib": 2.5 * slot / (1 << 20)},
        **decode_extra,
    )
    return prefill, decode


def test_receiver_kernels_run_after_the_reads_and_are_fenced_before_the_engine_hears(
    monkeypatch,
):
    """Larger engine-packed prefill pages through two staging slots, in two rounds: the
    engine's split of a round's pages (and any receiver rewrite) runs only after NIXL
    reported that round's READs done, its slots go back only after a fence (the next
    round's READs land there), and a fence closes every kernel before the engine is told
    the load is complete."""
    log: Log = []
    clock = FakeClock()
    _logged(monkeypatch, "kvbridge.connector.worker.decode.landing", "receiver rewrite", log)
    give_back = StagingPool.give_back

    def logged_give_back(pool: StagingPool, slots: np.ndarray) -> None:
        log.append(("slots back", ""))
        give_back(pool, slots)

    monkeypatch.setattr(StagingPool, "give_back", logged_give_back)
    prefill, decode = _packed_pair(
        clock,
        log,
        lambda device: RecordingOrder(device, log),
        engine_factory=lambda name: PollLog(nixl_engine(name), log),
    )
    try:
        p = Request("p1", token_ids(200), KVTransferParams(do_remote_decode=True))
        params = prefill_finish(prefill, p)
        d = Request("d1", p.prompt_token_ids, params)
        decode_admit(decode, d)

        def done() -> bool:
            if loaded(decode, "d1"):
                log.append(("engine told", ""))
                return True
            return False

        run_until([prefill, decode], done, "the load")
        kinds = [k for k, _ in log]
        kernels = [i for i, k in enumerate(kinds) if k in ("split", "receiver rewrite")]
        assert kinds.count("split") == 2, log  # one per round
        for n, i in enumerate(kernels, start=1):  # round n's kernel after its READ
            assert kinds[:i].count("read done") >= n, log
        fence = log.index(("fence", "load complete"))
        assert max(kernels) < fence < kinds.index("engine told"), log
        # each round's split is fenced before its slots go back for the next round's READs
        for i, k in enumerate(kinds):
            if k == "split":
                assert log[i + 1 : i + 3] == [("fence", "staged split"), ("slots back", "")], log
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_a_load_that_lands_as_nixl_moved_it_is_reported_without_a_fence():
    """Same format on both sides, pull: no kernel of kvbridge's or the engine's touches
    the blocks after NIXL's READs, so nothing is marked and the load is reported at once."""
    log: Log = []
    clock = FakeClock()
    fmt = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
    prefill = make_side("kv_producer", "prefill", 16, fmt, "F", clock, lease_s=30.0)
    decode = make_side(
        "kv_consumer",
        "decode",
        16,
        fmt,
        "F",
        clock,
        device_order=lambda device: RecordingOrder(device, log),
    )
    try:
        p = Request("p1", token_ids(200), KVTransferParams(do_remote_decode=True))
        params = prefill_finish(prefill, p)
        d = Request("d1", p.prompt_token_ids, params)
        decode_admit(decode, d)
        run_until([prefill, decode], lambda: loaded(decode, "d1"), "the load")
        assert decode.worker.metrics.receiver_rewrites == 0
        assert decode.worker.metrics.transfers == 1
        assert log == [], log
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


def test_a_load_with_receiver_kernels_is_reported_once_their_mark_completed():
    """Larger engine-packed prefill pages, split by the engine after the READs (as in the
    first test). The host never waits for the load's last kernels: the load is held back
    from the engine, step after step, while their mark is incomplete, and reported by the
    first step after it completed. Each staged split's mark is waited on (its slots go
    back to the next round's READs)."""
    clock = FakeClock()
    log: Log = []
    orders: list[RecordingOrder] = []

    def held_order(device: torch.device) -> RecordingOrder:
        orders.append(RecordingOrder(device, log, hold=True))
        return orders[-1]

    prefill, decode = _packed_pair(clock, log, held_order)
    try:
        p = Request("p1", token_ids(200), KVTransferParams(do_remote_decode=True))
        d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
        decode_admit(decode, d)
        order = orders[0]

        def landed() -> bool:
            return any(m.why == "load complete" for m in order.marks)

        run_until([prefill, decode], landed, "the load's last mark")
        *splits, last = order.marks
        assert [m.why for m in splits] == ["staged split"] * 2 and all(m.waited for m in splits)
        assert last.why == "load complete" and not last.done()
        for _ in range(20):
            decode.step()
            prefill.step()
        assert not loaded(decode, "d1") and not last.waited
        assert decode.worker.metrics.transfers == 0  # counted when reported
        # another peer's set-up holds the agent gate: the step's round is deferred, and
        # the load whose kernels finished is reported all the same (no NIXL call needed)
        with _gate_held(decode):
            deferred = decode.worker.metrics.rounds_deferred
            order.complete()
            decode.step()
            assert decode.worker.metrics.rounds_deferred > deferred
        assert loaded(decode, "d1") and not last.waited
        assert decode.worker.metrics.transfers == 1
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


@contextlib.contextmanager
def _gate_held(side: Side) -> Iterator[None]:
    """The worker's agent gate held by another thread, as a held peer set-up holds it."""
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with side.worker._gate.setup():
            inside.set()
            leave.wait(WAIT_S)

    thread = threading.Thread(target=hold, name="held-setup")
    thread.start()
    try:
        assert inside.wait(WAIT_S), f"timed out after {WAIT_S} s waiting for the gate"
        yield
    finally:
        leave.set()
        thread.join(WAIT_S)


def test_sender_rewrites_are_fenced_before_the_claim_is_answered(monkeypatch):
    """Prefill rewrites its blocks into decode's arrangement (permute after save): the
    fence comes after the rewrite kernels and before the Prepared that lets decode read."""
    log: Log = []
    clock = FakeClock()
    _logged(monkeypatch, "kvbridge.connector.worker.prefill.block_lending", "sender rewrite", log)
    prefill = make_side(
        "kv_producer",
        "prefill",
        64,
        CacheFormat(layout=KVLayout.NHD, cross_layer=True),
        "F",
        clock,
        lease_s=30.0,
        device_order=lambda device: RecordingOrder(device, log),
    )
    decode = make_side(
        "kv_consumer",
        "decode",
        16,
        CacheFormat(layout=KVLayout.HND, kernel_block_size=8),
        "F",
        clock,
    )
    sent = prefill.worker._outbox.send_raw

    def send_raw(agent: str, msg: object) -> bool:
        if isinstance(msg, Prepared) and msg.ok:
            log.append(("prepared sent", ""))
        return sent(agent, msg)

    prefill.worker._outbox.send_raw = send_raw  # type: ignore[method-assign]
    try:
        p = Request("p1", token_ids(200), KVTransferParams(do_remote_decode=True))
        params = prefill_finish(prefill, p)
        d = Request("d1", p.prompt_token_ids, params)
        decode_admit(decode, d)
        run_until([prefill, decode], lambda: loaded(decode, "d1"), "the load")
        kinds = [k for k, _ in log]
        assert prefill.worker.metrics.sender_rewrites > 0
        answer = kinds.index("prepared sent")
        rewrites = [i for i, k in enumerate(kinds) if k == "sender rewrite"]
        fences = [i for i, e in enumerate(log) if e == ("fence", "sender rewrite")]
        assert rewrites and max(rewrites) < answer, log
        assert any(max(rewrites) < f < answer for f in fences), log
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


@pytest.mark.gpu
def test_a_fence_waits_for_its_own_stream_not_the_engines() -> None:
    """gpu tier: a fence waits for the kernels the calling thread queued on its stream, not
    for a forward on another stream (a device-wide synchronize did); a mark is incomplete
    while its kernels run and complete after, without a wait."""
    device = torch.device("cuda")
    order = DeviceOrder(device)
    x = torch.zeros(64 << 20, device=device)
    engine = torch.cuda.Stream(device)
    with torch.cuda.stream(engine):
        torch.cuda._sleep(2_000_000_000)  # the engine's forward: ~1 s of GPU time
    x.fill_(3.0)  # kvbridge's kernel, on this thread's stream
    order.fence("test")
    assert torch.cuda.current_stream(device).query()
    assert not engine.query(), "the fence waited for the engine's stream"
    assert np.isclose(float(x.sum().cpu()), 3.0 * x.numel())
    torch.cuda._sleep(200_000_000)  # ~0.1 s ahead of the next kernel on our stream
    x.fill_(5.0)
    mark = order.mark("test")
    assert not mark.done()
    torch.cuda.current_stream(device).synchronize()
    assert mark.done() and float(x[-1].cpu()) == 5.0
    engine.synchronize()
