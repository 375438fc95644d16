"""Readers in the protocol: a claim belongs to the reader that made it.

The same params reach two decodes whenever a router retries or hedges a decode request,
or a client replays them. Each decode claims prefill's blocks for itself; one reader's
``Done`` ends its own claim only, so the blocks stay the request's until every reader
granted a claim said Done or ran out of time. Within one decode, a duplicate request with
the same params (aborted, or a full prefix hit) never sends a ``Done`` for a prefill
request another local request is still loading.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvbridge.connector.common.metadata import SendSpec
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import Done, Heartbeat, Prepare
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.nixl_setup import nixl_engine
from kvbridge.connector.worker.prefill.holds import MAX_READERS
from kvbridge.connector.worker.prefill.sender import MAX_HOLD_S, Sender
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.groups import KVCacheConfig
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
from tests.handshake.plan_harness import make_groups

FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
LEASE_S = 30.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def sender(clock: FakeClock) -> Sender:
    buffers = KVCacheBuffers(KVCacheConfig.uniform(make_groups(16, "F"), 16), FMT, "cpu")
    s = Sender(buffers, ConnectorMetrics(), clock=clock)
    s.add(SendSpec(request_id="r", block_ids=((1, 2),), first_block=(0,), lease_s=LEASE_S))
    return s


def _claim(sender: Sender, agent: str, claim: int, hold_s: float = 60.0, rank: int = 0) -> bool:
    answer = sender.on_prepare(
        Prepare(request_id="r", rewrites=[], hold_s=hold_s, claim=claim, reader_rank=rank), agent
    )
    assert answer is not None
    return answer.ok


def _finished(sender: Sender) -> set[str]:
    finished, _expired = sender.take_results()
    return finished


# ------------------------------------------------------------------ the sender's rules


def test_one_readers_done_does_not_end_the_hold_another_was_granted(clock, sender):
    """Decodes A and B both claim r for 60 s; A's Done at t = 1 s ends A's claim only:
    r stays kept until B's Done (a Done naming A's claim would not do it either)."""
    assert _claim(sender, "decode-a", claim=1)
    assert _claim(sender, "decode-b", claim=7)
    clock.now += 1
    assert sender.on_done(Done(request_id="r", claims=[1]), "decode-a")
    sender.expire()
    assert _finished(sender) == set(), "A's Done freed blocks B was promised"
    assert not _claim(sender, "decode-c", claim=3), "a new reader got a hold that is ending"
    assert _claim(sender, "decode-b", claim=8), "B could not extend its own running claim"
    clock.now += 30
    sender.expire()
    assert _finished(sender) == set()
    assert sender.on_done(Done(request_id="r", claims=[7, 8]), "decode-b")
    assert _finished(sender) == {"r"}


def test_a_claim_without_its_readers_done_ends_when_its_time_is_up(clock, sender):
    assert _claim(sender, "decode-a", claim=1, hold_s=10.0)
    assert _claim(sender, "decode-b", claim=1, hold_s=90.0)  # same number, another reader
    assert sender.on_done(Done(request_id="r", claims=[1]), "decode-a")
    clock.now += 89
    sender.expire()
    assert _finished(sender) == set()
    clock.now += 2  # B's 90 s ran out without its Done: no claim is left
    sender.expire()
    assert _finished(sender) == {"r"}


def test_a_done_that_names_no_claim_ends_none(clock, sender):
    """A duplicate request on decode A (same params, aborted while its twin loads) sends
    a Done naming no claim: the twin's claim, from the same agent, still holds."""
    assert _claim(sender, "decode-a", claim=4)
    assert sender.on_done(Done(request_id="r", ok=False, claims=[]), "decode-a")
    sender.expire()
    assert _finished(sender) == set()
    clock.now += 61
    sender.expire()
    assert _finished(sender) == {"r"}


def test_tensor_parallel_readers_each_say_done(clock, sender):
    """Two decode ranks (two agents) read this rank's heads: the first rank's Done ends
    its claim, the hold waits for the second rank's Done although it claimed later."""
    assert _claim(sender, "decode-r0", claim=1, rank=0)
    assert sender.on_done(Done(request_id="r", readers=2, reader_rank=0, claims=[1]), "decode-r0")
    assert _finished(sender) == set()
    assert _claim(sender, "decode-r1", claim=1, rank=1)
    assert sender.on_done(Done(request_id="r", readers=2, reader_rank=1, claims=[1]), "decode-r1")
    assert _finished(sender) == {"r"}
    assert not sender.on_done(Done(request_id="r", claims=[1]), "decode-r1")  # late


def test_an_abort_waits_for_every_reader_granted(clock, sender):
    assert _claim(sender, "decode-a", claim=1, hold_s=20.0)
    assert _claim(sender, "decode-b", claim=1, hold_s=40.0)
    sender.abort("r")
    assert sender.on_done(Done(request_id="r", claims=[1]), "decode-a")
    clock.now += 30
    sender.expire()
    assert _finished(sender) == set()
    assert sender.on_done(Done(request_id="r", claims=[1]), "decode-b")
    assert _finished(sender) == {"r"}


