"""KVBridgeScheduler, both roles, with a fake clock and the example BlockPool (no NIXL).

Each test plays the engine: it allocates from a real pool, follows the scheduler's
events, and ends by proving the pool is full again (every block freed exactly once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.common.api import SchedulerEvents
from kvbridge.connector.common.config import ConfigError, FailurePolicy, KVRole, KVTransferConfig
from kvbridge.connector.common.metadata import ConnectorMetadata, LoadFailure, WorkerOutput
from kvbridge.connector.common.params import KVTransferParams, ParamsError
from kvbridge.connector.scheduler.lifecycle import Ignored, LifecycleError, LoadState, SendState
from kvbridge.connector.scheduler.retention import resume_point, retained_block_range
from kvbridge.connector.scheduler.scheduler import KVBridgeScheduler
from kvbridge.examples.block_pool import BlockPool
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.specs import FullAttentionSpec, KVCacheKind, SlidingWindowSpec, StateSpec

FULL, SW, STATE = KVCacheKind.FULL_ATTENTION, KVCacheKind.SLIDING_WINDOW, KVCacheKind.STATE
NUM_BLOCKS = 256
LEASE_S, HEARTBEAT_S = 30.0, 5.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class Req:
    request_id: str
    prompt_token_ids: Sequence[int]
    kv_transfer_params: KVTransferParams | None = None


def kv_config(kinds: Sequence[KVCacheKind], block_size: int, window: int = 24) -> KVCacheConfig:
    attn = dict(block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float32)
    specs = {
        FULL: FullAttentionSpec(**attn),
        SW: SlidingWindowSpec(**attn, sliding_window=window),
        STATE: StateSpec(block_size=block_size, shapes=((4,),), dtypes=(torch.float32,)),
    }
    groups = [
        KVCacheGroup(group_id=g, layer_names=(f"layer{g}",), spec=specs[kind])
        for g, kind in enumerate(kinds)
    ]
    return KVCacheConfig.uniform(groups, num_blocks=NUM_BLOCKS)


def transfer_config(role: KVRole, **overrides) -> KVTransferConfig:
    values = dict(
        kv_role=role,
        engine_id="prefill-0" if role is KVRole.PRODUCER else "decode-0",
        kv_ip="10.1.2.3",
        kv_port=5700,
        lease_s=LEASE_S,
        heartbeat_s=HEARTBEAT_S,
    )
    values.update(overrides)
    return KVTransferConfig(**values)


class Engine:
    """Just enough of an engine: a pool, a scheduler, and the free discipline."""

    def __init__(
        self,
        role: KVRole,
        kinds: Sequence[KVCacheKind] = (FULL,),
        block_size: int = 16,
        clock: FakeClock | None = None,
        tp_size: int = 1,
        **config_overrides,
    ) -> None:
        self.clock = clock or FakeClock()
        self.kv = kv_config(kinds, block_size)
        self.sched = KVBridgeScheduler(
            transfer_config(role, **config_overrides),
            self.kv,
            clock=self.clock,
            wall_clock=self.clock,
            tp_size=tp_size,
        )
        self.pool = BlockPool(NUM_BLOCKS)
        self.blocks: dict[str, list[list[int]]] = {}  # blocks the engine frees itself
        self.held: dict[str, list[list[int]]] = {}  # prefill: handed to the connector

    def allocate(self, rid: str, num_tokens: int, extra_blocks: int = 0) -> list[list[int]]:
        blocks = [
            self.pool.allocate(-(-num_tokens // g.spec.block_size) + extra_blocks)
            for g in self.kv.groups
        ]
        self.blocks[rid] = blocks
        return blocks

    def free_own(self, rid: str) -> None:
        self.pool.free([b for ids in self.blocks.pop(rid) for b in ids])

    # prefill
    def finish(self, req: Req, extra_blocks: int = 0) -> KVTransferParams | None:
        blocks = self.allocate(req.request_id, len(req.prompt_token_ids), extra_blocks)
        delay, params = self.sched.request_finished(req, blocks)
        if delay:
            self.held[req.request_id] = self.blocks.pop(req.request_id)
            self.pool.free(self.sched.take_blocks_to_free(req.request_id))
        else:
            self.free_own(req.request_id)
        return params

    def step(self, output: WorkerOutput | None = None) -> tuple[ConnectorMetadata, SchedulerEvents]:
        meta = self.sched.build_connector_meta()
        events = self.sched.update_connector_output(output or WorkerOutput())
        for rid in events.free_request_ids:
            if rid in self.blocks and not self.sched.defers_free(rid):
                self.free_own(rid)  # decode: the engine's own blocks
            else:
                self.pool.free(self.sched.take_blocks_to_free(rid))
        return meta, events

    def assert_clean(self) -> None:
        assert self.sched.num_live_requests == 0
        self.pool.assert_all_free()
        assert self.pool.num_free == NUM_BLOCKS


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 251 for i in range(n)]


def remote_decode(rid: str, n: int) -> Req:
    return Req(rid, prompt(n), KVTransferParams(do_remote_decode=True))


# ================================================================ prefill (producer)


def test_prefill_happy_path_params_send_spec_and_free() -> None:
    eng = Engine(KVRole.PRODUCER)
    params = eng.finish(remote_decode("r1", 40))
    [ids] = eng.held["r1"]
    assert params == KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="prefill-0",
        remote_host="10.1.2.3",
        remote_port=5700,
        remote_rank=0,
        remote_block_ids=[ids],
        remote_first_block=[0],
        remote_block_size=16,
        num_tokens=40,
        remote_request_id="r1",
        resume_tokens=39,  # decode computes the last prompt token itself
        expires_at=eng.clock.now + LEASE_S,  # dated even without a secret (never signed)
    )
    assert eng.pool.num_used == 3  # all three blocks are kept (token 38 is in the third)
    assert eng.sched.send_state("r1") is SendState.PENDING
    meta, events = eng.step()
    [spec] = meta.reqs_to_send
    assert (spec.request_id, spec.block_ids, spec.first_block) == ("r1", (tuple(ids),), (0,))
    assert spec.lease_s == LEASE_S
    assert events.free_request_ids == frozenset()
    assert eng.sched.defers_free("r1")
    meta, _ = eng.step()
    assert meta.reqs_to_send == ()  # sent once
    _, events = eng.step(WorkerOutput(finished_sending=frozenset({"r1"})))
    assert events.free_request_ids == {"r1"}
    assert eng.sched.send_outcomes == {SendState.DONE: 1}
    assert eng.sched.take_blocks_to_free("r1") == ()  # handed out once only
    eng.assert_clean()


def test_prefill_local_request_is_freed_by_the_engine() -> None:
    eng = Engine(KVRole.PRODUCER)
    assert eng.finish(Req("r", prompt(20))) is None
    assert eng.finish(Req("s", prompt(20), KVTransferParams())) is None
    meta, _ = eng.step()
    assert meta.reqs_to_send == ()
    eng.assert_clean()


def test_prefill_blocks_past_the_prompt_are_freed_at_once() -> None:
    eng = Engine(KVRole.PRODUCER)
    params = eng.finish(remote_decode("r", 33), extra_blocks=1)
    [ids] = eng.held["r"]
    assert len(ids) == 4
    # decode resumes at token 32: blocks 0, 1 hold tokens 0..31; block 2 holds only the
    # last token, which decode computes, so it is freed with the one past the prompt
    assert params.remote_block_ids == [ids[:2]]
    assert params.resume_tokens == 32
    assert eng.pool.num_used == 2
    eng.step(WorkerOutput(finished_sending=frozenset({"r"})))
    eng.assert_clean()


def test_a_load_into_a_placeholder_block_is_refused() -> None:
    """vLLM gives a decode's window group null blocks (-1 here) before the window of the
    loaded tokens: the load of [0, 99) writes window blocks from token 99 - 23 = 76 on
    (block 4), never a placeholder."""
    eng = Engine(KVRole.CONSUMER, kinds=(FULL, SW))  # 16-token blocks, window 24
    req = Req("d", prompt(100), remote_params(100, num_groups=2))
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (99, True)
    full = list(range(10, 17))
    with pytest.raises(LifecycleError, match=r"group 1: the load of tokens \[0, 99\) writes"):
        eng.sched.update_state_after_alloc(req, [full, [-1] * 5 + [25, 26]], 99)
    eng.sched.update_state_after_alloc(req, [full, [-1] * 4 + [24, 25, 26]], 99)
    meta, _ = eng.step()
    [load] = meta.reqs_to_load
    assert load.local_block_ids == (tuple(full), (-1, -1, -1, -1, 24, 25, 26))


HYBRID = (FULL, SW, STATE)


def test_hybrid_keeps_the_window_and_the_state_where_decode_resumes() -> None:
    eng = Engine(KVRole.PRODUCER, HYBRID)
    req = remote_decode("r", 101)  # 7 blocks of 16 per group; decode resumes at 100
    blocks = eng.allocate("r", 101)
    del eng.blocks["r"]  # handed to the connector
    [resume] = eng.pool.allocate(1)  # the engine's snapshot: state after 100 tokens
    delay, params = eng.sched.request_finished(req, blocks, resume_state_block_ids={2: resume})
    assert delay
    full, window, _ = blocks
    # window 24 for token 100: tokens [77, 100) -> blocks 4..6
    assert params.resume_tokens == 100
    assert params.remote_first_block == [0, 4, 6]
    assert params.remote_block_ids == [full, window[4:7], [resume]]
    eng.pool.free(eng.sched.take_blocks_to_free("r"))
    assert eng.pool.num_used == 7 + 3 + 1  # every state-group block of the prompt is freed
    meta, _ = eng.step()
    assert meta.reqs_to_send[0].block_ids == (tuple(full), tuple(window[4:]), (resume,))
    eng.step(WorkerOutput(finished_sending=frozenset({"r"})))
    eng.assert_clean()


def test_hybrid_without_a_resume_block_falls_back_to_the_last_state_boundary() -> None:
    eng = Engine(KVRole.PRODUCER, HYBRID)
    params = eng.finish(remote_decode("r", 100))  # decode would resume at 99
    full, window, state = eng.held["r"]
    # the state after 96 tokens (block 5) is the last one kept: decode resumes there
    assert params.resume_tokens == 96
    assert params.remote_first_block == [0, 4, 5]
    assert params.remote_block_ids == [full[:6], window[4:6], [state[5]]]
    assert eng.pool.num_used == 6 + 2 + 1
    eng.step()
    out = WorkerOutput(finished_sending=frozenset({"r"}), expired_leases=frozenset({"r"}))
    _, events = eng.step(out)
    assert events.free_request_ids == {"r"}
    eng.assert_clean()


def test_resume_blocks_of_a_request_decode_cannot_use_are_freed_at_once() -> None:
    eng = Engine(KVRole.PRODUCER, (FULL, STATE))
    [resume] = eng.pool.allocate(1)
    blocks = eng.allocate("r", 1)  # a one-token prompt: decode computes everything
    del eng.blocks["r"]
    delay, params = eng.sched.request_finished(
        remote_decode("r", 1), blocks, resume_state_block_ids={1: resume}
    )
    assert delay and params.resume_tokens == 0 and params.remote_block_ids == [[], []]
    eng.pool.free(eng.sched.take_blocks_to_free("r"))
    with pytest.raises(LifecycleError, match=r"names groups \[0\]"):
        eng.sched.request_finished(remote_decode("x", 9), [[1], [2]], resume_state_block_ids={0: 3})
    eng.step(WorkerOutput(finished_sending=frozenset({"r"})))
    eng.assert_clean()


def test_state_placeholders_are_trimmed_and_never_freed() -> None:
    eng = Engine(KVRole.PRODUCER, (FULL, STATE))
    full = eng.pool.allocate(4)
    state_real = eng.pool.allocate(1)
    state = [-1, -1, state_real[0], -1]  # the engine kept only the state after 48 tokens
    req = remote_decode("r", 60)
    delay, params = eng.sched.request_finished(req, [full, state])
    assert delay
    # no resume block: decode resumes at the boundary 48 (state block 2)
    assert params.remote_block_ids == [full[:3], [state_real[0]]]
    assert params.remote_first_block == [0, 2]
    assert eng.sched.take_blocks_to_free("r") == (full[3],)
    eng.sched.request_aborted("r")
    assert sorted(eng.sched.take_blocks_to_free("r")) == sorted(full[:3] + state_real)
    eng.pool.free(full + state_real)
    eng.assert_clean()


def test_the_scheduler_keeps_no_lease_clock() -> None:
    """One clock decides when a hold ends: the worker's (it may have granted a decode a
    claim past the lease). The scheduler frees only on the worker's report."""
    eng = Engine(KVRole.PRODUCER)
    eng.finish(remote_decode("r", 20))
    eng.step()
    eng.clock.advance(10 * LEASE_S)
    meta, events = eng.step()
    assert meta.reqs_freed == () and meta.sends_to_end == ()
    assert events.free_request_ids == frozenset()
    assert eng.sched.defers_free("r")
    out = WorkerOutput(finished_sending=frozenset({"r"}), expired_leases=frozenset({"r"}))
    _, events = eng.step(out)
    assert events.free_request_ids == {"r"}
    assert eng.sched.send_outcomes == {SendState.EXPIRED: 1}
    # a repeated report must not free again
    _, events = eng.step(WorkerOutput(finished_sending=frozenset({"r"})))
    assert events.free_request_ids == frozenset()
    assert eng.sched.ignored[Ignored.FINISHED_SENDING] == 1
    eng.assert_clean()


