"""Block ownership under random interleavings, with real connectors and a late transport.

Hypothesis drives a prefill and a decode connector (scheduler and worker sides, real NIXL
in one process) through random sequences of: admit a request, step either engine (vLLM's
async scheduling too: the scheduler builds step k+1's metadata before it hears step k's
output), deliver the transfers on the wire, let time pass (past deadlines, leases, the
longest hold), abort on either side, and end decode requests. The transfers are late on
purpose (``LateTransport``): decode's READs (pull) or prefill's WRITEs (push) land only
when the test delivers them, released or not.

What the engines see is checked after every event:

- every decode request is reported once (loaded, recomputed or failed), freed once, and
  no block is freed twice (the pool raises on a double free);
- a block the engine owns (after a load it was told about, after a recompute wrote it,
  after a free) never changes behind its back: no transfer lands in it any more;
- a load reported loaded holds exactly the prefill's KV (token by token, in both format
  pairs: the same format, and one prefill rewrites on a claim and restores), although
  prefill overwrites each block the moment it gets it back (as an engine reusing it would);
- in the end every request ended, both pools are full and no NIXL handle is left.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbridge.connector.common.metadata import WorkerOutput
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.worker_setup import nixl_engine
from kvbridge.layouts.allocation import CacheFormat, read_group_token_major
from kvbridge.layouts.layout import KVLayout
from tests.connector.late_transport import LateTransport
from tests.connector.pair_harness import FakeClock, Request, Side, make_side, token_ids

FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
BS = 16  # decode's block size
# (prefill block size, prefill format, decode format): the same format, or one where
# prefill rewrites its blocks for decode on a claim and restores them afterwards
FORMATS = {
    "same": (BS, FMT, FMT),
    "rewrite": (64, FMT, CacheFormat(layout=KVLayout.HND, kernel_block_size=8)),
}
LEASE_S = 30.0
TIMEOUT_S = 10.0
MAX_REQUESTS = 4


def _tokens(side: Side, req: Request, n: int) -> torch.Tensor:
    """The KV of the request's first ``n`` tokens, token-major (format-free)."""
    ids = np.asarray(req.block_ids[0], dtype=np.int64)
    return read_group_token_major(side.buffers, 0, ids)[:, :, :n].clone()


def _snapshot(side: Side, block: int) -> torch.Tensor:
    return torch.stack([t[block].clone() for t in side.buffers.tensors])


@dataclass
class Engine:
    """A side plus the engine's discipline: async scheduling, and what it owns."""

    side: Side
    async_sched: bool
    late_output: WorkerOutput | None = None
    owned: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> content

    def step(self) -> list:
        s = self.side
        s.worker.bind_connector_metadata(s.sched.build_connector_meta())
        s.worker.start_load_kv()
        s.worker.wait_for_save()
        out = s.worker.get_finished()
        if self.async_sched:  # step k's output is folded after step k+1 was scheduled
            out, self.late_output = self.late_output, out
        return [] if out is None else [s.sched.update_connector_output(out)]

    def flush(self) -> list:
        out, self.late_output = self.late_output, None
        return [] if out is None else [self.side.sched.update_connector_output(out)]

    def own(self, blocks: list[int]) -> None:
        for b in blocks:
            self.owned[b] = _snapshot(self.side, b)

    def check_owned(self) -> None:
        for b, want in self.owned.items():
            assert torch.equal(_snapshot(self.side, b), want), (
                f"block {b} changed after the engine got it back"
            )


