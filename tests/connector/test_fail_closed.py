"""Fail closed: whatever raises while one message, scheduler order or push round is handled
fails that unit alone, never the engine's call; success is reported on evidence only.

Two real connectors (scheduler + worker + NIXL) in one process, with one part of one side
made to raise or to lose a message; every test ends with both block pools full."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import pytest

from kvbridge.connector.common.notifications import (
    NotificationError,
    Pushed,
    decode_notification,
)
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.decode.claims import PROBE_S
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

PREFILL_FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
DECODE_FMT = CacheFormat(layout=KVLayout.HND, kernel_block_size=8)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def made() -> Iterator[list[Side]]:
    sides: list[Side] = []
    try:
        yield sides
    finally:
        for side in reversed(sides):
            side.worker.shutdown()


@pytest.fixture
def make_pair(clock: FakeClock, made: list[Side]) -> Callable[[str], tuple[Side, Side]]:
    def make(mode: str) -> tuple[Side, Side]:
        extra = {"transfer_mode": mode}
        prefill = make_side("kv_producer", "prefill", 64, PREFILL_FMT, "F", clock, extra=extra)
        made.append(prefill)
        decode = make_side("kv_consumer", "decode", 16, DECODE_FMT, "F", clock, extra=extra)
        made.append(decode)
        return prefill, decode

    return make


def _requests(prefill: Side, decode: Side, *names: str) -> list[Request]:
    """Prefill finishes ``p<name>``; decode admits ``d<name>`` to load it."""
    out = []
    for i, name in enumerate(names):
        p = Request(f"p{name}", token_ids(150, seed=i), KVTransferParams(do_remote_decode=True))
        d = Request(f"d{name}", p.prompt_token_ids, prefill_finish(prefill, p))
        decode_admit(decode, d)
        out.append(d)
    return out


def _finish(decode: Side, *requests: Request) -> None:
    for req in requests:
        delay, _ = decode.sched.request_finished(req, req.block_ids)
        if not delay:
            decode.pool.free([b for ids in req.block_ids for b in ids])


def _healthy(*sides: Side) -> None:
    for side in sides:
        assert side.worker.unhealthy_reason is None
        side.pool.assert_all_free()


def test_a_claim_whose_handling_raises_fails_that_load_alone(make_pair, monkeypatch):
    """One Prepare raising inside prefill (a bug, a value no check foresaw) is answered
    refused; the other claim of the same batch is served; the engine's calls never raise."""
    prefill, decode = make_pair("pull")
    sender = prefill.worker._sender
    real = sender.on_prepare

    def on_prepare(msg, agent=""):
        if msg.request_id == "p1":
            raise MemoryError("np.arange of 466 GiB")
        return real(msg, agent)

    monkeypatch.setattr(sender, "on_prepare", on_prepare)
    d1, d2 = _requests(prefill, decode, "1", "2")
    run_until(
        [prefill, decode],
        lambda: (
            loaded(decode, "d2")
            and bool(failed(decode, "d1"))
            and {"p1", "p2"} <= set(prefill.freed)
        ),
        "d2 loaded, d1 failed, both prefill holds ended",
    )
    assert not loaded(decode, "d1")
    [failure] = failed(decode, "d1")
    assert "MemoryError" in failure.reason
    m = prefill.worker.metrics
    assert m.peer_message_errors == 1 and m.peer_message_errors_by_kind == {"Prepare": 1}
    _finish(decode, d1, d2)
    _healthy(prefill, decode)


def test_a_send_order_that_raises_frees_that_request_and_adds_the_rest(make_pair, monkeypatch):
    """``reqs_to_send`` of one step: the order that raises is dropped (reported finished,
    so the engine frees its blocks); the next one is still added and served."""
    prefill, decode = make_pair("pull")
    sender = prefill.worker._sender
    real = sender.add

    def add(spec):
        if spec.request_id == "p1":
            raise OverflowError("Python int too large to convert to C long")
        real(spec)

    monkeypatch.setattr(sender, "add", add)
    d1, d2 = _requests(prefill, decode, "1", "2")
    run_until(
        [prefill, decode],
        lambda: (
            loaded(decode, "d2")
            and bool(failed(decode, "d1"))
            and {"p1", "p2"} <= set(prefill.freed)
        ),
        "p1 dropped and freed, d2 loaded",
    )
    assert prefill.worker.metrics.unit_errors_by_kind == {"order: send": 1}
    _finish(decode, d1, d2)
    _healthy(prefill, decode)