def test_lease_expired_on_the_worker_side() -> None:
    eng = Engine(KVRole.PRODUCER)
    eng.finish(remote_decode("r", 20))
    eng.step()
    out = WorkerOutput(finished_sending=frozenset({"r"}), expired_leases=frozenset({"r"}))
    _, events = eng.step(out)
    assert events.free_request_ids == {"r"}
    assert eng.sched.send_outcomes == {SendState.EXPIRED: 1}
    meta, _ = eng.step()
    assert meta.reqs_freed == ()  # the worker dropped it already
    eng.assert_clean()


def test_finished_sending_under_tp_waits_for_every_rank() -> None:
    eng = Engine(KVRole.PRODUCER, tp_size=2)
    eng.finish(remote_decode("r", 20))
    eng.step()
    _, events = eng.step(WorkerOutput(finished_sending=frozenset({"r"})))
    assert events.free_request_ids == frozenset()  # rank 1 may still serve a READ
    assert eng.sched.defers_free("r")
    _, events = eng.step(WorkerOutput(finished_sending=frozenset({"r"})))
    assert events.free_request_ids == {"r"}
    eng.assert_clean()


def test_prefill_abort_while_held_waits_for_the_worker() -> None:
    """A held request the engine aborts: the worker ends the hold (after any claim it
    granted a decode) and reports it; the blocks are freed only then, exactly once."""
    eng = Engine(KVRole.PRODUCER)
    eng.finish(remote_decode("r", 50))
    eng.step()
    eng.sched.request_aborted("r")
    eng.sched.request_aborted("r")  # twice: queued once
    assert eng.sched.defers_free("r")
    assert eng.sched.take_blocks_to_free("r") == ()
    meta, events = eng.step()
    assert meta.sends_to_end == ("r",) and meta.reqs_freed == ()
    assert events.free_request_ids == frozenset()
    _, events = eng.step(WorkerOutput(finished_sending=frozenset({"r"})))
    assert events.free_request_ids == {"r"}
    assert eng.sched.send_outcomes == {SendState.ABORTED: 1}
    _, events = eng.step(WorkerOutput(finished_sending=frozenset({"r"})))
    assert events.free_request_ids == frozenset()  # no double free
    assert eng.sched.ignored[Ignored.FINISHED_SENDING] == 1
    eng.assert_clean()