def test_a_claim_from_an_older_decode_is_refused_by_name(sender):
    answer = sender.on_prepare(Prepare(request_id="r", rewrites=[], version=1), "old-decode")
    assert answer is not None and not answer.ok
    assert "Prepare version 1" in answer.reason and "upgrade decode" in answer.reason


# ------------------------------------------------------------------ end to end, two decodes


@pytest.fixture
def trio(clock: FakeClock) -> Iterator[tuple[Side, Side, Side, LateTransport]]:
    """A prefill, a slow decode (its READs land when the test says) and a fast one."""
    late: list[LateTransport] = []

    def factory(name: str) -> LateTransport:
        late.append(LateTransport(nixl_engine(name)))
        return late[-1]

    sides: list[Side] = []
    try:
        sides.append(make_side("kv_producer", "prefill", 16, FMT, "F", clock, lease_s=LEASE_S))
        sides.append(
            make_side(
                "kv_consumer",
                "decode-slow",
                16,
                FMT,
                "F",
                clock,
                engine_factory=factory,
                transfer_timeout_s=120.0,
            )
        )
        sides.append(make_side("kv_consumer", "decode-fast", 16, FMT, "F", clock))
        yield sides[0], sides[1], sides[2], late[0]
    finally:
        for side in reversed(sides):
            side.worker.shutdown()


def _blocks(side: Side, req: Request) -> torch.Tensor:
    ids = torch.tensor(req.block_ids[0])
    return torch.stack([t[ids].clone() for t in side.buffers.tensors])


def test_a_retried_decode_request_never_reads_blocks_the_first_ones_done_freed(clock, trio):
    """The router retried a decode request: the slow decode claimed p1 and READs, the
    fast one loads the same params and says Done first. Prefill keeps p1 for the slow
    reader (freed, another request would overwrite it at once); the slow READ lands the
    prompt's exact KV and its Done frees the blocks."""
    prefill, slow, fast, late = trio
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    params = prefill_finish(prefill, p)
    kv = _blocks(prefill, p)
    s = Request("s1", p.prompt_token_ids, params)
    decode_admit(slow, s)
    run_until([slow, prefill], lambda: late.num_in_flight > 0, "the slow decode's READ")
    run_until(
        [prefill, slow],
        lambda: slow.worker.metrics.notifications_received >= 1,
        "prefill's answer to the slow decode's claim",
    )
    f = Request("f1", p.prompt_token_ids, params)
    decode_admit(fast, f)
    run_until([fast, prefill], lambda: loaded(fast, "f1"), "the fast decode's load")
    run_until(
        [prefill, fast],
        lambda: prefill.worker.readers_done("p1") != (),  # (0,), or None once freed
        "prefill to get the fast decode's Done",
    )
    for _ in range(3):
        prefill.step()
    assert "p1" not in prefill.freed, "the fast reader's Done freed the slow reader's blocks"

    late.land(prefill.step)
    run_until([slow, prefill], lambda: loaded(slow, "s1"), "the slow decode's load")
    assert not failed(slow, "s1")
    n = len(s.block_ids[0])
    assert torch.equal(_blocks(slow, s)[:, : n - 1], kv[:, : n - 1])
    run_until([prefill, slow], lambda: "p1" in prefill.freed, "prefill to free after both")


def test_a_duplicate_aborted_while_its_twin_loads_sends_no_done(clock, trio):
    """Decode gets the same params twice (a client replayed them); the second request
    is aborted while the first still loads: prefill hears no Done for p1 from it."""
    prefill, slow, _fast, late = trio
    p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
    params = prefill_finish(prefill, p)
    first = Request("s1", p.prompt_token_ids, params)
    decode_admit(slow, first)
    run_until([slow, prefill], lambda: late.num_in_flight > 0, "the first request's READ")
    twin = Request("s2", p.prompt_token_ids, params)
    decode_admit(slow, twin)
    slow.sched.request_aborted("s2")
    for _ in range(3):
        slow.step()
        prefill.step()
    assert prefill.worker.readers_done("p1") == (), "the aborted twin told prefill Done"
    late.land(prefill.step)
    run_until([slow, prefill], lambda: loaded(slow, "s1"), "the first request's load")
    run_until([prefill, slow], lambda: "p1" in prefill.freed, "prefill to free p1 on Done")


