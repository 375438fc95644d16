"""Block ownership under random interleavings, with real connectors and a late transport.

Hypothesis drives a prefill and two decode connectors (scheduler and worker sides, real
NIXL in one process) through random sequences of: admit a request on either decode; load
its params again (on the other decode: a router retrying or hedging, two readers of one
hold; on the same decode: a duplicate local request, loading or a full prefix hit); step
any engine (vLLM's async scheduling too: the scheduler builds step k+1's metadata before it
hears step k's output); deliver the transfers on the wire; let time pass (past deadlines,
leases, the longest hold); abort on either side; end decode requests; and make a side's
next notifications fail for a local reason (the transport refuses them: the message fails,
the peer stays). The transfers are late on purpose (``LateTransport``): each decode's READs
(pull) or prefill's WRITEs (push) land only when the test delivers them, released or not.

What the engines see is checked after every event, on both decodes:

- every decode request is reported once (loaded, recomputed or failed), freed once, and
  no block is freed twice (the pool raises on a double free);
- a block the engine owns (after a load it was told about, after a recompute or a prefix
  hit wrote it, after a free) never changes behind its back: no transfer lands in it any
  more;
- a load reported loaded holds exactly the prefill's KV (token by token, in both format
  pairs: the same format, and one prefill rewrites on a claim and restores), although
  prefill overwrites each block the moment it gets it back (as an engine reusing it
  would), and although the other decode or a duplicate said ``Done`` first;
- in the end every request ended, all pools are full, no NIXL handle is left, and no side
  dropped a peer (every send failure here is local).
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
from kvbridge.connector.common.signing import ParamsSignatureError
from kvbridge.connector.transfer.errors import TransferError
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.nixl_setup import nixl_engine
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
MAX_REQUESTS = 4  # prefill requests
MAX_LOADS = 8  # decode requests, both decodes together (at most 6 blocks each: 48 fit)
NUM_DECODES = 2


class LocalSendFailures:
    """A transfer engine whose next ``fail_next`` notifications fail on this side:
    ``TransferError``, as NIXL's engine raises for a send it refuses locally (a message
    over its limit, an unknown agent, a backend error), not ``PeerDisconnectedError`` (the
    peer is gone). Records the peers the worker removes (a drop)."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self.fail_next = 0
        self.garble_next = 0  # ... or arrive unreadable (cut in half): the peer drops them
        self.removed: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def send_notif(self, peer: str, msg: bytes) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise TransferError(f"send_notif to {peer!r}: refused here (test)")
        if self.garble_next:
            self.garble_next -= 1
            msg = msg[: len(msg) // 2]
        self.inner.send_notif(peer, msg)

    def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)
        self.inner.remove_peer(peer)


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
    transport: LocalSendFailures
    late_output: WorkerOutput | None = None
    owned: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> content

    @property
    def late(self) -> LateTransport | None:
        """Its transport, when its transfers are the late ones."""
        inner = self.transport.inner
        return inner if isinstance(inner, LateTransport) else None

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
                f"block {b} of {self.side.worker.config.engine_id} changed after the engine "
                f"got it back"
            )


@dataclass
class Load:
    """A decode request: the decode it runs on, the prefill request whose params it has."""

    decode: int
    source: int
    req: Request


