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

from kvbridge.connector.common.notifications import Pushed, decode_notification
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.scheduler.lifecycle import LoadState
from kvbridge.connector.worker.nixl_setup import nixl_engine
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


def _late_pair(
    clock: FakeClock, late: str, prefill_kw: dict, decode_kw: dict
) -> Iterator[tuple[Side, Side, LateTransport]]:
    """A prefill and a decode side; ``late`` ("decode" or "prefill") moves its transfers
    through a LateTransport, yielded third; both shut down afterwards."""
    transports: list[LateTransport] = []

    def factory(name: str) -> LateTransport:
        transports.append(LateTransport(nixl_engine(name)))
        return transports[-1]

    engines = {late: {"engine_factory": factory}}
    prefill = make_side(
        "kv_producer", "prefill", 16, FMT, "F", clock, **prefill_kw, **engines.get("prefill", {})
    )
    try:
        decode = make_side(
            "kv_consumer", "decode", 16, FMT, "F", clock, **decode_kw, **engines.get("decode", {})
        )
    except BaseException:
        prefill.worker.shutdown()
        raise
    try:
        yield prefill, decode, transports[0]
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


@pytest.fixture
def pair(clock: FakeClock) -> Iterator[tuple[Side, Side, LateTransport]]:
    yield from _late_pair(clock, "decode", {"lease_s": 120.0}, {"transfer_timeout_s": TIMEOUT_S})


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


def test_under_policy_fail_the_request_fails_at_its_deadline_and_its_blocks_wait(clock):
    """``failure_policy: fail``: the engine hears at the deadline (the client gets its
    error then), but the blocks stay the load's until the READ that may still land ended."""
    decode_kw = {"transfer_timeout_s": TIMEOUT_S, "failure_policy": "fail"}
    prefill, decode, late = next(
        fail_pair := _late_pair(clock, "decode", {"lease_s": 120.0}, decode_kw)
    )
    try:
        _start_load(prefill, decode, late)
        clock.now += TIMEOUT_S + 1
        events = decode.step()
        assert [f.request_id for f in events.failed] == ["d1"], "not failed at the deadline"
        assert decode.worker.metrics.loads_held == 1
        decode.sched.request_aborted("d1")  # the engine ends the request with the error
        assert decode.sched.defers_free("d1"), "its blocks were given back with a READ out"
        for _ in range(3):
            decode.step()
        assert "d1" not in decode.freed
        late.land(prefill.step)  # the abandoned READ arrives after all
        run_until([decode, prefill], lambda: "d1" in decode.freed, "the blocks given back")
        assert len(failed(decode, "d1")) == 1, "the failure was reported twice"
        assert decode.sched.load_outcomes[LoadState.FAILED] == 1
        assert not decode.sched.defers_free("d1")
        run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free p1 on Done")
    finally:
        fail_pair.close()


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


# ------------------------------------------------------------------ one lease, one clock


def _answered(prefill: Side, decode: Side, n: int) -> None:
    """Step both until decode got prefill's answer to its ``n``-th claim (the only
    notifications prefill sends a pull decode before Done are Prepared)."""
    run_until(
        [prefill, decode],
        lambda: decode.worker.metrics.notifications_received >= n,
        f"prefill's answer to claim {n}",
    )


@pytest.fixture
def long_pair(clock: FakeClock) -> Iterator[tuple[Side, Side, LateTransport]]:
    """Decode's deadline (1000 s) is longer than any hold prefill grants (MAX_HOLD_S)."""
    yield from _late_pair(clock, "decode", {"lease_s": 120.0}, {"transfer_timeout_s": 1000.0})


def test_a_read_is_claimed_and_counts_only_within_the_hold_prefill_promised(clock, long_pair):
    """Decode sends its claim with the READ; prefill answers a hold as a duration on its
    own clock (capped at MAX_HOLD_S). Decode's engine then stalls past that hold: the READ
    it finds landed may have read blocks prefill gave back, so the load fails, although
    decode's own deadline is far away."""
    from kvbridge.connector.worker.prefill.sender import MAX_HOLD_S

    prefill, decode, late = long_pair
    d = _start_load(prefill, decode, late)
    _answered(prefill, decode, 1)  # held MAX_HOLD_S from when decode sent it
    clock.now += MAX_HOLD_S + 10  # decode's engine stalls; prefill's lease ends meanwhile
    prefill.step()
    assert "p1" in prefill.freed
    late.land(prefill.step)  # the READ lands (what it read is no longer p1's)
    decode.step()
    [failure] = failed(decode, d.request_id)
    assert "after the hold prefill promised" in failure.reason
    assert not loaded(decode, d.request_id)