def test_a_readers_second_load_ends_its_second_claim(clock, sender):
    """Decode rank 0 loaded r and said Done, then loads it again (replayed params): its
    second claim ends with its second Done, not when the claim's time is up."""
    assert _claim(sender, "decode-r0", claim=1, rank=0)
    assert sender.on_done(Done(request_id="r", readers=2, reader_rank=0, claims=[1]), "decode-r0")
    assert _claim(sender, "decode-r0", claim=5, rank=0)  # the replay
    assert _claim(sender, "decode-r1", claim=1, rank=1)
    assert sender.on_done(Done(request_id="r", readers=2, reader_rank=1, claims=[1]), "decode-r1")
    assert _finished(sender) == set()  # rank 0's second claim runs
    assert sender.on_done(Done(request_id="r", readers=2, reader_rank=0, claims=[5]), "decode-r0")
    assert _finished(sender) == {"r"}


def test_a_reader_with_a_running_claim_still_sees_the_request_while_it_ends(clock, sender):
    """B's Done makes r's hold end; A's claim still runs, so A's next push round finds the
    blocks (``kept`` for A), a reader without a claim does not."""
    assert _claim(sender, "decode-a", claim=0)
    assert _claim(sender, "decode-b", claim=0)
    assert sender.on_done(Done(request_id="r", claims=[0]), "decode-b")
    assert sender.kept("r") is None and sender.has_ended("r")
    assert sender.kept("r", ("decode-a", 0)) is not None
    assert not sender.has_ended("r", ("decode-a", 0))
    assert sender.kept("r", ("decode-c", 0)) is None


def test_a_claim_sent_again_before_the_request_arrives_is_answered_once(clock, sender):
    """Decode resends an unanswered claim every 2 s while prefill's engine has not handed
    the request over: the request, once added, answers the latest claim only."""
    for number in (1, 2, 3):
        early = sender.on_prepare(
            Prepare(request_id="late", rewrites=[], hold_s=60.0, claim=number), "decode-a"
        )
        assert early is None
    sender.add(SendSpec(request_id="late", block_ids=((3,),), first_block=(0,), lease_s=30.0))
    assert [(agent, p.claim) for agent, p in sender.take_replies()] == [("decode-a", 3)]


def test_claims_extend_a_hold_no_further_than_its_cap_in_total(clock, sender):
    """A decode that claims again and again (or a peer that loops) extends the hold up to
    its lease plus the longest claim from when it was kept, never beyond: before, each
    Prepare moved the end another 600 s on, for ever."""
    kept_at, granted = clock.now, 0
    while _claim(sender, "a", granted + 1, hold_s=600.0):
        granted += 1
        clock.now += 60.0
        assert clock.now < kept_at + 3600, "claims kept extending the hold for an hour"
    assert clock.now <= kept_at + LEASE_S + MAX_HOLD_S + 60.0
    assert granted >= 10  # the cap is the total, not the first claim
    assert _finished(sender) == {"r"}


def test_a_peer_naming_reader_after_reader_is_refused_past_the_cap(sender):
    for rank in range(MAX_READERS):
        assert _claim(sender, "a", 1, rank=rank)
    answer = sender.on_prepare(
        Prepare(request_id="r", rewrites=[], hold_s=1.0, claim=1, reader_rank=MAX_READERS), "a"
    )
    assert answer is not None and not answer.ok and "readers claim" in answer.reason
    assert _claim(sender, "a", 2, rank=0)  # a reader it knows still claims again


def test_heartbeats_keep_a_queued_request_for_as_long_as_decode_sends_them(clock, sender):
    """A request waiting in decode's queue is kept by its heartbeats (the lease, from
    now), however long the backlog: the total cap applies to claims only."""
    for _ in range(300):  # 25 minutes of heartbeats, one every 5 s
        clock.now += 5.0
        sender.on_heartbeat(Heartbeat(request_ids=["r"]))
        sender.expire()
    assert not _finished(sender)
    clock.now += LEASE_S + 1  # they stop: the lease runs out
    sender.expire()
    assert _finished(sender) == {"r"}


def test_an_early_claim_that_raises_when_replayed_refuses_that_claim_alone(clock):
    """Claims that came before their request are replayed when it is added, each inside
    its own failure boundary: one that raises is refused, the others are answered and
    the request is kept (before, the exception failed the whole add: every reader
    recomputed)."""
    buffers = KVCacheBuffers(KVCacheConfig.uniform(make_groups(16, "F"), 16), FMT, "cpu")
    s = Sender(buffers, ConnectorMetrics(), clock=clock)
    for agent in ("a", "b"):
        assert (
            s.on_prepare(Prepare(request_id="r", rewrites=[], hold_s=60.0, claim=1), agent) is None
        )
    real = s.on_prepare

    def on_prepare(msg, agent=""):
        if agent == "a":
            raise MemoryError("gather arena")
        return real(msg, agent)

    s.on_prepare = on_prepare  # type: ignore[method-assign]
    s.add(SendSpec(request_id="r", block_ids=((1, 2),), first_block=(0,), lease_s=LEASE_S))
    answers = {agent: reply for agent, reply in s.take_replies()}
    assert not answers["a"].ok and "could not handle the claim" in answers["a"].reason
    assert answers["b"].ok and s.kept("r") is not None