@dataclass
class Pair:
    clock: FakeClock
    prefill: Engine
    decodes: list[Engine]
    pull: bool  # the late transfers are decode's READs (else prefill's WRITEs)
    sources: list[tuple[Request, KVTransferParams]] = field(default_factory=list)  # prefill's
    want: list[torch.Tensor] = field(default_factory=list)  # prefill's KV, by source
    loads: dict[str, Load] = field(default_factory=dict)  # by decode request id
    outcome: dict[str, str] = field(default_factory=dict)  # loaded/recompute/failed/hit
    freed: set[str] = field(default_factory=set)  # decode requests whose blocks are free
    finished: set[str] = field(default_factory=set)  # request_finished called
    prefill_freed: set[str] = field(default_factory=set)

    @property
    def engines(self) -> list[Engine]:
        return [self.prefill, *self.decodes]

    @property
    def num_in_flight(self) -> int:
        return sum(e.late.num_in_flight for e in self.engines if e.late is not None)

    # -- events -------------------------------------------------------------------------

    def admit(self, k: int) -> None:
        """Prefill finishes a new request; decode ``k`` loads it."""
        i = len(self.sources)
        if i >= MAX_REQUESTS or len(self.loads) >= MAX_LOADS:
            return
        n = BS * (2 + i) + 1  # decode loads whole blocks: tokens [0, n - 1)
        p = Request(f"p{i}", token_ids(n, seed=i), KVTransferParams(do_remote_decode=True))
        ps = self.prefill.side
        p.block_ids = ps.allocate(n)
        delay, params = ps.sched.request_finished(p, p.block_ids)
        assert delay and params is not None
        ps.pool.free(ps.sched.take_blocks_to_free(p.request_id))
        self.want.append(_tokens(ps, p, n - 1))
        self.sources.append((p, params))
        self.load_again(i, k, hit=False)

    def load_again(self, i: int, k: int, hit: bool) -> None:
        """Decode ``k`` gets a request with the params of the ``i``-th source (modulo
        those admitted): a retry or hedge (the other decode loads them too), or a
        duplicate here, which loads or (``hit``) finds the whole prompt in its prefix
        cache."""
        if not self.sources or len(self.loads) >= MAX_LOADS:
            return
        i %= len(self.sources)
        p, params = self.sources[i]
        d = Request(f"d{len(self.loads)}", p.prompt_token_ids, params)
        engine = self.decodes[k]
        ds = engine.side
        n = len(p.prompt_token_ids)
        try:
            num, _ = ds.sched.get_num_new_matched_tokens(d, n - 1 if hit else 0)
        except ParamsSignatureError:  # the params expired: the engine refuses the request
            return
        d.block_ids = ds.allocate(n)
        for b in d.block_ids[0]:
            engine.owned.pop(b, None)  # reused: a load may write it now
        ds.sched.update_state_after_alloc(d, d.block_ids, num)
        self.loads[d.request_id] = Load(k, i, d)
        if hit:  # the engine has the prompt's KV: it never hears of a load
            self.outcome[d.request_id] = "hit"
            self._compute(d.request_id)

    def step_decode(self, k: int) -> None:
        self._decode_events(k, self.decodes[k].step())

    def step_decodes(self) -> None:
        for k in range(len(self.decodes)):
            self.step_decode(k)

    def step_prefill(self) -> None:
        self._prefill_events(self.prefill.step())

    def land(self, k: int) -> None:
        """Deliver every transfer on decode ``k``'s wire (push: prefill's, to both); the
        other engines step meanwhile."""
        if self.pull:
            self.decodes[k].late.land(self.step_prefill)
        else:
            self.prefill.late.land(self.step_decodes)

    def settle(self) -> None:
        """Step every engine until their handshakes (background threads, real time) are
        through, so that the transfers of later events can be posted, and until every
        notification sent has arrived (NIXL delivers them in real time too)."""
        deadline = time.monotonic() + 10.0
        for _ in range(2):  # a step starts the handshakes the last one's messages need
            self.step_decodes()
            self.step_prefill()
            while not self._quiet():
                assert time.monotonic() < deadline, "not settled within 10 s"
                self.step_decodes()
                self.step_prefill()

    def _quiet(self) -> bool:
        workers = [e.side.worker for e in self.engines]
        sent = sum(w.metrics.notifications_sent for w in workers)
        received = sum(w.metrics.notifications_received for w in workers)
        return received >= sent and not any(w.num_connecting_peers for w in workers)

    def stall(self) -> None:
        """The transfers in flight outlive decode's deadline: every engine steps while the
        wire holds them (what a slow link or a frozen peer does)."""
        self.settle()
        self.step_prefill()
        self.step_decodes()
        self.tick(TIMEOUT_S + 1)
        for _ in range(2):
            self.step_decodes()
            self.step_prefill()

    def tick(self, dt: float) -> None:
        self.clock.now += dt

    def fail_sends(self, side: int, n: int) -> None:
        """The next ``n`` notifications of engine ``side`` (0: prefill) fail locally."""
        self.engines[side].transport.fail_next = n

    def garble_sends(self, side: int, n: int) -> None:
        """The next ``n`` notifications of engine ``side`` (0: prefill) arrive unreadable:
        a claim, answer, Push, Done or heartbeat lost on the way (asked again, or its
        unit fails; nothing stays held)."""
        self.engines[side].transport.garble_next = n

    def abort_decode(self, j: int) -> None:
        rid = f"d{j}"
        if rid not in self.loads or rid in self.finished or rid in self.outcome:
            return
        ds = self.decodes[self.loads[rid].decode].side
        ds.sched.request_aborted(rid)
        self.finished.add(rid)
        if not ds.sched.defers_free(rid):
            self._free_decode(rid)

    def abort_prefill(self, i: int) -> None:
        rid = f"p{i}"
        if i < len(self.sources) and rid not in self.prefill_freed:
            self.prefill.side.sched.request_aborted(rid)

    def finish_decode(self, j: int) -> None:
        """A request that loaded, recomputed or hit the prefix cache runs to its end."""
        rid = f"d{j}"
        if rid not in self.outcome or rid in self.finished or self.outcome[rid] == "failed":
            return
        load = self.loads[rid]
        sched = self.decodes[load.decode].side.sched
        delay, _ = sched.request_finished(load.req, load.req.block_ids)
        self.finished.add(rid)
        if not delay:
            self._free_decode(rid)

    # -- what the engines hear ----------------------------------------------------------

    def _decode_events(self, k: int, events: list) -> None:
        engine = self.decodes[k]
        for ev in events:
            for rid in ev.loaded_request_ids:
                self._ended(rid, "loaded")
                load = self.loads[rid]
                want = self.want[load.source]
                got = _tokens(engine.side, load.req, want.shape[2])
                assert torch.equal(got, want), f"{rid} (decode {k}) loaded other KV"
                engine.own(load.req.block_ids[0])
            for f in ev.recompute:
                self._ended(f.request_id, "recompute")
                self._compute(f.request_id)
            for f in ev.failed:
                self._ended(f.request_id, "failed")
                self.finished.add(f.request_id)  # the engine ends the request
                if not engine.side.sched.defers_free(f.request_id):
                    self._free_decode(f.request_id)
            for rid in ev.free_request_ids:
                if rid in self.loads and rid not in self.freed:
                    self._free_decode(rid)

    def _ended(self, rid: str, how: str) -> None:
        assert rid not in self.outcome, f"{rid} reported {how} after {self.outcome[rid]}"
        assert rid not in self.freed, f"{rid} reported {how} after its blocks were freed"
        self.outcome[rid] = how

    def _compute(self, rid: str) -> None:
        """The engine computes the prompt into the request's blocks: it owns them."""
        load = self.loads[rid]
        engine = self.decodes[load.decode]
        for b in load.req.block_ids[0]:
            for t in engine.side.buffers.tensors:
                t[b].fill_(b % 7 + 1)
        engine.own(load.req.block_ids[0])

    def _free_decode(self, rid: str) -> None:
        assert rid not in self.freed, f"{rid} freed twice"
        load = self.loads[rid]
        engine = self.decodes[load.decode]
        engine.side.pool.free([b for ids in load.req.block_ids for b in ids])
        engine.own(load.req.block_ids[0])
        self.freed.add(rid)

    def _prefill_events(self, events: list) -> None:
        ps = self.prefill.side
        for ev in events:
            for rid in ev.free_request_ids:
                assert rid not in self.prefill_freed, f"{rid} freed twice on prefill"
                self.prefill_freed.add(rid)
                p, _ = self.sources[int(rid[1:])]
                ps.pool.free(ps.sched.take_blocks_to_free(rid))
                for b in p.block_ids[0]:  # reused at once: anything read later is garbage
                    for t in ps.buffers.tensors:
                        t[b].random_(0, 255)

    def check_owned(self) -> None:
        for engine in self.decodes:
            engine.check_owned()