def test_a_push_whose_writes_raise_is_answered_failed_not_ok(make_pair, monkeypatch):
    """A round whose WRITEs could not be posted (numpy's OverflowError on a block id, a
    CUDA OOM in a gather) is answered failed: before, the exception escaped into the step
    and the next step answered the round ok with nothing written."""
    prefill, decode = make_pair("push")
    pusher = prefill.worker._pusher
    assert pusher is not None

    def post(push, peer, spec):
        raise OverflowError("Python int too large to convert to C long")

    monkeypatch.setattr(pusher._writes, "post", post)
    [d1] = _requests(prefill, decode, "1")
    run_until(
        [prefill, decode],
        lambda: bool(failed(decode, "d1")) and "p1" in prefill.freed,
        "d1 failed and p1 freed",
    )
    assert not loaded(decode, "d1")
    [failure] = failed(decode, "d1")
    assert "OverflowError" in failure.reason
    m = prefill.worker.metrics
    assert m.pushes_written == 0 and m.push_failures == 1
    _finish(decode, d1)
    _healthy(prefill, decode)


def test_a_push_round_is_answered_ok_only_when_every_planned_write_was_posted(
    make_pair, monkeypatch
):
    """Evidence, not the absence of an error: a round that posted fewer WRITEs than its
    plan requires (here the count it planned is one more) is answered failed."""
    prefill, decode = make_pair("push")
    pusher = prefill.worker._pusher
    assert pusher is not None
    real = pusher._writes.post

    def post(push, peer, spec):
        real(push, peer, spec)
        push.num_planned += 1  # one WRITE the plan requires was never posted
        push.carrier = None  # so the answer is the round's own, not a WRITE's

    monkeypatch.setattr(pusher._writes, "post", post)
    [d1] = _requests(prefill, decode, "1")
    run_until(
        [prefill, decode],
        lambda: bool(failed(decode, "d1")) and "p1" in prefill.freed,
        "d1 failed and p1 freed",
    )
    assert not loaded(decode, "d1")
    assert "WRITEs were posted" in failed(decode, "d1")[0].reason
    _finish(decode, d1)
    _healthy(prefill, decode)


def _garble_first_pushed(side: Side, monkeypatch) -> list[bytes]:
    """Decode receives the first ``Pushed`` unreadable (its bytes truncated)."""
    engine = side.worker._engine
    real = engine.get_notifs
    garbled: list[bytes] = []

    def get_notifs():
        out = {}
        for agent, messages in real().items():
            kept = []
            for raw in messages:
                if not garbled and _is_pushed(raw):
                    garbled.append(raw)
                    raw = raw[: len(raw) // 2]
                kept.append(raw)
            out[agent] = kept
        return out

    monkeypatch.setattr(engine, "get_notifs", get_notifs)
    return garbled


def _is_pushed(raw: bytes) -> bool:
    try:
        return isinstance(decode_notification(raw), Pushed)
    except NotificationError:
        return False


@pytest.mark.parametrize("held", [False, True], ids=["live", "held"])
def test_a_push_answer_that_arrives_unreadable_is_asked_for_again(
    make_pair, clock, monkeypatch, held
):
    """A round's answer lost on the way: decode asks the prefill that owes it
    (``PushStatus``), which no longer runs the round and says so; the load fails (live),
    or the failed load held for that round is released (held), instead of holding decode's
    blocks for as long as the prefill lives."""
    prefill, decode = make_pair("push")
    garbled = _garble_first_pushed(decode, monkeypatch)
    [d1] = _requests(prefill, decode, "1")
    run_until([prefill, decode], lambda: bool(garbled), "the round's answer (garbled)")
    assert decode.worker.metrics.bad_notifications == 1
    receiver = decode.worker._receiver
    if held:  # the load times out while its round's answer is owed: held for it
        clock.now += decode.worker.config.transfer_timeout_s + 1
        run_until([decode], lambda: receiver.num_held == 1, "the failed load held")
    clock.now += PROBE_S + 0.5
    run_until(
        [prefill, decode],
        lambda: bool(failed(decode, "d1")) and receiver.num_held == 0,
        "the load failed and nothing held",
    )
    assert not loaded(decode, "d1")
    if not held:
        assert "does not run here" in failed(decode, "d1")[0].reason
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "p1 freed")
    _finish(decode, d1)
    assert decode.worker.num_leased_staging_bytes == 0 and decode.worker.num_live_handles == 0
    _healthy(prefill, decode)


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("Push", {"block_ids": [[2**63]]}),
        ("Push", {"block_ids": [[-2]]}),
        ("Push", {"end_token": 2**62}),
        ("Push", {"timeout_s": float("nan")}),
        ("Push", {"reader_rank": -1}),
        ("Prepare", {"end_token": 2**62}),
        ("Prepare", {"hold_s": float("inf")}),
        ("Prepare", {"request_id": ""}),
        ("Done", {"readers": 0}),
        ("Done", {"claims": [-1]}),
        ("Pushed", {"round": 2**31}),
        ("Prepared", {"packed_at": -2}),
        ("Heartbeat", {"request_ids": [""]}),
    ],
)
def test_out_of_bounds_fields_are_refused_when_decoded(kind, fields):
    """Each field's bound refuses the message whole; the base message (with a -1
    placeholder among decode's block ids, as a sliding window sends) decodes."""
    base = {
        "Push": {
            "request_id": "r",
            "reader_engine_id": "d",
            "reader_rank": 0,
            "reader_host": "127.0.0.1",
            "reader_port": 1,
            "block_ids": [[-1, 1]],
            "start_token": 0,
            "end_token": 16,
            "rewrites": [],
            "plan_digest": "x",
            "timeout_s": 1.0,
        },
        "Prepare": {"request_id": "r", "rewrites": []},
        "Done": {"request_id": "r"},
        "Pushed": {"request_id": "r", "ok": True},
        "Prepared": {"request_id": "r", "ok": True},
        "Heartbeat": {"request_ids": []},
    }[kind]
    good = msgspec.msgpack.encode({"type": kind, **base})
    assert type(decode_notification(good)).__name__ == kind  # the base itself is fine
    with pytest.raises(NotificationError):
        decode_notification(msgspec.msgpack.encode({"type": kind, **base, **fields}))