def test_prefill_abort_before_the_send_spec_left() -> None:
    eng = Engine(KVRole.PRODUCER)
    eng.finish(remote_decode("r", 50))
    eng.sched.request_aborted("r")
    meta, events = eng.step()
    # never sent; still named, so the worker refuses a reader who asks for it at once
    assert meta.reqs_to_send == () and meta.reqs_freed == ("r",)
    assert events.free_request_ids == {"r"}
    eng.assert_clean()


def test_duplicate_and_unknown_finished_sending_are_counted() -> None:
    eng = Engine(KVRole.PRODUCER)
    for rid in ("a", "b"):
        eng.finish(remote_decode(rid, 30))
    eng.step()
    _, events = eng.step(WorkerOutput(finished_sending=frozenset({"a", "ghost"})))
    assert events.free_request_ids == {"a"}
    _, events = eng.step(WorkerOutput(finished_sending=frozenset({"a", "b"})))
    assert events.free_request_ids == {"b"}
    assert eng.sched.ignored == {Ignored.FINISHED_SENDING: 2}
    eng.sched.request_aborted("a")
    assert eng.sched.ignored[Ignored.ABORT] == 1
    eng.assert_clean()


def test_prefill_engine_misuse_raises() -> None:
    eng = Engine(KVRole.PRODUCER)
    eng.finish(remote_decode("r", 20))
    with pytest.raises(LifecycleError, match="request_finished called twice"):
        eng.sched.request_finished(remote_decode("r", 20), [[]])
    with pytest.raises(LifecycleError, match=r"1 blocks for a 20-token prompt"):
        eng.sched.request_finished(remote_decode("s", 20), [[0]])
    with pytest.raises(LifecycleError, match="2 block lists for 1 KV-cache groups"):
        eng.sched.request_finished(remote_decode("s", 20), [[0, 1], [2, 3]])
    eng.sched.request_aborted("r")
    eng.pool.free(eng.sched.take_blocks_to_free("r"))
    eng.assert_clean()