def test_a_read_running_past_half_its_hold_claims_again(clock, long_pair):
    """A long READ refreshes its claim at half the hold; prefill extends it; the READ
    that lands later than the first hold counts."""
    from kvbridge.connector.worker.prefill.sender import MAX_HOLD_S

    prefill, decode, late = long_pair
    d = _start_load(prefill, decode, late)
    _answered(prefill, decode, 1)
    clock.now += MAX_HOLD_S / 2 + 1
    decode.step()
    assert decode.worker.metrics.claims_sent == 2
    _answered(prefill, decode, 2)  # the refresh: another MAX_HOLD_S
    clock.now += MAX_HOLD_S / 2 + 10  # past the first hold, within the second
    prefill.step()
    assert "p1" not in prefill.freed
    late.land(prefill.step)
    run_until([decode, prefill], lambda: loaded(decode, d.request_id), "the load")
    assert not failed(decode, d.request_id)
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free on Done")


def test_an_abort_on_prefill_waits_for_the_claim_it_granted(clock, pair):
    """The prefill engine aborts a request decode is reading (claim granted): the blocks
    stay the request's until decode's Done, and the load lands exactly."""
    prefill, decode, late = pair
    d = _start_load(prefill, decode, late)
    _answered(prefill, decode, 1)
    prefill.sched.request_aborted("p1")
    for _ in range(3):
        prefill.step()
    assert "p1" not in prefill.freed, "an abort freed blocks a granted claim covers"
    assert prefill.sched.defers_free("p1")
    late.land(prefill.step)
    run_until([decode, prefill], lambda: loaded(decode, d.request_id), "the load")
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free on Done")


# ------------------------------------------------------------------ push mode


@pytest.fixture
def push_pair(clock: FakeClock) -> Iterator[tuple[Side, Side, LateTransport]]:
    """Push mode; prefill's WRITEs go through the LateTransport."""
    push = {"extra": {"transfer_mode": "push"}}
    yield from _late_pair(
        clock,
        "prefill",
        {"lease_s": 120.0, **push},
        {"transfer_timeout_s": TIMEOUT_S, **push},
    )


def test_a_push_past_decodes_deadline_holds_its_blocks_until_prefill_answers(clock, push_pair):
    """Prefill's WRITE is still on the wire at decode's deadline: decode fails the load
    but keeps its blocks out of the engine's hands (and prefill keeps its own pinned)
    until the WRITE ended and prefill answered; afterwards nothing changes them."""
    prefill, decode, late = push_pair
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: late.num_in_flight > 0, "prefill's WRITE to be posted")

    clock.now += TIMEOUT_S + 1
    for _ in range(3):
        decode.step()
        prefill.step()  # gets Done(ok=False): cancels, but the WRITE is still running
    assert not failed(decode, "d1"), "a failed load was reported while a WRITE could land"
    assert decode.sched.defers_free("d1")
    assert "p1" not in prefill.freed, "prefill freed blocks its WRITE still reads"
    assert decode.worker.metrics.loads_held == 1

    late.land(decode.step)  # the cancelled WRITE lands after all
    run_until([prefill, decode], lambda: bool(failed(decode, "d1")), "the held failure")
    assert not loaded(decode, "d1")
    given_back = _blocks(decode, d)
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free p1")
    assert late.num_in_flight == 0
    for _ in range(3):
        decode.step()
        prefill.step()
    assert torch.equal(_blocks(decode, d), given_back)
    assert prefill.worker.num_live_handles == 0
    # the WRITE carried its round's answer (ok): prefill sent no second one (ok=False),
    # which decode would have counted as a notification for no round
    assert decode.worker.metrics.bad_notifications == 0


def _standalone_pushed(late: LateTransport) -> list[Pushed]:
    """Record the Pushed answers prefill sends as standalone notifications."""
    sent: list[Pushed] = []
    real = late.inner.send_notif

    def send_notif(peer: str, msg: bytes) -> None:
        decoded = decode_notification(msg)
        if isinstance(decoded, Pushed):
            sent.append(decoded)
        real(peer, msg)

    late.send_notif = send_notif  # type: ignore[method-assign]
    return sent