def test_a_source_counts_nothing_from_another_incarnation_at_its_address(make_pair, clock, made):
    """Claims, READs and answers belong to the NIXL agent that granted them: once the
    peer at a source's (engine id, rank) is another process (a prefill restarted under the
    same id, handshaken again for another load), the source fails by name, and no claim,
    READ or round goes to the new process. Before, the source looked the peer up again by
    key: the old process's answer no longer matched, and the load waited for its deadline
    (a staged pull round READ the new process's memory at the old block ids)."""
    prefill, decode = make_pair("pull")
    [d1] = _requests(prefill, decode, "1")
    # decode alone: the handshake, then the claim goes out (a rewrite is due: PREPARING)
    run_until([decode], lambda: decode.worker.metrics.claims_sent >= 1, "the claim sent")
    again = make_side(
        "kv_producer", "prefill", 64, PREFILL_FMT, "F", clock, extra={"transfer_mode": "pull"}
    )
    made.append(again)
    peers = decode.worker._peers
    key = ("prefill", 0)
    old = peers.get(key).agent
    # the directory knows the other process at the key now (as a re-handshake does)
    peers.drop(key, "restarted (test)")
    peers.ensure(key, "127.0.0.1", again.worker.side_channel_port, for_read=True)
    posted = decode.worker.metrics.descriptors_posted
    run_until([prefill, decode], lambda: bool(failed(decode, "d1")), "d1 failed")
    [failure] = failed(decode, "d1")
    assert "restarted since this load began" in failure.reason and old in failure.reason
    assert decode.worker.metrics.descriptors_posted == posted  # nothing read from either
    assert again.worker.metrics.notifications_received == 0  # no claim went to it
    clock.now += 120.0  # decode's Done went to the other process: p1 ends with its lease
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "p1 freed")
    _finish(decode, d1)
    _healthy(prefill, decode)


def test_the_wire_names_of_layouts_and_head_orders_are_the_enums_values():
    from typing import get_args

    from kvbridge.connector.common.notifications import HeadsName, LayoutName
    from kvbridge.layouts.arrangement import HeadOrder

    assert set(get_args(LayoutName)) == {e.value for e in KVLayout}
    assert set(get_args(HeadsName)) == {e.value for e in HeadOrder}


def test_a_string_that_is_not_utf8_is_a_notification_error():
    raw = msgspec.msgpack.encode({"type": "Done", "request_id": "r"}).replace(b"\xa1r", b"\xa1\xff")
    with pytest.raises(NotificationError, match="UnicodeDecodeError"):
        decode_notification(raw)