def test_producer_config_errors() -> None:
    kv = KVCacheConfig(
        groups=(
            KVCacheGroup(
                group_id=0,
                layer_names=("a",),
                spec=FullAttentionSpec(
                    block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32
                ),
            ),
            KVCacheGroup(
                group_id=1,
                layer_names=("b",),
                spec=FullAttentionSpec(
                    block_size=32, num_kv_heads=1, head_size=8, dtype=torch.float32
                ),
            ),
        ),
        num_blocks=8,
    )
    with pytest.raises(ConfigError, match=r"share one block size.*\[16, 32\]"):
        KVBridgeScheduler(transfer_config(KVRole.PRODUCER), kv)
    KVBridgeScheduler(transfer_config(KVRole.CONSUMER), kv)  # fine for a consumer


@settings(max_examples=300, deadline=None)
@given(
    num_tokens=st.integers(1, 700),
    prefill_bs=st.sampled_from([4, 8, 16, 32, 48, 64, 80]),
    window=st.integers(1, 100),
    resume_state=st.booleans(),
)
def test_retained_blocks_are_exactly_what_the_resume_point_needs(
    num_tokens: int, prefill_bs: int, window: int, resume_state: bool
) -> None:
    end = resume_point(num_tokens, prefill_bs, resume_state=resume_state)
    assert end == (num_tokens - 1 if resume_state else (num_tokens - 1) // prefill_bs * prefill_bs)
    attn = dict(block_size=prefill_bs, num_kv_heads=1, head_size=4, dtype=torch.float32)
    window_spec = SlidingWindowSpec(**attn, sliding_window=window)
    first, stop = retained_block_range(window_spec, end)
    blocks = set(range(first, stop))
    # the tokens the resume point attends to besides itself: vLLM's window of w holds the
    # token and the w - 1 before it (SlidingWindowManager.get_num_skipped_tokens)
    tokens = range(max(0, end - window + 1), end)
    assert blocks == {t // prefill_bs for t in tokens}
    full_spec = FullAttentionSpec(**attn)
    assert retained_block_range(full_spec, end) == (0, -(-end // prefill_bs))
    state_spec = StateSpec(block_size=prefill_bs, shapes=((1,),), dtypes=(torch.float32,))
    first, stop = retained_block_range(state_spec, end)
    if end and end % prefill_bs == 0:
        assert (first, stop) == (end // prefill_bs - 1, end // prefill_bs)
    else:
        assert first == stop  # mid-block: only an engine's resume block has that state


# ================================================================ decode (consumer)


def remote_params(num_tokens: int, num_groups: int = 1, block_size: int = 16) -> KVTransferParams:
    num_blocks = -(-num_tokens // block_size)
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="prefill-0",
        remote_host="10.1.2.3",
        remote_port=5700,
        remote_block_ids=[list(range(100, 100 + num_blocks))] * num_groups,
        remote_first_block=[0] * num_groups,
        remote_block_size=block_size,
        num_tokens=num_tokens,
        remote_request_id="p-1",
        resume_tokens=num_tokens - 1,
    )


def decode_req(rid: str, n: int, **kw) -> Req:
    return Req(rid, prompt(n), remote_params(n, **kw))


def admit(eng: Engine, req: Req, num_computed: int = 0) -> int:
    """get_num_new_matched_tokens, allocate for the whole prompt, update_state_after_alloc."""
    num_external, is_async = eng.sched.get_num_new_matched_tokens(req, num_computed)
    assert is_async == (num_external > 0)
    blocks = eng.allocate(req.request_id, len(req.prompt_token_ids))
    eng.sched.update_state_after_alloc(req, blocks, num_external)
    return num_external


def test_decode_happy_path() -> None:
    eng = Engine(KVRole.CONSUMER)
    req = decode_req("d", 100)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (99, True)  # all but the last
    blocks = eng.allocate("d", 100)
    eng.sched.update_state_after_alloc(req, blocks, 99)
    assert eng.sched.load_state("d") is LoadState.ALLOCATED
    meta, events = eng.step()
    [spec] = meta.reqs_to_load
    assert spec.request_id == "d" and spec.params is req.kv_transfer_params
    assert spec.local_block_ids == (tuple(blocks[0][:7]),)  # 99 tokens = blocks 0..6
    assert (spec.start_token, spec.end_token) == (0, 99)
    assert eng.sched.defers_free("d")
    _, events = eng.step(WorkerOutput(finished_recving=frozenset({"d"})))
    assert events.loaded_request_ids == {"d"}
    assert eng.sched.load_outcomes == {LoadState.LOADED: 1}
    assert not eng.sched.defers_free("d")
    # Preempted and rescheduled later: the remote KV is used up, nothing is read again.
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert eng.sched.request_finished(req, eng.blocks["d"]) == (False, None)
    eng.free_own("d")
    eng.assert_clean()


def test_load_ends_at_the_resume_point_whatever_the_block_sizes() -> None:
    eng = Engine(KVRole.CONSUMER, block_size=32)
    req = Req("d", prompt(200), remote_params(200, block_size=48))  # not multiples
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (199, True)
    short = Req("e", prompt(2), remote_params(2, block_size=48))
    assert eng.sched.get_num_new_matched_tokens(short, 0) == (1, True)
    # Prefill held fewer tokens than the decode's prompt: bounded by its resume point.
    fewer = Req("f", prompt(300), remote_params(150, block_size=48))
    assert eng.sched.get_num_new_matched_tokens(fewer, 0) == (149, True)
    for rid in ("d", "e", "f"):
        eng.sched.request_aborted(rid)
    meta, _ = eng.step()
    assert [rid for rid, _ in meta.reqs_to_abort] == ["d", "e", "f"]
    eng.assert_clean()


def test_partial_prefix_hit_loads_the_rest() -> None:
    eng = Engine(KVRole.CONSUMER)
    req = decode_req("d", 100)
    assert admit(eng, req, num_computed=32) == 67
    meta, _ = eng.step()
    [spec] = meta.reqs_to_load
    assert (spec.start_token, spec.end_token) == (32, 99)
    _, events = eng.step(WorkerOutput(finished_recving=frozenset({"d"})))
    assert events.loaded_request_ids == {"d"}
    eng.free_own("d")
    eng.assert_clean()


@pytest.mark.parametrize("num_computed", [99, 112])
def test_full_prefix_hit_only_releases_prefill(num_computed: int) -> None:
    eng = Engine(KVRole.CONSUMER)
    req = decode_req("d", 100)
    assert admit(eng, req, num_computed=num_computed) == 0
    assert eng.sched.load_state("d") is LoadState.RELEASING
    meta, _ = eng.step()
    assert meta.reqs_to_load == ()
    assert meta.reqs_to_release == (("d", req.kv_transfer_params),)
    assert eng.sched.load_outcomes == {LoadState.RELEASED: 1}
    eng.sched.request_aborted("d")  # nothing left to abort on the remote side
    meta, _ = eng.step()
    assert meta.reqs_to_abort == () and meta.reqs_to_release == ()
    eng.free_own("d")
    eng.assert_clean()


def test_abort_before_allocation() -> None:
    eng = Engine(KVRole.CONSUMER)
    req = decode_req("d", 64)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (63, True)
    eng.sched.request_aborted("d")
    assert not eng.sched.defers_free("d")
    meta, events = eng.step()
    assert meta.reqs_to_abort == (("d", req.kv_transfer_params),)
    assert meta.reqs_to_load == () and events == SchedulerEvents()
    assert eng.sched.load_outcomes == {LoadState.ABORTED: 1}
    eng.assert_clean()


def test_abort_after_allocation_before_the_load_left() -> None:
    eng = Engine(KVRole.CONSUMER)
    admit(eng, decode_req("d", 64))
    eng.sched.request_aborted("d")
    assert not eng.sched.defers_free("d")  # no load was posted: free now
    eng.free_own("d")
    meta, events = eng.step()
    assert meta.reqs_to_load == ()
    assert [rid for rid, _ in meta.reqs_to_abort] == ["d"]
    assert events.free_request_ids == frozenset()
    eng.assert_clean()


@pytest.mark.parametrize("ending", ["finished", "failed"])
def test_abort_while_loading_waits_for_the_worker(ending: str) -> None:
    eng = Engine(KVRole.CONSUMER)
    req = decode_req("d", 64)
    admit(eng, req)
    eng.step()
    eng.sched.request_aborted("d")
    eng.sched.request_aborted("d")  # a repeat changes nothing
    assert eng.sched.ignored[Ignored.ABORT] == 1
    assert eng.sched.defers_free("d")
    meta, events = eng.step()
    assert meta.reqs_to_abort == (("d", req.kv_transfer_params),)
    assert events.free_request_ids == frozenset()
    assert eng.pool.num_used == 4  # NIXL may still write: the blocks stay
    if ending == "finished":
        out = WorkerOutput(finished_recving=frozenset({"d"}))
    else:
        out = WorkerOutput(
            failed_loads=(
                LoadFailure(
                    request_id="d", reason="cancelled", invalid_block_ids=((),), num_valid_tokens=0
                ),
            )
        )
    _, events = eng.step(out)
    assert events.free_request_ids == {"d"}
    assert events.loaded_request_ids == frozenset() and events.recompute == ()
    assert eng.sched.load_outcomes == {LoadState.ABORTED: 1}
    eng.assert_clean()


@pytest.mark.parametrize("policy", [FailurePolicy.FAIL, FailurePolicy.RECOMPUTE])
def test_a_load_that_failed_before_the_engine_aborted_it_ends_failed(
    policy: FailurePolicy,
) -> None:
    """vLLM under ``kv_load_failure_policy: fail`` ends a request on the worker's failed
    report (``failed_recving``) before the connector reads that same report: the abort
    comes first, and the failure with no abort of ours gone out to the worker. The load
    failed on its own; an abort that went out first ends it ABORTED (test above)."""
    eng = Engine(KVRole.CONSUMER, failure_policy=policy)
    admit(eng, decode_req("d", 64))
    eng.step()
    eng.sched.request_aborted("d")  # the engine's reaction to the report, no step between
    assert eng.sched.defers_free("d")
    failure = LoadFailure(
        request_id="d", reason="peer unreachable", invalid_block_ids=((),), num_valid_tokens=0
    )
    events = eng.sched.update_connector_output(WorkerOutput(failed_loads=(failure,)))
    assert events.failed == (failure,) and events.recompute == ()
    assert events.free_request_ids == {"d"}
    assert eng.sched.load_outcomes == {LoadState.FAILED: 1}
    eng.free_own("d")
    meta, _ = eng.step()
    assert [rid for rid, _ in meta.reqs_to_abort] == ["d"]  # prefill is still told
    eng.assert_clean()


def test_request_finished_while_loading_delays_the_free() -> None:
    eng = Engine(KVRole.CONSUMER)
    admit(eng, decode_req("d", 64))
    eng.step()
    assert eng.sched.request_finished(decode_req("d", 64), eng.blocks["d"]) == (True, None)
    meta, _ = eng.step()
    assert [rid for rid, _ in meta.reqs_to_abort] == ["d"]
    _, events = eng.step(WorkerOutput(finished_recving=frozenset({"d"})))
    assert events.free_request_ids == {"d"}
    eng.assert_clean()


@pytest.mark.parametrize(
    ("policy", "field"), [(FailurePolicy.RECOMPUTE, "recompute"), (FailurePolicy.FAIL, "failed")]
)
def test_load_failure_follows_the_policy(policy: FailurePolicy, field: str) -> None:
    eng = Engine(KVRole.CONSUMER, failure_policy=policy)
    admit(eng, decode_req("d", 100))
    eng.step()
    failure = LoadFailure(
        request_id="d", reason="peer gone", invalid_block_ids=((3, 4, 5),), num_valid_tokens=48
    )
    _, events = eng.step(WorkerOutput(failed_loads=(failure,)))
    assert getattr(events, field) == (failure,)
    other = "failed" if field == "recompute" else "recompute"
    assert getattr(events, other) == ()
    assert events.loaded_request_ids == frozenset() and events.free_request_ids == frozenset()
    expected = LoadState.RECOMPUTED if policy is FailurePolicy.RECOMPUTE else LoadState.FAILED
    assert eng.sched.load_outcomes == {expected: 1}
    # The engine resumes (or ends) the request; it never loads the remote KV again.
    assert eng.sched.get_num_new_matched_tokens(decode_req("d", 100), 48) == (0, False)
    eng.free_own("d")
    eng.assert_clean()


def test_duplicate_and_unknown_load_reports_are_counted() -> None:
    eng = Engine(KVRole.CONSUMER)
    admit(eng, decode_req("d", 64))
    admit(eng, decode_req("e", 64))  # still ALLOCATED when the bogus report comes
    eng.sched.build_connector_meta()
    admit(eng, decode_req("f", 64))
    failure = LoadFailure(request_id="f", reason="x", invalid_block_ids=((),), num_valid_tokens=0)
    out = WorkerOutput(finished_recving=frozenset({"d", "ghost"}), failed_loads=(failure,))
    events = eng.sched.update_connector_output(out)
    assert events.loaded_request_ids == {"d"} and events.recompute == ()
    events = eng.sched.update_connector_output(WorkerOutput(finished_recving=frozenset({"d"})))
    assert events == SchedulerEvents()
    assert eng.sched.ignored == {Ignored.FINISHED_RECVING: 2, Ignored.FAILED_LOAD: 1}
    assert eng.sched.load_state("f") is LoadState.ALLOCATED  # untouched by the bogus failure
    _, events = eng.step(WorkerOutput(finished_recving=frozenset({"e"})))
    _, events = eng.step(WorkerOutput(finished_recving=frozenset({"f"})))
    assert events.loaded_request_ids == {"f"}
    for rid in ("d", "e", "f"):
        eng.free_own(rid)
    eng.assert_clean()


def test_waiting_requests_heartbeat_at_most_once_per_period() -> None:
    eng = Engine(KVRole.CONSUMER)
    req = decode_req("d", 64)
    full_hit = decode_req("h", 64)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (63, True)
    assert eng.sched.get_num_new_matched_tokens(full_hit, 64) == (0, False)
    seen = []
    for _ in range(12):  # steps 1 s apart; heartbeat_s = 5
        eng.sched.request_waiting(req)
        eng.sched.request_waiting(full_hit)
        eng.sched.request_waiting(Req("local", prompt(8)))  # not ours: no-op
        meta, _ = eng.step()
        seen.append(sorted(rid for rid, _ in meta.reqs_waiting))
        eng.clock.advance(1.0)
    beats = [["d", "h"], [], [], [], []]
    assert seen == beats + beats + [["d", "h"], []]
    assert meta.reqs_to_load == ()
    admit(eng, req)  # allocated now: no more heartbeats
    eng.sched.request_waiting(req)
    eng.clock.advance(10.0)
    meta, _ = eng.step()
    assert meta.reqs_waiting == () and len(meta.reqs_to_load) == 1
    eng.sched.update_state_after_alloc(full_hit, eng.allocate("h", 64), 0)
    meta, _ = eng.step(WorkerOutput(finished_recving=frozenset({"d"})))
    assert [rid for rid, _ in meta.reqs_to_release] == ["h"]
    eng.free_own("d")
    eng.free_own("h")
    eng.assert_clean()


def test_hybrid_decode_load_spec_per_group() -> None:
    eng = Engine(KVRole.CONSUMER, HYBRID, block_size=8)
    req = Req("d", prompt(100), remote_params(100, num_groups=3, block_size=16))
    assert admit(eng, req, num_computed=16) == 83  # resume at 99
    meta, _ = eng.step()
    [spec] = meta.reqs_to_load
    # 99 tokens in 8-token blocks: 13 blocks, the last one partial (its state entry too)
    assert spec.local_block_ids == tuple(tuple(ids[:13]) for ids in eng.blocks["d"])
    eng.step(WorkerOutput(finished_recving=frozenset({"d"})))
    eng.free_own("d")
    eng.assert_clean()


def test_bad_params_raise_params_error() -> None:
    eng = Engine(KVRole.CONSUMER, HYBRID)
    with pytest.raises(ParamsError, match="remote_block_ids has 1 lists"):
        eng.sched.get_num_new_matched_tokens(decode_req("d", 64), 0)
    with pytest.raises(ParamsError, match="kv_producer"):
        eng.sched.get_num_new_matched_tokens(remote_decode("p", 64), 0)
    producer = Engine(KVRole.PRODUCER)
    with pytest.raises(ParamsError, match="kv_consumer"):
        producer.sched.get_num_new_matched_tokens(decode_req("d", 64), 0)
    assert producer.sched.get_num_new_matched_tokens(remote_decode("p", 64), 0) == (0, False)
    assert eng.sched.num_live_requests == 0


def test_decode_engine_misuse_raises() -> None:
    eng = Engine(KVRole.CONSUMER)
    req = decode_req("d", 64)
    with pytest.raises(LifecycleError, match="promised no tokens"):
        eng.sched.update_state_after_alloc(req, [[0, 1, 2]], 48)
    eng.sched.update_state_after_alloc(Req("local", prompt(8)), [[0]], 0)  # no-op
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (63, True)
    with pytest.raises(LifecycleError, match=r"num_external_tokens=32.*offered 63"):
        eng.sched.update_state_after_alloc(req, [[0, 1, 2, 3]], 32)
    with pytest.raises(LifecycleError, match="group 0: 2 blocks allocated"):
        eng.sched.update_state_after_alloc(req, [[0, 1]], 63)
    admit(eng, req)
    with pytest.raises(LifecycleError, match="ALLOCATED"):
        eng.sched.update_state_after_alloc(req, eng.blocks["d"], 63)
    with pytest.raises(LifecycleError, match="ALLOCATED"):
        eng.sched.get_num_new_matched_tokens(req, 0)
    eng.sched.request_aborted("d")
    eng.free_own("d")
    eng.step()
    eng.assert_clean()


# ================================================================ both sides together


class Wire:
    """Fake workers: decode's Done and heartbeats reach a prefill worker that holds each
    request under its lease (the one clock) and reports it finished_sending once;
    loads complete (or fail) when the test says so."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.done: set[str] = set()  # prefill ids decode is finished with
        self.beats: set[str] = set()
        self.loading: dict[str, str] = {}  # decode rid -> prefill rid
        self.holds: dict[str, float] = {}  # prefill worker: rid -> lease end
        self.ended: set[str] = set()
        self.to_end: set[str] = set()

    def prefill_meta(self, meta: ConnectorMetadata) -> None:
        for spec in meta.reqs_to_send:
            self.holds[spec.request_id] = self.clock.now + spec.lease_s
        self.to_end |= set(meta.sends_to_end)

    def decode_meta(self, meta: ConnectorMetadata) -> None:
        for spec in meta.reqs_to_load:
            self.loading[spec.request_id] = spec.params.remote_request_id
        for rid, params in meta.reqs_to_release + meta.reqs_to_abort:
            if rid not in self.loading:
                self.done.add(params.remote_request_id)
        self.beats |= {params.remote_request_id for _, params in meta.reqs_waiting}

    def decode_output(self, finish: set[str], fail: set[str]) -> WorkerOutput:
        finish, fail = finish & set(self.loading), fail & set(self.loading)
        for rid in finish | fail:
            self.done.add(self.loading.pop(rid))
        failures = tuple(
            LoadFailure(request_id=r, reason="x", invalid_block_ids=((),), num_valid_tokens=0)
            for r in sorted(fail)
        )
        return WorkerOutput(finished_recving=frozenset(finish), failed_loads=failures)

    def prefill_output(self) -> WorkerOutput:
        now, finished, expired = self.clock.now, set(), set()
        for rid in list(self.holds):
            if rid in self.beats:
                self.holds[rid] = max(self.holds[rid], now + LEASE_S)
            if rid in self.done or rid in self.to_end:
                finished.add(rid)
            elif now > self.holds[rid]:
                finished.add(rid)
                expired.add(rid)
        for rid in finished:
            del self.holds[rid]
        assert not finished & self.ended, "a hold reported finished twice"
        self.ended |= finished
        self.done, self.beats, self.to_end = set(), set(), self.to_end - finished
        return WorkerOutput(finished_sending=frozenset(finished), expired_leases=frozenset(expired))

    def prefill_step(self, prefill: Engine) -> None:
        self.prefill_meta(prefill.sched.build_connector_meta())
        events = prefill.sched.update_connector_output(self.prefill_output())
        for rid in events.free_request_ids:
            prefill.pool.free(prefill.sched.take_blocks_to_free(rid))


PLANS = [
    "load",
    "partial",
    "fail",
    "full_hit",
    "slow_alloc",
    "abort_waiting",
    "abort_allocated",
    "abort_loading",
    "prefill_abort",
]
EXPECTED = {
    "fail": "failed",
    "full_hit": "released",
    "abort_waiting": "aborted",
    "abort_allocated": "aborted",
    "abort_loading": "aborted",
}


def _decode_admit(decode: Engine, plan: str, req: Req, outcomes: dict[str, str], rng) -> None:
    rid, n = req.request_id, len(req.prompt_token_ids)
    hit = {"full_hit": n - 1, "partial": 16}.get(plan, 0)
    num_external, _ = decode.sched.get_num_new_matched_tokens(req, hit)
    if plan == "abort_waiting":
        decode.sched.request_aborted(rid)
        outcomes[rid] = "aborted"
        return
    if plan == "slow_alloc" and rng.random() < 0.7:
        decode.sched.request_waiting(req)  # no blocks this step
        return
    decode.sched.update_state_after_alloc(req, decode.allocate(rid, n), num_external)
    if plan == "abort_allocated":
        decode.sched.request_aborted(rid)
        assert not decode.sched.defers_free(rid)
        decode.free_own(rid)
        outcomes[rid] = "aborted"
    elif num_external == 0:
        outcomes[rid] = "released"


def _decode_step(decode: Engine, wire: Wire, plans: dict[str, str], outcomes, rng) -> None:
    wire.decode_meta(decode.sched.build_connector_meta())
    for rid in wire.loading:
        if plans[rid] == "abort_loading" and decode.sched.load_state(rid) is LoadState.LOADING:
            decode.sched.request_aborted(rid)
            assert decode.sched.defers_free(rid)
    fail = {r for r in wire.loading if plans[r] == "fail"}
    finish = {r for r in wire.loading if r not in fail and (rng is None or rng.random() < 0.5)}
    events = decode.sched.update_connector_output(wire.decode_output(finish, fail))
    ended = {rid: "loaded" for rid in events.loaded_request_ids}
    ended |= {f.request_id: "failed" for f in events.failed}
    ended |= {rid: "aborted" for rid in events.free_request_ids}
    assert not events.recompute  # FailurePolicy.FAIL
    for rid, outcome in ended.items():
        assert rid not in outcomes, (rid, outcome, outcomes.get(rid))  # one ending each
        outcomes[rid] = outcome
        decode.free_own(rid)  # the request ends (or was aborted): the engine frees


@settings(max_examples=80, deadline=None)
@given(plan_list=st.lists(st.sampled_from(PLANS), min_size=1, max_size=10), rng=st.randoms())
def test_prefill_and_decode_end_clean_whatever_happens(plan_list: list[str], rng) -> None:
    clock = FakeClock()  # one time line for both sides
    prefill = Engine(KVRole.PRODUCER, HYBRID, clock=clock)
    decode = Engine(KVRole.CONSUMER, HYBRID, clock=clock, failure_policy=FailurePolicy.FAIL)
    wire = Wire(clock)
    plans, reqs = {}, {}
    for i, plan in enumerate(plan_list):
        rid, n = f"r{i}", rng.randint(40, 120)
        params = prefill.finish(remote_decode(rid, n))
        plans[rid], reqs[rid] = plan, Req(rid, prompt(n), params)
    outcomes: dict[str, str] = {}
    for _ in range(30):
        for rid, req in reqs.items():
            if rid not in outcomes and decode.sched.load_state(rid) in (None, LoadState.MATCHED):
                _decode_admit(decode, plans[rid], req, outcomes, rng)
        for rid in reqs:
            if plans[rid] == "prefill_abort" and prefill.sched.defers_free(rid):
                if rng.random() < 0.3:
                    prefill.sched.request_aborted(rid)
        _decode_step(decode, wire, plans, outcomes, rng)
        wire.prefill_step(prefill)
        clock.advance(rng.choice([0.5, 2.0, 8.0]))
    for rid in reqs:  # still waiting for blocks after 30 steps: give up
        if decode.sched.load_state(rid) is LoadState.MATCHED:
            decode.sched.request_aborted(rid)
            outcomes[rid] = "aborted"
    _decode_step(decode, wire, plans, outcomes, None)  # every load left completes
    for rid in list(decode.blocks):
        decode.free_own(rid)  # loaded and released requests run to their end
    wire.prefill_step(prefill)
    clock.advance(LEASE_S + 1)
    wire.prefill_step(prefill)
    assert outcomes.keys() == reqs.keys()
    for rid, plan in plans.items():
        assert outcomes[rid] == EXPECTED.get(plan, outcomes[rid]), (rid, plan)
        assert outcomes[rid] != "failed" or plan == "fail"
    assert sum(decode.sched.load_outcomes.values()) == len(reqs)
    assert sum(prefill.sched.send_outcomes.values()) == len(reqs)
    decode.assert_clean()
    prefill.assert_clean()


def test_window_before_prefills_first_kept_block_is_computed_locally() -> None:
    """vLLM frees out-of-window blocks during prefill: the params start the window group
    at its first kept block. A prompt shorter than prefill's can need older blocks."""
    eng = Engine(KVRole.CONSUMER, kinds=(FULL, SW), block_size=64)  # window 24
    n = 178  # prefill 32-token blocks keep window blocks from (177 - 23) // 32 = 4
    params = remote_params(n, num_groups=2, block_size=32)
    params = msgspec.structs.replace(params, remote_first_block=[0, 4])
    req = Req("w", prompt(129), params)
    # resume at 128: the window needs tokens 105..127, in prefill block 3
    assert admit(eng, req) == 0
    assert eng.sched.load_state("w") is LoadState.RELEASING  # prefill is told to free
    assert eng.sched.num_unserved_loads == 1  # and a warning says why
    ok = Req("v", prompt(129), msgspec.structs.replace(params, remote_first_block=[0, 3]))
    assert admit(eng, ok) == 128
