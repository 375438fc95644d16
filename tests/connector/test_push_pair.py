"""Push mode through the whole lifecycle: two real connectors (scheduler + worker + NIXL)
in one process, prefill WRITEs into decode's blocks (and, for engine-packed pages decode
must stage, into decode's staging slots, round by round). Every test ends with both block
pools full: each block was freed exactly once."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kvbridge.connector.common.notifications import Push, decode_notification, encode_notification
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.scheduler.lifecycle import SendState
from kvbridge.connector.worker.prefill.push_writes import PushState
from kvbridge.handshake.description import parse_description
from kvbridge.layouts.allocation import CacheFormat, read_group_token_major
from kvbridge.layouts.layout import KVLayout
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

PREFILL_FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
DECODE_FMT = CacheFormat(layout=KVLayout.HND, kernel_block_size=8)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def made() -> Iterator[list[Side]]:
    """The sides a test built: shut down, last first, after it."""
    sides: list[Side] = []
    try:
        yield sides
    finally:
        for side in reversed(sides):
            side.worker.shutdown()


@pytest.fixture
def make_pair(clock: FakeClock, made: list[Side]) -> Callable[..., tuple[Side, Side]]:
    """``make_pair(kinds, prefill_mode, decode_mode)``; both shut down after the test."""

    def make(
        kinds: str = "F", prefill_mode: str = "push", decode_mode: str = "push"
    ) -> tuple[Side, Side]:
        prefill = make_side(
            "kv_producer",
            "prefill",
            64,
            PREFILL_FMT,
            kinds,
            clock,
            lease_s=30.0,
            extra={"transfer_mode": prefill_mode},
        )
        made.append(prefill)
        decode = make_side(
            "kv_consumer",
            "decode",
            16,
            DECODE_FMT,
            kinds,
            clock,
            extra={"transfer_mode": decode_mode},
        )
        made.append(decode)
        return prefill, decode

    return make


@pytest.fixture
def pair(make_pair) -> tuple[Side, Side]:
    return make_pair()


def _remote_decode() -> KVTransferParams:
    return KVTransferParams(do_remote_decode=True)


def _finish_decode(decode: Side, req: Request) -> None:
    delay, _ = decode.sched.request_finished(req, req.block_ids)
    if not delay:
        decode.pool.free([b for ids in req.block_ids for b in ids])


def _pools_full(*sides: Side) -> None:
    for s in sides:
        s.pool.assert_all_free()


@pytest.mark.parametrize("kinds", ["F", "FSM"])
def test_prefill_writes_decode_reads_nothing(make_pair, kinds):
    """With a state group and no resume block, decode resumes at the last state boundary."""
    prefill, decode = make_pair(kinds)
    p = Request("p1", token_ids(300), _remote_decode())
    params = prefill_finish(prefill, p)
    before = read_group_token_major(prefill.buffers, 0, np.array(p.block_ids[0]))
    d = Request("d1", p.prompt_token_ids, params)
    n = decode_admit(decode, d)
    assert n == (299 if kinds == "F" else 256)
    run_until([prefill, decode], lambda: loaded(decode, "d1") and "p1" in prefill.freed, "push")
    got = read_group_token_major(decode.buffers, 0, np.array(d.block_ids[0]))
    assert torch.equal(got[:, :, :n], before[:, :, :n])
    # the sender rewrote NHD 64 -> HND 16-token chunks after save, and restored after Done
    after = read_group_token_major(prefill.buffers, 0, np.array(p.block_ids[0]))
    assert torch.equal(after, before)
    pm, dm = prefill.worker.metrics, decode.worker.metrics
    assert pm.sender_rewrites > 0 and pm.sender_restores == pm.sender_rewrites
    assert dm.descriptors_posted == 0 and pm.descriptors_posted > 0
    assert pm.pushes_written == 1 and pm.push_failures == 0
    assert dm.bytes_read == pm.bytes_written > 0
    _finish_decode(decode, d)
    _pools_full(prefill, decode)


def _refused_load(prefill: Side, decode: Side) -> str:
    """A load the handshake refuses: it fails, prefill frees at once (the fake clock never
    moves: no lease), decode's blocks go back. Returns the failure's reason."""
    p = Request("p1", token_ids(150), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until(
        [prefill, decode],
        lambda: bool(failed(decode, "d1")) and "p1" in prefill.freed,
        "the failed load and prefill's free",
    )
    [failure] = failed(decode, "d1")
    _finish_decode(decode, d)
    return failure.reason


@pytest.mark.parametrize(("prefill_mode", "decode_mode"), [("pull", "push"), ("push", "pull")])
def test_modes_that_disagree_fail_the_load_by_name_and_free_prefill(
    make_pair, prefill_mode, decode_mode
):
    prefill, decode = make_pair("F", prefill_mode, decode_mode)
    reason = _refused_load(prefill, decode)
    assert "transfer_mode" in reason
    assert f"local='{decode_mode}' remote='{prefill_mode}'" in reason
    assert prefill.sched.send_outcomes == {SendState.DONE: 1}
    _pools_full(prefill, decode)


def test_a_decode_abort_while_the_push_is_asked_frees_both_sides(pair):
    prefill, decode = pair
    p = Request("p1", token_ids(150), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    # decode alone: handshake, then Push goes out; prefill has not seen it yet
    run_until([decode], lambda: decode.worker.metrics.notifications_sent >= 1, "Push sent")
    decode.sched.request_aborted("d1")
    assert decode.sched.defers_free("d1")
    run_until(
        [prefill, decode],
        lambda: "p1" in prefill.freed and "d1" in decode.freed,
        "both sides free after an abort mid-push",
    )
    decode.pool.free([b for ids in d.block_ids for b in ids])
    assert not loaded(decode, "d1")
    # the writes were cancelled or had completed before the Done; none is left running
    pusher = prefill.worker._pusher
    assert pusher is not None and pusher.num_inflight == 0
    _pools_full(prefill, decode)


def test_a_push_that_comes_before_prefill_worker_has_the_request_waits_for_it(pair, clock):
    """vLLM hands its worker a finished request with its next step, which under load may
    be seconds after the params reached decode: the Push waits for the request as long as
    the lease, not a fixed few seconds, and the load is written, not recomputed."""
    prefill, decode = pair
    p = Request("p1", token_ids(150), _remote_decode())
    params = prefill_finish(prefill, p)  # the scheduler finished p1; its worker has no step yet
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until([decode], lambda: decode.worker.metrics.notifications_sent >= 1, "Push sent")
    pusher = prefill.worker._pusher
    assert pusher is not None
    run_until(
        [decode], lambda: _worker_progress(prefill) and pusher.num_inflight == 1, "Push taken"
    )
    clock.now += 20.0  # a long engine step: more than the old fixed 5 s, less than the lease
    _worker_progress(prefill)
    assert pusher.num_inflight == 1 and prefill.worker.metrics.push_failures == 0
    run_until([prefill, decode], lambda: loaded(decode, "d1"), "d1 loaded")
    assert not failed(decode, "d1") and prefill.worker.metrics.push_failures == 0
    _finish_decode(decode, d)
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill frees p1 after Done")
    _pools_full(prefill, decode)


def _worker_progress(side: Side) -> bool:
    """The worker's own progress (notifications, pushes) without an engine step, as its
    idle-progress thread runs it: no scheduler metadata is handed over."""
    side.worker.get_finished()
    return True


def test_a_push_for_a_request_prefill_no_longer_keeps_is_refused_by_name(pair):
    prefill, decode = pair
    p = Request("p1", token_ids(150), _remote_decode())
    params = prefill_finish(prefill, p)
    prefill.step()  # the worker keeps p1 ...
    prefill.sched.request_aborted("p1")  # ... then the engine drops it
    prefill.pool.free(prefill.sched.take_blocks_to_free("p1") or ())
    run_until([prefill], lambda: prefill.worker.readers_done("p1") is None, "p1 dropped")
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until([prefill, decode], lambda: bool(failed(decode, "d1")), "the refused push")
    [failure] = failed(decode, "d1")
    assert "could not push" in failure.reason and "unknown request 'p1'" in failure.reason
    assert prefill.worker.metrics.push_failures == 1
    assert decode.worker.metrics.bytes_read == 0
    _finish_decode(decode, d)
    _pools_full(prefill, decode)


def test_a_pull_prefill_refuses_a_push_by_name(make_pair):
    """A Push that reaches a pull-mode prefill anyway (no handshake agreed on it)."""
    prefill, decode = make_pair("F", "pull", "pull")
    p = Request("p1", token_ids(100), _remote_decode())
    prefill_finish(prefill, p)
    msg = Push(
        request_id="p1",
        reader_engine_id="decode",
        reader_rank=0,
        reader_host="127.0.0.1",
        reader_port=decode.worker.side_channel_port,
        block_ids=[[0, 1]],
        start_token=0,
        end_token=99,
        rewrites=[],
        plan_digest="x",
        timeout_s=5.0,
    )
    engine = decode.worker._engine
    assert engine is not None
    with decode.worker._gate.setup():  # as the set-up thread would
        engine.add_peer(prefill.worker.description.nixl_metadata)
    assert prefill.worker._engine is not None  # as a handshake would have done it
    with prefill.worker._gate.setup():
        prefill.worker._engine.add_peer(decode.worker.description.nixl_metadata)
    with decode.worker._gate.setup():
        engine.send_notif(prefill.worker.agent_name, encode_notification(msg))
    replies: list = []

    def answered() -> bool:
        with decode.worker._gate.setup():  # decode's engine does not step here
            notifs = engine.get_notifs()
        replies.extend(decode_notification(m) for ms in notifs.values() for m in ms)
        return bool(replies)

    run_until([prefill], answered, "prefill's answer")
    [answer] = replies
    assert not answer.ok and "pull mode" in answer.reason
    prefill.sched.request_aborted("p1")
    prefill.pool.free(prefill.sched.take_blocks_to_free("p1") or ())
    run_until([prefill], lambda: prefill.worker.readers_done("p1") is None, "p1 dropped")
    _pools_full(prefill, decode)


# -- pages decode stages: prefill writes them into decode's staging slots, in rounds ------


@pytest.fixture
def make_staged_pair(clock: FakeClock, made: list[Side]) -> Callable[..., tuple[Side, Side]]:
    """``make_staged_pair(prefill_block, decode_block, staging_slots)``: engine-packed
    pages in push mode; decode's staging arena holds ``staging_slots`` prefill pages of
    every layer (tests/connector/packed_engine: the bytes stay comparable token-major)."""

    def make(prefill_block: int, decode_block: int, staging_slots: float) -> tuple[Side, Side]:
        prefill = make_side(
            "kv_producer",
            "prefill",
            prefill_block,
            PACKED,
            "F",
            clock,
            lease_s=30.0,
            extra={"transfer_mode": "push"},
        )
        made.append(prefill)
        slot = _slot_bytes(prefill)
        decode = make_side(
            "kv_consumer",
            "decode",
            decode_block,
            PACKED,
            "F",
            clock,
            repacker_for=HndRepacker,
            extra={"transfer_mode": "push", "staging_mib": staging_slots * slot / (1 << 20)},
        )
        made.append(decode)
        return prefill, decode

    return make


def _slot_bytes(prefill: Side) -> int:
    """One staging slot: a prefill page of every layer of the group."""
    return sum(
        prefill.buffers.layer_bytes(n).shape[1] for n in prefill.config.groups[0].layer_names
    )


def _tokens(side: Side, req: Request) -> torch.Tensor:
    return read_group_token_major(side.buffers, 0, np.array(req.block_ids[0]))


@pytest.mark.parametrize(
    ("prefill_block", "decode_block", "num_computed"),
    [(128, 32, 0), (128, 32, 96), (96, 128, 0), (96, 128, 128)],
)
def test_larger_packed_pages_are_pushed_into_staging_slots_in_rounds(
    make_staged_pair, prefill_block, decode_block, num_computed
):
    """Prefill pages larger than decode's blocks (or not dividing them) go whole into
    decode's two staging slots, two pages a round; decode's engine splits each round into
    its blocks. A decode prefix hit that ends inside a prefill page leaves it untouched."""
    prefill, decode = make_staged_pair(prefill_block, decode_block, staging_slots=2.5)
    p = Request("p1", token_ids(600), _remote_decode())
    params = prefill_finish(prefill, p)
    want = _tokens(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    assert decode_admit(decode, d, num_computed) == 599 - num_computed
    before = _tokens(decode, d)
    run_until([prefill, decode], lambda: loaded(decode, "d1") and "p1" in prefill.freed, "push")
    got = _tokens(decode, d)
    assert torch.equal(got[:, :, num_computed:599], want[:, :, num_computed:599])
    assert torch.equal(got[:, :, :num_computed], before[:, :, :num_computed])
    pages = -(-599 // prefill_block) - num_computed // prefill_block
    rounds = -(-pages // 2)
    pm, dm = prefill.worker.metrics, decode.worker.metrics
    assert (dm.staging_rounds, pm.pushes_written, pm.push_failures) == (rounds, rounds, 0)
    assert dm.descriptors_posted == 0 and pm.descriptors_posted == pages * 2  # page x layer
    assert dm.bytes_read == pm.bytes_written == pages * _slot_bytes(prefill)
    # the engine writes into every decode block a round touches (a block between two
    # rounds counts in both)
    first = num_computed // prefill_block
    touched = [
        np.unique(
            np.arange(max(lo, num_computed), min(lo + 2 * prefill_block, 599)) // decode_block
        )
        for lo in range(first * prefill_block, 599, 2 * prefill_block)
    ]
    assert dm.receiver_rewrites == sum(t.size for t in touched)
    assert decode.worker.num_leased_staging_bytes == 0
    _finish_decode(decode, d)
    _pools_full(prefill, decode)


def test_an_abort_between_pushed_rounds_returns_every_slot_and_frees_prefill(make_staged_pair):
    """Decode gives the load up while prefill owes it round 1: the round's slots stay out
    of the pool (prefill may be writing into them) until prefill answers the cancelled
    round; the fake clock never moves, so nothing expires meanwhile."""
    prefill, decode = make_staged_pair(128, 32, staging_slots=2.5)
    p = Request("p1", token_ids(600), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until([prefill, decode], lambda: decode.worker.metrics.staging_rounds == 1, "round 0")
    decode.sched.request_aborted("d1")
    decode.step()  # round 1 was just asked: its two slots are held, Done(ok=False) leaves
    assert decode.worker.num_leased_staging_bytes == 2 * _slot_bytes(prefill)
    run_until(
        [prefill, decode],
        lambda: (
            "p1" in prefill.freed
            and "d1" in decode.freed
            and decode.worker.num_leased_staging_bytes == 0
        ),
        "both sides to free and every staging slot to come back",
    )
    decode.pool.free([b for ids in d.block_ids for b in ids])
    assert not loaded(decode, "d1")
    assert prefill.worker.metrics.pushes_written == 1  # round 1: cancelled, and answered
    pusher = prefill.worker._pusher
    assert pusher is not None and pusher.num_inflight == 0
    assert prefill.worker.num_live_handles == 0
    _pools_full(prefill, decode)


def test_a_round_prefill_has_not_answered_holds_its_blocks_and_slots_until_it_does(
    make_staged_pair, clock
):
    """Prefill does not step (frozen): after decode gives up, round 0's blocks and slots
    stay out of the engine's hands however long it takes (a WRITE already posted cannot
    be cancelled), counted overdue after the transfer timeout; prefill's answer, once its
    WRITEs ended, gives them back and reports the failed load."""
    prefill, decode = make_staged_pair(128, 32, staging_slots=2.5)
    p = Request("p1", token_ids(600), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until([decode], lambda: decode.worker.metrics.notifications_sent >= 1, "round 0 sent")
    slots = 2 * _slot_bytes(prefill)
    assert decode.worker.num_leased_staging_bytes == slots
    decode.sched.request_aborted("d1")
    decode.step()
    for _ in range(3):  # far past the round's timeout: still held
        clock.now += 2 * decode.worker.config.transfer_timeout_s
        decode.step()
        assert decode.worker.num_leased_staging_bytes == slots
        assert "d1" not in decode.freed and decode.sched.defers_free("d1")
    assert decode.worker.metrics.held_overdue == 1
    run_until(
        [prefill, decode],
        lambda: "p1" in prefill.freed and "d1" in decode.freed,
        "prefill to answer the round and both sides to free",
    )
    assert decode.worker.num_leased_staging_bytes == 0
    decode.pool.free([b for ids in d.block_ids for b in ids])
    _pools_full(prefill, decode)


def test_a_push_waits_while_another_load_holds_every_staging_slot(make_staged_pair):
    """Two loads, two slots: the first load's rounds take both, so the second one's first
    Push goes without slots and its pages wait until slots come back; both land exactly."""
    prefill, decode = make_staged_pair(128, 32, staging_slots=2.5)
    pairs = []
    for i in range(2):
        p = Request(f"p{i}", token_ids(600, seed=i), _remote_decode())
        params = prefill_finish(prefill, p)
        d = Request(f"d{i}", p.prompt_token_ids, params)
        decode_admit(decode, d)
        pairs.append((p, d, _tokens(prefill, p)))
    run_until(
        [prefill, decode],
        lambda: all(loaded(decode, d.request_id) for _, d, _ in pairs),
        "both loads",
    )
    for _, d, want in pairs:
        assert torch.equal(_tokens(decode, d)[:, :, :599], want[:, :, :599])
    pm, dm = prefill.worker.metrics, decode.worker.metrics
    assert dm.staging_rounds == 6  # 5 pages each, at most 2 a round
    assert pm.pushes_written == dm.staging_rounds + 1  # d1's round 0 named no slot
    assert decode.worker.num_leased_staging_bytes == 0
    for _, d, _ in pairs:
        _finish_decode(decode, d)
    run_until([prefill, decode], lambda: len(prefill.freed) == 2, "prefill to free")
    _pools_full(prefill, decode)


def test_only_a_push_decode_with_packed_pages_advertises_its_staging_arena(
    make_staged_pair, make_pair
):
    """Registered before the description was built (prefill's NIXL metadata covers it),
    advertised whole; no other worker registers one up front."""
    prefill, decode = make_staged_pair(128, 32, staging_slots=2.5)
    arena = parse_description(decode.worker.description).staging
    assert arena is not None and arena.block_bytes == int(2.5 * _slot_bytes(prefill))
    assert prefill.worker.description.staging is None
    _, plain = make_pair()  # push between kvbridge layouts: nothing to stage
    assert plain.worker.description.staging is None


def test_a_pull_decode_with_packed_pages_registers_its_arena_at_startup(clock, made):
    """Pull: the arena exists from register_kv_caches on (not made inside the first load
    that stages, where it cost seconds: docs/handover.md), and is not advertised."""
    decode = make_side("kv_consumer", "decode", 32, PACKED, "F", clock, repacker_for=HndRepacker)
    made.append(decode)
    staging = decode.worker._receiver._staged._pools  # the worker's one StagingPools
    assert staging.region is not None
    assert decode.worker.description.staging is None


def test_a_staging_arena_too_small_for_one_page_fails_the_push_by_name(make_staged_pair):
    """Negotiation refuses the pair (the Push could not land): the load fails naming the
    knob and prefill frees at once."""
    prefill, decode = make_staged_pair(128, 32, staging_slots=0.5)
    assert "raise extra.staging_mib on decode" in _refused_load(prefill, decode)
    assert decode.worker.metrics.bytes_read == 0
    _pools_full(prefill, decode)


def test_a_push_from_a_decode_that_restarted_since_is_written_nowhere(pair, caplog):
    """A Push waits for its request; meanwhile decode restarted under the same engine id
    and address, and prefill's handshake found the new process (another NIXL agent). The
    Push names the old process's blocks, which are the new one's now: prefill writes
    nothing. Shown here by the Push coming from another agent than the one prefill now
    knows at decode's address (a restart in one test process also disconnects the old)."""
    prefill, decode = pair
    p = Request("p1", token_ids(150), _remote_decode())
    d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))  # no worker step yet
    decode_admit(decode, d)
    pusher = prefill.worker._pusher
    assert pusher is not None
    run_until([decode], lambda: _worker_progress(prefill) and pusher.num_inflight == 1, "Push")
    [(key, push)] = pusher._pushes.items()
    run_until(
        [decode],
        lambda: _worker_progress(prefill) and pusher._targets.get(push.key) is not None,
        "prefill's handshake with decode",
    )
    # the Push came from the process before the restart
    push.agent = "decode-before-a-restart"
    pusher._pushes = {(key[0], push.agent): push}
    run_until([prefill], lambda: push.state is not PushState.WAITING, "the Push to start")
    assert push.handles == [] and prefill.worker.num_live_handles == 0  # nothing posted
    assert "restarted since it asked" in caplog.text
    run_until([prefill], lambda: pusher.num_inflight == 0, "the Push to end")