def test_push_rounds_a_silent_prefill_owes_count_against_the_quarantine_cap(clock, made):
    """A prefill that takes a Push and goes silent (frozen: its kernel still accepts what
    decode sends) holds decode's blocks through the round it owes; those blocks count in
    the per-prefill quarantine gauge and its cap, as held READs do (before: push rounds
    counted zero, so one stuck prefill could drain the pool in push mode)."""
    extra = {"transfer_mode": "push", "max_quarantined_mib": 0.001}
    prefill = make_side("kv_producer", "prefill", 64, PREFILL_FMT, "F", clock, extra=extra)
    made.append(prefill)
    decode = make_side("kv_consumer", "decode", 16, DECODE_FMT, "F", clock, extra=extra)
    made.append(decode)
    [d1] = _requests(prefill, decode, "1")
    m = decode.worker.metrics
    run_until([decode], lambda: m.notifications_sent >= 1, "the Push sent")
    clock.now += decode.worker.config.transfer_timeout_s + 1  # prefill never stepped
    receiver = decode.worker._receiver
    run_until([decode], lambda: receiver.num_held == 1, "the failed load held for its round")
    [(agent, (rows, num_bytes))] = m.quarantined.items()
    blocks = sum(len(ids) for ids in d1.block_ids)
    per_block = decode.buffers.group_block_bytes(0)
    assert agent == prefill.worker.agent_name
    assert (rows, num_bytes) == (blocks, blocks * per_block)
    assert m.quarantine_caps == 1  # over 0.001 MiB: no new load from that prefill
    # it thaws: the round is answered (or asked about), nothing is held any more
    run_until([prefill, decode], lambda: receiver.num_held == 0, "the held round ended")
    assert m.quarantined == {}
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "p1 freed")
    _finish(decode, d1)
    _healthy(prefill, decode)


def test_a_landing_that_raises_fails_its_load_once(make_pair, monkeypatch):
    """A torch error in a receiver rewrite (a CUDA out-of-memory) fails that load, once:
    before, only KVBridgeError was caught there, the error escaped into the step and the
    next step landed (rewrote) the same load again."""
    prefill, decode = make_pair("pull")
    landing = decode.worker._receiver._outcomes._landing
    calls = []

    def finish(load):
        calls.append(load.spec.request_id)
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(landing, "finish", finish)
    [d1] = _requests(prefill, decode, "1")
    run_until(
        [prefill, decode],
        lambda: bool(failed(decode, "d1")) and "p1" in prefill.freed,
        "d1 failed and p1 freed",
    )
    assert calls == ["d1"] and not loaded(decode, "d1")
    assert "CUDA out of memory" in failed(decode, "d1")[0].reason
    _finish(decode, d1)
    _healthy(prefill, decode)


def test_a_failed_load_whose_kernels_may_still_run_is_reported_after_them(clock, made):
    """A load that fails after kvbridge queued kernels on its blocks (here a landing that
    raises midway) is reported once a mark taken at the failure completed: the engine
    never gets blocks a kernel of ours may still write (GPU streams; a fake order here)."""
    from tests.connector.test_device_order import RecordingOrder

    log: list = []
    orders: list[RecordingOrder] = []

    def order(device):
        orders.append(RecordingOrder(device, log, hold=True))
        return orders[-1]

    prefill = make_side("kv_producer", "prefill", 64, PREFILL_FMT, "F", clock)
    made.append(prefill)
    decode = make_side("kv_consumer", "decode", 16, DECODE_FMT, "F", clock, device_order=order)
    made.append(decode)
    landing = decode.worker._receiver._outcomes._landing

    def finish(load):
        load.kernels = True  # a rewrite was queued, then something raised
        raise RuntimeError("CUDA out of memory")

    landing.finish = finish
    [d1] = _requests(prefill, decode, "1")
    run_until([prefill, decode], lambda: ("fence", "load failed") in log, "the failure's mark")
    for _ in range(5):
        decode.step()
    assert not failed(decode, "d1")  # its kernels have not finished
    orders[-1].complete()
    run_until([prefill, decode], lambda: bool(failed(decode, "d1")), "d1 reported failed")
    run_until([prefill, decode], lambda: "p1" in prefill.freed, "p1 freed")
    _finish(decode, d1)
    _healthy(prefill, decode)


def test_a_read_whose_post_failed_midway_stays_held_with_its_load(make_pair, monkeypatch):
    """NIXL can fail a post after issuing part of it (PostFailedError carries the
    released handle): the load fails and its blocks stay held like any READ that may
    still run, until its peer is confirmed gone; before, the handle was dropped and the
    blocks went back while the issued part could still land."""
    from kvbridge.connector.transfer.transport import PostFailedError

    prefill, decode = make_pair("pull")
    engine = decode.worker._engine
    real = engine.read

    def read(*args, **kwargs):
        handle = real(*args, **kwargs)
        engine.release(handle)
        raise PostFailedError("flush failed after 3 of 4 descriptors (test)", handle)

    monkeypatch.setattr(engine, "read", read)
    _requests(prefill, decode, "1")
    receiver = decode.worker._receiver
    run_until([prefill, decode], lambda: receiver.num_held == 1, "the failed load held")
    for _ in range(5):
        decode.step()
    assert receiver.num_held == 1 and not failed(decode, "d1")  # held: its peer lives
    [(agent, (rows, num_bytes))] = decode.worker.metrics.quarantined.items()
    assert agent == prefill.worker.agent_name and rows > 0 and num_bytes > 0