def test_a_round_of_one_write_is_answered_by_that_write(clock, push_pair):
    """A cross-layer push is one WRITE: its completion notification is the Pushed, so
    decode learns the data is there when it is, not at prefill's next round; prefill
    sends no other answer."""
    prefill, decode, late = push_pair
    sent = _standalone_pushed(late)
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until([decode, prefill], lambda: late.num_in_flight > 0, "prefill's WRITE to be posted")
    assert len(late.queued) == 1
    carried = decode_notification(late.queued[0].notif)
    assert isinstance(carried, Pushed) and carried.ok and carried.round == 0
    assert carried.num_bytes == late.queued[0].handle.num_bytes

    late.land(decode.step)
    run_until([decode, prefill], lambda: bool(loaded(decode, "d1")), "the pushed load")
    assert torch.equal(_blocks(decode, d), _blocks(prefill, p)[:, : len(d.block_ids[0])])
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free p1")
    assert sent == []
    assert prefill.worker.metrics.pushes_written == 1
    assert prefill.worker.metrics.push_failures == 0  # decode's Done(ok) cancels nothing
    assert decode.worker.metrics.bad_notifications == 0


def test_a_refused_claim_leaves_the_rewrite_an_earlier_claim_reads(clock):
    """Reader A claimed the blocks rewritten for its plan and reads them; reader B asks
    for another arrangement of the same blocks: B is refused and A's blocks stay exactly
    as A was promised (a refusal undoes only what its own Prepare did)."""
    from kvbridge.connector.common.metadata import SendSpec
    from kvbridge.connector.common.metrics import ConnectorMetrics
    from kvbridge.connector.common.notifications import GroupRewrite, Prepare, WireArrangement
    from kvbridge.connector.worker.prefill.sender import Sender
    from kvbridge.layouts.arrangement import BlockArrangement

    hnd = CacheFormat(layout=KVLayout.HND)
    prefill = make_side("kv_producer", "prefill", 64, hnd, "F", clock, lease_s=30.0)
    try:
        sender = Sender(prefill.buffers, ConnectorMetrics(), clock=clock)
        sender.add(SendSpec(request_id="r", block_ids=((3, 4),), first_block=(0,), lease_s=30.0))
        native = WireArrangement.of(BlockArrangement(layout=KVLayout.HND))

        def prepare(chunks: int):
            dst = WireArrangement.of(BlockArrangement(layout=KVLayout.HND, num_chunks=chunks))
            return sender.on_prepare(
                Prepare(request_id="r", rewrites=[GroupRewrite(0, native, dst)], hold_s=10.0)
            )

        assert prepare(4).ok  # reader A
        promised = [t[[3, 4]].clone() for t in prefill.buffers.tensors]
        refused = prepare(2)  # reader B
        assert not refused.ok and "already rewritten" in refused.reason
        for want, t in zip(promised, prefill.buffers.tensors, strict=True):
            assert torch.equal(t[[3, 4]], want), "a refused claim undid another reader's rewrite"
        assert prepare(4).ok  # A's refresh: still the same arrangement
    finally:
        prefill.worker.shutdown()


def test_a_native_claim_on_a_block_rewritten_for_another_reader_is_refused(clock):
    """Two requests share a prefix block; reader A had it rewritten for its plan and
    reads it; reader B wants the other request's blocks as they are: refused by name
    (it would read A's arrangement as native bytes)."""
    from kvbridge.connector.common.metadata import SendSpec
    from kvbridge.connector.common.metrics import ConnectorMetrics
    from kvbridge.connector.common.notifications import GroupRewrite, Prepare, WireArrangement
    from kvbridge.connector.worker.prefill.sender import Sender
    from kvbridge.layouts.arrangement import BlockArrangement

    hnd = CacheFormat(layout=KVLayout.HND)
    prefill = make_side("kv_producer", "prefill", 64, hnd, "F", clock, lease_s=30.0)
    try:
        sender = Sender(prefill.buffers, ConnectorMetrics(), clock=clock)
        for rid, ids in (("a", (3, 4)), ("b", (3, 5))):  # block 3: a shared prefix
            sender.add(SendSpec(request_id=rid, block_ids=(ids,), first_block=(0,), lease_s=30.0))
        native = WireArrangement.of(BlockArrangement(layout=KVLayout.HND))
        dst = WireArrangement.of(BlockArrangement(layout=KVLayout.HND, num_chunks=4))
        rewrite = [GroupRewrite(0, native, dst)]
        assert sender.on_prepare(Prepare(request_id="a", rewrites=rewrite, hold_s=10.0)).ok
        refused = sender.on_prepare(Prepare(request_id="b", rewrites=[], hold_s=10.0))
        assert not refused.ok and "block 3 of group 0 is lent to another reader" in refused.reason
        assert sender.on_prepare(Prepare(request_id="b", rewrites=rewrite, hold_s=10.0)).ok
    finally:
        prefill.worker.shutdown()