@dataclass
class Pair:
    clock: FakeClock
    prefill: Engine
    decode: Engine
    late: LateTransport
    pull: bool  # the late transfers are decode's READs (else prefill's WRITEs)
    reqs: dict[str, tuple[Request, Request]] = field(default_factory=dict)  # d rid -> (p, d)
    want: dict[str, torch.Tensor] = field(default_factory=dict)  # d rid -> prefill's KV
    outcome: dict[str, str] = field(default_factory=dict)  # d rid -> loaded/recompute/failed
    freed: set[str] = field(default_factory=set)  # decode requests whose blocks are free
    finished: set[str] = field(default_factory=set)  # request_finished called
    prefill_freed: set[str] = field(default_factory=set)

    # -- events -------------------------------------------------------------------------

    def admit(self) -> None:
        i = len(self.reqs)
        if i >= MAX_REQUESTS:
            return
        n = BS * (2 + i) + 1  # decode loads whole blocks: tokens [0, n - 1)
        p = Request(f"p{i}", token_ids(n, seed=i), KVTransferParams(do_remote_decode=True))
        ps = self.prefill.side
        p.block_ids = ps.allocate(n)
        delay, params = ps.sched.request_finished(p, p.block_ids)
        assert delay and params is not None
        ps.pool.free(ps.sched.take_blocks_to_free(p.request_id))
        d = Request(f"d{i}", p.prompt_token_ids, params)
        ds = self.decode.side
        num, _ = ds.sched.get_num_new_matched_tokens(d, 0)
        d.block_ids = ds.allocate(n)
        for b in d.block_ids[0]:
            self.decode.owned.pop(b, None)  # reused: a load may write it now
        ds.sched.update_state_after_alloc(d, d.block_ids, num)
        self.want[d.request_id] = _tokens(ps, p, n - 1)
        self.reqs[d.request_id] = (p, d)

    def step_decode(self) -> None:
        self._decode_events(self.decode.step())

    def step_prefill(self) -> None:
        self._prefill_events(self.prefill.step())

    def land(self) -> None:
        """Deliver every transfer on the wire; the other engine steps meanwhile."""
        self.late.land(self.step_prefill if self.pull else self.step_decode)

    def settle(self) -> None:
        """Step both engines until their handshakes (background threads, real time) are
        through, so that the transfers of later events can be posted."""
        deadline = time.monotonic() + 10.0
        sides = (self.decode.side, self.prefill.side)
        for _ in range(2):  # a step starts the handshakes the last one's messages need
            self.step_decode()
            self.step_prefill()
            while any(s.worker.num_connecting_peers for s in sides):
                assert time.monotonic() < deadline, "handshakes not through within 10 s"
                self.step_decode()
                self.step_prefill()

    def stall(self) -> None:
        """The transfers in flight outlive decode's deadline: both engines step while the
        wire holds them (what a slow link or a frozen peer does)."""
        self.settle()
        self.step_prefill()
        self.step_decode()
        self.tick(TIMEOUT_S + 1)
        for _ in range(2):
            self.step_decode()
            self.step_prefill()

    def tick(self, dt: float) -> None:
        self.clock.now += dt

    def abort_decode(self, i: int) -> None:
        rid = f"d{i}"
        if rid not in self.reqs or rid in self.finished or rid in self.outcome:
            return
        ds = self.decode.side
        ds.sched.request_aborted(rid)
        self.finished.add(rid)
        if not ds.sched.defers_free(rid):
            self._free_decode(rid)

    def abort_prefill(self, i: int) -> None:
        rid = f"p{i}"
        if f"d{i}" in self.reqs and rid not in self.prefill_freed:
            self.prefill.side.sched.request_aborted(rid)

    def finish_decode(self, i: int) -> None:
        """A request that loaded or recomputed runs to its end."""
        rid = f"d{i}"
        if rid not in self.outcome or rid in self.finished or self.outcome[rid] == "failed":
            return
        _, d = self.reqs[rid]
        delay, _ = self.decode.side.sched.request_finished(d, d.block_ids)
        self.finished.add(rid)
        if not delay:
            self._free_decode(rid)

    # -- what the engines hear ----------------------------------------------------------

    def _decode_events(self, events: list) -> None:
        for ev in events:
            for rid in ev.loaded_request_ids:
                self._ended(rid, "loaded")
                _, d = self.reqs[rid]
                want = self.want[rid]
                got = _tokens(self.decode.side, d, want.shape[2])
                assert torch.equal(got, want), f"{rid} loaded other KV"
                self.decode.own(d.block_ids[0])
            for f in ev.recompute:
                self._ended(f.request_id, "recompute")
                _, d = self.reqs[f.request_id]
                for b in d.block_ids[0]:  # the engine computes the prompt into them
                    for t in self.decode.side.buffers.tensors:
                        t[b].fill_(b % 7 + 1)
                self.decode.own(d.block_ids[0])
            for f in ev.failed:
                self._ended(f.request_id, "failed")
                self.finished.add(f.request_id)  # the engine ends the request
                if not self.decode.side.sched.defers_free(f.request_id):
                    self._free_decode(f.request_id)
            for rid in ev.free_request_ids:
                if rid in self.reqs and rid not in self.freed:
                    self._free_decode(rid)

    def _ended(self, rid: str, how: str) -> None:
        assert rid not in self.outcome, f"{rid} reported {how} after {self.outcome[rid]}"
        assert rid not in self.freed, f"{rid} reported {how} after its blocks were freed"
        self.outcome[rid] = how

    def _free_decode(self, rid: str) -> None:
        assert rid not in self.freed, f"{rid} freed twice"
        _, d = self.reqs[rid]
        self.decode.side.pool.free([b for ids in d.block_ids for b in ids])
        self.decode.own(d.block_ids[0])
        self.freed.add(rid)

    def _prefill_events(self, events: list) -> None:
        ps = self.prefill.side
        for ev in events:
            for rid in ev.free_request_ids:
                assert rid not in self.prefill_freed, f"{rid} freed twice on prefill"
                self.prefill_freed.add(rid)
                p, _ = self.reqs[f"d{rid[1:]}"]
                ps.pool.free(ps.sched.take_blocks_to_free(rid))
                for b in p.block_ids[0]:  # reused at once: anything read later is garbage
                    for t in ps.buffers.tensors:
                        t[b].random_(0, 255)