DECODE = st.integers(0, NUM_DECODES - 1)
ADMIT = st.tuples(st.just("admit"), DECODE)
LOAD_AGAIN = st.tuples(
    st.just("load_again"), st.integers(0, MAX_REQUESTS - 1), DECODE, st.booleans()
)
OPS = st.lists(
    st.one_of(
        ADMIT,
        ADMIT,
        LOAD_AGAIN,
        LOAD_AGAIN,
        st.just(("settle",)),
        st.just(("stall",)),
        st.tuples(st.just("step_decode"), DECODE),
        st.just(("step_prefill",)),
        st.tuples(st.just("step_decode"), DECODE),
        st.just(("step_prefill",)),
        st.tuples(st.just("land"), DECODE),
        st.tuples(st.just("tick"), st.sampled_from([1.0, 6.0, 40.0, 700.0])),
        st.tuples(st.just("abort_decode"), st.integers(0, MAX_LOADS - 1)),
        st.tuples(st.just("abort_prefill"), st.integers(0, MAX_REQUESTS - 1)),
        st.tuples(st.just("finish_decode"), st.integers(0, MAX_LOADS - 1)),
        st.tuples(st.just("fail_sends"), st.integers(0, NUM_DECODES), st.sampled_from([1, 3])),
        st.tuples(st.just("garble_sends"), st.integers(0, NUM_DECODES), st.sampled_from([1, 3])),
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
    transports: dict[str, LocalSendFailures] = {}

    def factory(late: bool):
        def make(name: str) -> TransferEngine:
            inner = nixl_engine(name)
            transports[name] = LocalSendFailures(LateTransport(inner) if late else inner)
            return transports[name]

        return make

    # no digests: a load that read freed blocks would fail verification and recompute;
    # this test shows the ownership rules alone never let one be reported loaded
    extra = {"extra": {"transfer_mode": mode, "verify": "off"}}
    sides: list[Side] = []
    try:
        sides.append(
            make_side(
                "kv_producer",
                "prefill",
                prefill_bs,
                prefill_fmt,
                "F",
                clock,
                num_blocks=48,
                lease_s=LEASE_S,
                engine_factory=factory(late=mode == "push"),
                **extra,
            )
        )
        for k in range(NUM_DECODES):
            sides.append(
                make_side(
                    "kv_consumer",
                    f"decode{k}",
                    BS,
                    decode_fmt,
                    "F",
                    clock,
                    num_blocks=48,
                    transfer_timeout_s=TIMEOUT_S,
                    engine_factory=factory(late=mode == "pull"),
                    **extra,
                )
            )
        prefill, *decodes = (Engine(s, async_sched, transports[s.worker.agent_name]) for s in sides)
        yield Pair(clock=clock, prefill=prefill, decodes=decodes, pull=mode == "pull")
    finally:
        for side in reversed(sides):
            side.worker.shutdown()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS, async_sched=st.booleans())
# the cases this test exists for, always run: a transfer outlives decode's deadline, the
# engines go on, and it lands later
@example(ops=[("admit", 0), ("stall",), ("stall",), ("land", 0), ("admit", 0)], async_sched=False)
@example(ops=[("admit", 0), ("stall",), ("stall",), ("land", 0), ("admit", 0)], async_sched=True)
# two decodes load the same params; the first one's Done comes while the other's READ is
# still on the wire
@example(
    ops=[
        ("admit", 0),
        ("load_again", 0, 1, False),  # decode 1 gets the same params
        ("settle",),  # both claimed, both READs on the wire
        ("land", 0),
        ("settle",),  # decode 0 loaded and said Done
        ("land", 1),
        ("step_decode", 1),
    ],
    async_sched=False,
)
# duplicates on one decode while their twin loads: one aborted, one a full prefix hit
@example(
    ops=[
        ("admit", 0),
        ("settle",),
        ("load_again", 0, 0, False),
        ("abort_decode", 1),
        ("load_again", 0, 0, True),
        ("settle",),
        ("land", 0),
        ("settle",),
    ],
    async_sched=True,
)
# notifications that fail on this side, on a decode and on prefill
@example(
    ops=[
        ("admit", 0),
        ("fail_sends", 1, 3),
        ("settle",),
        ("admit", 1),
        ("fail_sends", 0, 3),
        ("settle",),
        ("land", 1),
        ("settle",),
    ],
    async_sched=False,
)
# messages lost on the way, both directions: claims and Pushes, answers and Dones
@example(
    ops=[
        ("garble_sends", 1, 1),
        ("admit", 0),
        ("settle",),
        ("garble_sends", 0, 3),
        ("admit", 1),
        ("settle",),
        ("tick", 6.0),
        ("land", 0),
        ("land", 1),
        ("settle",),
    ],
    async_sched=False,
)
# prefill's answers to a decode's Push fail on prefill's side, more times in a row than
# the answer is tried
@example(
    ops=[("admit", 0), ("admit", 0), ("abort_prefill", 0), ("fail_sends", 0, 3)],
    async_sched=False,
)
def test_no_block_changes_after_give_back_and_every_request_ends_once(
    mode, formats, ops, async_sched
):
    for pair in _make_pair(mode, async_sched, formats):
        for op, *args in ops:
            getattr(pair, op)(*args)
            pair.check_owned()
        _drain(pair)
        pair.check_owned()
        assert set(pair.outcome) | pair.freed >= set(pair.loads)
        for engine in pair.engines:
            engine.side.pool.assert_all_free()
            assert engine.side.worker.num_live_handles == 0
        assert pair.num_in_flight == 0
        _assert_no_peer_dropped(pair)


def _assert_no_peer_dropped(pair: Pair) -> None:
    """Every send failure here is local: no side forgot a peer (a decode removes none; a
    peer dropped and found again is handshaken again). Prefill may remove a requester's
    NIXL agent that sat idle, which is no drop."""
    for k, engine in enumerate(pair.decodes):
        assert engine.transport.removed == [], f"decode {k} dropped {engine.transport.removed}"
        assert engine.side.worker.metrics.handshakes <= 1, f"decode {k} handshook again"
    # push: prefill handshakes with each decode it writes to, once
    assert pair.prefill.side.worker.metrics.handshakes <= len(pair.decodes)


def _drain(pair: Pair) -> None:
    """Deliver everything, let every deadline and lease pass, end every request."""
    for _ in range(40):
        pair.settle()  # answers wait for handshakes, which take real time
        for k in range(len(pair.decodes)):
            pair.land(k)
        pair.tick(700.0)
        pair.step_prefill()
        pair.step_decodes()
        for k, engine in enumerate(pair.decodes):
            pair._decode_events(k, engine.flush())
        pair._prefill_events(pair.prefill.flush())
        for j in range(MAX_LOADS):
            pair.finish_decode(j)
        pair.check_owned()
        done = pair.freed >= set(pair.loads) and pair.prefill_freed >= {
            p.request_id for p, _ in pair.sources
        }
        if done and pair.num_in_flight == 0:
            return
    raise AssertionError(
        f"not drained: outcomes {pair.outcome}, decode freed {sorted(pair.freed)}, prefill "
        f"freed {sorted(pair.prefill_freed)}, {pair.num_in_flight} transfer(s) in flight"
    )