def test_a_rewrite_of_a_block_another_reader_reads_natively_is_refused(clock):
    """The reverse order: reader A claimed request a's blocks as they are and reads them;
    reader B wants request b (sharing block 3) rewritten: refused, block 3 unchanged;
    once a's hold ended, b may be rewritten."""
    from kvbridge.connector.common.metadata import SendSpec
    from kvbridge.connector.common.metrics import ConnectorMetrics
    from kvbridge.connector.common.notifications import (
        Done,
        GroupRewrite,
        Prepare,
        WireArrangement,
    )
    from kvbridge.connector.worker.prefill.sender import Sender
    from kvbridge.layouts.arrangement import BlockArrangement

    hnd = CacheFormat(layout=KVLayout.HND)
    prefill = make_side("kv_producer", "prefill", 64, hnd, "F", clock, lease_s=30.0)
    try:
        sender = Sender(prefill.buffers, ConnectorMetrics(), clock=clock)
        for rid, ids in (("a", (3, 4)), ("b", (3, 5))):
            sender.add(SendSpec(request_id=rid, block_ids=(ids,), first_block=(0,), lease_s=30.0))
        native = WireArrangement.of(BlockArrangement(layout=KVLayout.HND))
        dst = WireArrangement.of(BlockArrangement(layout=KVLayout.HND, num_chunks=4))
        rewrite = [GroupRewrite(0, native, dst)]
        assert sender.on_prepare(Prepare(request_id="a", rewrites=[], hold_s=10.0)).ok
        before = [t[3].clone() for t in prefill.buffers.tensors]
        refused = sender.on_prepare(Prepare(request_id="b", rewrites=rewrite, hold_s=10.0))
        assert not refused.ok and "block 3 of group 0 is read in its native" in refused.reason
        for want, t in zip(before, prefill.buffers.tensors, strict=True):
            assert torch.equal(t[3], want)
        assert sender.on_done(Done(request_id="a", claims=[0]))  # ends its claim
        assert sender.on_prepare(Prepare(request_id="b", rewrites=rewrite, hold_s=10.0)).ok
    finally:
        prefill.worker.shutdown()


def test_under_policy_fail_an_engine_that_ends_the_request_first_counts_it_failed(clock):
    """vLLM reads a failing load's ``failed_recving`` and ends the request (an abort to
    the connector) before the connector folds the same report: still a failed load, its
    blocks given back once the READ ended."""
    decode_kw = {"transfer_timeout_s": TIMEOUT_S, "failure_policy": "fail"}
    pair = _late_pair(clock, "decode", {"lease_s": 120.0}, decode_kw)
    prefill, decode, late = next(pair)
    try:
        _start_load(prefill, decode, late)
        clock.now += TIMEOUT_S + 1
        decode.worker.bind_connector_metadata(decode.sched.build_connector_meta())
        decode.worker.start_load_kv()
        output = decode.worker.get_finished()
        assert [f.request_id for f in output.failing_loads] == ["d1"]
        decode.sched.request_aborted("d1")  # vLLM's order: the engine first
        events = decode.sched.update_connector_output(output)
        assert not events.failed and decode.sched.defers_free("d1")
        late.land(prefill.step)
        run_until([decode, prefill], lambda: "d1" in decode.freed, "the blocks given back")
        assert decode.sched.load_outcomes[LoadState.FAILED] == 1
        assert decode.sched.load_outcomes[LoadState.ABORTED] == 0
    finally:
        pair.close()