OPS = st.lists(
    st.one_of(
        st.just(("admit",)),
        st.just(("settle",)),
        st.just(("stall",)),
        st.just(("step_decode",)),
        st.just(("step_prefill",)),
        st.just(("step_decode",)),
        st.just(("step_prefill",)),
        st.just(("land",)),
        st.tuples(st.just("tick"), st.sampled_from([1.0, 6.0, 40.0, 700.0])),
        st.tuples(st.just("abort_decode"), st.integers(0, MAX_REQUESTS - 1)),
        st.tuples(st.just("abort_prefill"), st.integers(0, MAX_REQUESTS - 1)),
        st.tuples(st.just("finish_decode"), st.integers(0, MAX_REQUESTS - 1)),
    ),
    min_size=4,
    max_size=40,
)


@pytest.fixture(params=["pull", "push"])
def mode(request) -> str:
    return request.param


@pytest.fixture(params=sorted(FORMATS))
def formats(request) -> str:
    return request.param


def _make_pair(mode: str, async_sched: bool, formats: str = "same") -> Iterator[Pair]:
    prefill_bs, prefill_fmt, decode_fmt = FORMATS[formats]
    clock = FakeClock()
    transports: list[LateTransport] = []

    def late(name: str) -> LateTransport:
        transports.append(LateTransport(nixl_engine(name)))
        return transports[-1]

    extra = {"extra": {"transfer_mode": mode}}
    prefill = make_side(
        "kv_producer",
        "prefill",
        prefill_bs,
        prefill_fmt,
        "F",
        clock,
        num_blocks=48,
        lease_s=LEASE_S,
        engine_factory=late if mode == "push" else None,
        **extra,
    )
    try:
        decode = make_side(
            "kv_consumer",
            "decode",
            BS,
            decode_fmt,
            "F",
            clock,
            num_blocks=48,
            transfer_timeout_s=TIMEOUT_S,
            engine_factory=late if mode == "pull" else None,
            **extra,
        )
    except BaseException:
        prefill.worker.shutdown()
        raise
    pair = Pair(
        clock=clock,
        prefill=Engine(prefill, async_sched),
        decode=Engine(decode, async_sched),
        late=transports[0],
        pull=mode == "pull",
    )
    try:
        yield pair
    finally:
        decode.worker.shutdown()
        prefill.worker.shutdown()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS, async_sched=st.booleans())
# the case this test exists for, always run: a transfer outlives decode's deadline, the
# engines go on, and it lands later
@example(ops=[("admit",), ("stall",), ("stall",), ("land",), ("admit",)], async_sched=False)
@example(ops=[("admit",), ("stall",), ("stall",), ("land",), ("admit",)], async_sched=True)
def test_no_block_changes_after_give_back_and_every_request_ends_once(
    mode, formats, ops, async_sched
):
    for pair in _make_pair(mode, async_sched, formats):
        for op, *args in ops:
            getattr(pair, op)(*args)
            pair.decode.check_owned()
        _drain(pair)
        pair.decode.check_owned()
        assert set(pair.outcome) | pair.freed >= set(pair.reqs)
        for side in (pair.prefill.side, pair.decode.side):
            side.pool.assert_all_free()
            assert side.worker.num_live_handles == 0
        assert pair.late.num_in_flight == 0


def _drain(pair: Pair) -> None:
    """Deliver everything, let every deadline and lease pass, end every request."""
    for _ in range(40):
        pair.settle()  # answers wait for handshakes, which take real time
        pair.land()
        pair.tick(700.0)
        pair.step_prefill()
        pair.step_decode()
        pair._decode_events(pair.decode.flush())
        pair._prefill_events(pair.prefill.flush())
        for i in range(MAX_REQUESTS):
            pair.finish_decode(i)
        pair.decode.check_owned()
        done = pair.freed >= set(pair.reqs) and pair.prefill_freed >= {
            p.request_id for p, _ in pair.reqs.values()
        }
        if done and pair.late.num_in_flight == 0:
            return
    raise AssertionError(
        f"not drained: outcomes {pair.outcome}, decode freed {sorted(pair.freed)}, prefill "
        f"freed {sorted(pair.prefill_freed)}, {pair.late.num_in_flight} transfer(s) in flight"
    )
