"""Push mode through the whole lifecycle: two real connectors (scheduler + worker + NIXL)
in one process, prefill WRITEs into decode's blocks. Every test ends with both block pools
full: each block was freed exactly once."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from connector.lifecycle import SendState
from connector.notifications import Push, decode_notification, encode_notification
from connector.params import KVTransferParams
from layouts.allocation import CacheFormat, read_group_token_major
from layouts.layout import KVLayout
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
def make_pair(clock: FakeClock) -> Iterator[Callable[..., tuple[Side, Side]]]:
    """``make_pair(kinds, prefill_mode, decode_mode)``; both shut down after the test."""
    made: list[Side] = []

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

    try:
        yield make
    finally:
        for side in reversed(made):
            side.worker.shutdown()


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


@pytest.mark.parametrize(("prefill_mode", "decode_mode"), [("pull", "push"), ("push", "pull")])
def test_modes_that_disagree_fail_the_load_by_name_and_free_prefill(
    make_pair, prefill_mode, decode_mode
):
    prefill, decode = make_pair("F", prefill_mode, decode_mode)
    p = Request("p1", token_ids(150), _remote_decode())
    params = prefill_finish(prefill, p)
    d = Request("d1", p.prompt_token_ids, params)
    decode_admit(decode, d)
    run_until(
        [prefill, decode],
        lambda: bool(failed(decode, "d1")) and "p1" in prefill.freed,
        "the failed load and prefill's free (the fake clock never moves: no lease)",
    )
    [failure] = failed(decode, "d1")
    assert "transfer_mode" in failure.reason
    assert f"local='{decode_mode}' remote='{prefill_mode}'" in failure.reason
    assert prefill.sched.send_outcomes == {SendState.DONE: 1}
    _finish_decode(decode, d)
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
    engine.add_peer(prefill.worker.description.nixl_metadata)
    assert prefill.worker._engine is not None  # as a handshake would have done it
    prefill.worker._engine.add_peer(decode.worker.description.nixl_metadata)
    engine.send_notif(prefill.worker.agent_name, encode_notification(msg))
    replies: list = []
    run_until(
        [prefill],
        lambda: (
            replies.extend(
                decode_notification(m) for ms in engine.get_notifs().values() for m in ms
            )
            or bool(replies)
        ),
        "prefill's answer",
    )
    [answer] = replies
    assert not answer.ok and "pull mode" in answer.reason
    prefill.sched.request_aborted("p1")
    prefill.pool.free(prefill.sched.take_blocks_to_free("p1") or ())
    run_until([prefill], lambda: prefill.worker.readers_done("p1") is None, "p1 dropped")
    _pools_full(prefill, decode)
