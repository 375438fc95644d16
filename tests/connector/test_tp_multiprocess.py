"""Different tensor-parallel sizes across OS processes, at the worker level (no engine).

Each prefill rank is its own child process (``_prefill_child.py``: its own NIXL agent, its
side channel on ``base port + rank``, a cache holding that rank's KV heads, seeded bytes
the test can rebuild). Each decode rank is a :class:`KVBridgeWorker` in the test process
with its own agent. Every decode rank loads the same request; afterwards its cache holds,
byte for byte, the heads :func:`handshake.tp.sources` assigns it, each prefill rank frees
the request only after the last decode rank reading it said ``Done``, and its blocks are
byte-exact again (the head-major rewrite after save is undone).

MLA (one latent, the same on every rank): each decode rank reads it whole from one prefill
rank, and a prefill rank nobody reads is freed by the ``Done`` of the decode rank that
releases it; loads go one decode rank at a time and every prefill rank's ``Done`` set is
checked after each. A state group across TP sizes fails the load, naming both sizes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from connector.metadata import ConnectorMetadata, LoadSpec
from connector.params import KVTransferParams
from connector.worker import KVBridgeWorker
from handshake import tp
from layouts.allocation import KVCacheBuffers, read_group_token_major
from layouts.layout import KVLayout
from tests.connector.conftest import (
    MODEL,
    NUM_BLOCKS,
    SideFormat,
    make_buffers,
    new_id,
    transfer_config,
)
from tests.connector.test_worker_multiprocess import Child

pytestmark = pytest.mark.integration

KINDS = "FS"
TOKENS = 96
PREFILL_FMT = SideFormat(block_size=16, cross_layer=True)  # head-major: 1 desc per chunk
DECODE_FMT = SideFormat(block_size=32, layout=KVLayout.HND, kernel_block_size=16)
PUMP_TIMEOUT_S = 20.0


def _free_port_range(n: int) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1."""
    rng = np.random.default_rng()
    for _ in range(200):
        base = int(rng.integers(20_000, 60_000))
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports found")


class Prefill:
    """A prefill engine at TP ``tp_size``: one child process per rank."""

    def __init__(
        self, tmp: Path, tp_size: int, heads: int, mode: str = "pull", kinds: str = KINDS
    ) -> None:
        self.engine_id = new_id("P")
        self.tp_size, self.heads, self.kinds = tp_size, heads, kinds
        self.port = _free_port_range(tp_size)
        self.ranks = [
            Child(
                PREFILL_FMT,
                engine_id=self.engine_id,
                kv_port=self.port,
                seed=100 + r,
                log=tmp / f"{self.engine_id}-r{r}.log",
                kinds=kinds,
                rank=r,
                tp_size=tp_size,
                total_kv_heads=heads,
                wait_ready=False,
                transfer_mode=mode,
            )
            for r in range(tp_size)
        ]
        for child in self.ranks:  # the children import torch and nixl in parallel
            child.wait_ready()
            assert child.port == self.port + child.rank

    def close(self) -> None:
        for child in self.ranks:
            child.close()


class DecodeRank:
    def __init__(
        self, rank: int, tp_size: int, heads: int, mode: str = "pull", kinds: str = KINDS
    ) -> None:
        self.rank = rank
        self.buffers: KVCacheBuffers = make_buffers(
            DECODE_FMT, kinds, NUM_BLOCKS, tp.rank_heads(rank, tp_size, heads).count
        )
        self.worker = KVBridgeWorker(
            transfer_config(
                "kv_consumer",
                new_id("D"),
                handshake_timeout_s=5.0,
                extra={"transfer_mode": mode},
            ),
            replace(MODEL, num_kv_heads=heads),
            rank=rank,
            tp_size=tp_size,
        )
        self.worker.register_kv_caches(self.buffers)
        self.loaded: set[str] = set()
        self.failed: dict[str, str] = {}

    def load(self, spec: LoadSpec) -> None:
        self.worker.bind_connector_metadata(ConnectorMetadata(reqs_to_load=(spec,)))
        self.worker.start_load_kv()

    def pump(self) -> None:
        out = self.worker.get_finished()
        self.loaded |= set(out.finished_recving)
        self.failed.update({f.request_id: f.reason for f in out.failed_loads})


def _pump(decodes: list[DecodeRank], prefill: Prefill, done, what: str) -> None:
    deadline = time.monotonic() + PUMP_TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {PUMP_TIMEOUT_S} s waiting for {what}")
        for d in decodes:
            d.pump()
        for child in prefill.ranks:
            child.drain()


def _held(child: Child, request_id: str) -> list[int] | None:
    child.command(cmd="held", request_id=request_id)
    return child.wait_for("held")["readers_done"]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def setup(tmp: Path) -> Iterator:
    made: list = []

    def _make(decode_tp: int, prefill_tp: int, heads: int, mode: str = "pull", kinds: str = KINDS):
        prefill = Prefill(tmp, prefill_tp, heads, mode, kinds)
        made.append(prefill)
        decodes = [DecodeRank(d, decode_tp, heads, mode, kinds) for d in range(decode_tp)]
        made.extend(decodes)
        return prefill, decodes

    try:
        yield _make
    finally:
        for m in made:
            if isinstance(m, Prefill):
                m.close()
            else:
                m.worker.shutdown()


def _window_lo(kind: str) -> int:
    """First token a load moves for a group kind: a sliding window (24) only its tail."""
    return TOKENS - 24 if kind == "S" else 0


def _request(prefill: Prefill, rng: np.random.Generator) -> tuple[str, list, list, list]:
    """Prefill block ids per group (same on every rank), decode block ids, first blocks."""
    pb, db = PREFILL_FMT.block_size, DECODE_FMT.block_size
    rid = new_id("send")
    # a window keeps only its tail, a state group its last block
    first = [TOKENS // pb - 1 if k == "M" else _window_lo(k) // pb for k in prefill.kinds]
    remote = [rng.permutation(NUM_BLOCKS)[: -(-TOKENS // pb) - f] for f in first]
    local = [rng.permutation(NUM_BLOCKS)[: -(-TOKENS // db)] for _ in prefill.kinds]
    return rid, remote, first, local


def _spec(prefill: Prefill, rid: str, remote, first, local) -> LoadSpec:
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=prefill.engine_id,
        remote_host="127.0.0.1",
        remote_port=prefill.port,
        remote_rank=0,
        remote_tp_size=prefill.tp_size,
        remote_block_ids=[[int(b) for b in ids] for ids in remote],
        remote_first_block=first,
        remote_block_size=PREFILL_FMT.block_size,
        num_tokens=TOKENS,
        remote_request_id=rid,
    )
    return LoadSpec(
        request_id=new_id("load"),
        params=params,
        local_block_ids=tuple(tuple(int(b) for b in ids) for ids in local),
        start_token=0,
        end_token=TOKENS,
    )


def _check_heads(
    prefill: Prefill, decode: DecodeRank, slices: tuple[tp.HeadSlice, ...], remote, first, local
) -> None:
    """The decode rank's heads equal, byte for byte, the prefill heads ``slices`` name
    (every prefill rank's cache holds different seeded bytes, so this also proves which
    rank was read)."""
    for g, kind in enumerate(prefill.kinds):
        lo = _window_lo(kind)
        got = read_group_token_major(decode.buffers, g, np.asarray(local[g]))
        for s in slices:
            src = prefill.ranks[s.remote_rank].buffers
            want = read_group_token_major(src, g, np.asarray(remote[g]))
            off = first[g] * PREFILL_FMT.block_size
            a = got[:, :, lo:TOKENS, s.local_head : s.local_head + s.num_heads]
            b = want[:, :, lo - off : TOKENS - off, s.remote_head : s.remote_head + s.num_heads]
            assert torch.equal(a, b), (decode.rank, s, g)


def _descriptors(kinds: str, num_sources: int) -> int:
    """Prefill cross-layer, decode per-layer: one descriptor per (layer, 16-token wire
    chunk, source rank); a full or MLA group moves 6 chunks, the sliding window 2
    (tokens 72..95)."""
    chunks = sum(TOKENS // 16 - _window_lo(k) // 16 for k in kinds)
    return num_sources * 2 * chunks


def _await_done(
    prefill: Prefill,
    rank: int,
    decodes: list[DecodeRank],
    rid: str,
    before: list[int],
    after: list[int] | None,
) -> None:
    """Prefill rank ``rank`` moves from ``Done`` by ``before`` to ``after`` (decode ranks,
    sorted), or to freed (``after`` None); it is never seen in any other state."""
    child = prefill.ranks[rank]
    deadline = time.monotonic() + PUMP_TIMEOUT_S
    while (done := _held(child, rid)) != after:
        assert done == before, f"prefill rank {rank}: Done by {done}, want {before} -> {after}"
        assert time.monotonic() < deadline, f"prefill rank {rank} stayed at Done by {before}"
        for d in decodes:  # flush their notifications
            d.pump()
    if after is None:
        _pump(decodes, prefill, lambda: rid in child.sent, f"prefill rank {rank} freed")
    else:
        assert rid not in child.sent, f"prefill rank {rank} freed before all its decode ranks"


def _load_in_turn(
    prefill: Prefill, decodes: list[DecodeRank], spec: LoadSpec, done_by: dict[int, list[int]]
) -> None:
    """``decodes`` load one after another. After each, every prefill rank has heard
    ``Done`` from exactly the decode ranks so far that ``done_by[rank]`` lists (its
    readers, or the one that releases an unread replica), and is freed once all of those
    in ``done_by[rank]`` have."""
    rid = spec.params.remote_request_id
    assert sorted(done_by) == list(range(prefill.tp_size))
    heard: dict[int, list[int]] = {r: [] for r in done_by}
    for r in done_by:
        assert _held(prefill.ranks[r], rid) == [], f"prefill rank {r} does not hold {rid}"
    for d in decodes:
        d.load(spec)
        _pump(
            [d],
            prefill,
            lambda d=d: spec.request_id in d.loaded or bool(d.failed),
            f"decode rank {d.rank}",
        )
        assert not d.failed, d.failed
        for r, ranks in done_by.items():
            before = heard[r]
            if d.rank in ranks:
                heard[r] = sorted([*before, d.rank])
            after = None if heard[r] == sorted(ranks) else heard[r]
            if d.rank in ranks:
                _await_done(prefill, r, decodes, rid, before, after)
            else:  # not told by this decode rank: unchanged
                assert _held(prefill.ranks[r], rid) == after, (r, d.rank)


def _computed_done_by(decode_tp: int, prefill: Prefill) -> dict[int, list[int]]:
    """Prefill rank -> the decode ranks that tell it ``Done``, by handshake.tp."""
    told = [tp.notified_by(d, decode_tp, prefill.tp_size, prefill.heads) for d in range(decode_tp)]
    return {r: [d for d in range(decode_tp) if r in told[d]] for r in range(prefill.tp_size)}


@pytest.mark.parametrize(
    ("decode_tp", "prefill_tp", "heads"),
    [
        (1, 2, 4),  # one decode rank reads two prefill ranks
        (2, 1, 4),  # two decode ranks read halves of one prefill rank
        (2, 2, 4),
        (1, 4, 4),
        (4, 2, 4),
        (1, 4, 2),  # GQA: prefill ranks 0,1 and 2,3 are replicas; decode reads one of each
        (4, 1, 2),  # GQA: decode ranks 0,1 and 2,3 are replicas of one head
    ],
)
def test_decode_ranks_get_their_heads_and_prefill_frees_after_the_last(
    setup, decode_tp, prefill_tp, heads
):
    prefill, decodes = setup(decode_tp, prefill_tp, heads)
    rid, remote, first, local = _request(
        prefill, np.random.default_rng(decode_tp * 10 + prefill_tp)
    )
    for child in prefill.ranks:
        child.send(rid, remote, first)
    spec = _spec(prefill, rid, remote, first, local)
    # decode rank 0 first: every prefill rank it reports to must keep waiting for the
    # other decode ranks that read it; then the others load at the same time
    _load_in_turn(prefill, decodes[:1], spec, _computed_done_by(decode_tp, prefill))
    for d in decodes[1:]:
        d.load(spec)
    _pump(
        decodes,
        prefill,
        lambda: (
            all(spec.request_id in d.loaded or d.failed for d in decodes)
            and all(rid in c.sent for c in prefill.ranks)
        ),
        "every decode rank loaded and every prefill rank freed",
    )
    for d in decodes:
        assert not d.failed, d.failed
        slices = tp.sources(d.rank, decode_tp, prefill_tp, heads)
        _check_heads(prefill, d, slices, remote, first, local)
        assert d.worker.metrics.descriptors_posted == _descriptors(KINDS, len(slices)), d.rank
    for child in prefill.ranks:
        assert child.digest() == child.replica_digest()  # the rewrite after save was undone


# MLA: one latent per token, the same on every rank (``total_kv_heads`` 1). Written out
# rather than derived from handshake.tp, so that a change there shows up here:
# (decode TP, prefill TP, prefill rank each decode rank reads, decode ranks that tell
# each prefill rank Done). A prefill rank nobody reads hears from decode rank
# ``rank % decode TP``.
MLA_ROWS = [
    (1, 2, [0], {0: [0], 1: [0]}),  # prefill rank 1 unread: decode 0 releases it
    (2, 1, [0, 0], {0: [0, 1]}),  # both decode ranks read the one prefill rank
    (2, 4, [0, 1], {0: [0], 1: [1], 2: [0], 3: [1]}),  # ranks 2, 3 unread
    (4, 2, [0, 1, 0, 1], {0: [0, 2], 1: [1, 3]}),  # reads spread over the replicas
]


@pytest.mark.parametrize(("decode_tp", "prefill_tp", "reads", "done_by"), MLA_ROWS)
def test_mla_latent_is_read_once_per_decode_rank_and_every_prefill_rank_frees(
    setup, decode_tp, prefill_tp, reads, done_by
):
    """Each decode rank reads the whole latent from one prefill rank (the plain plan: no
    head slice, nothing rewritten), byte for byte; every prefill rank, read or not, frees
    after ``Done`` from exactly its decode ranks."""
    prefill, decodes = setup(decode_tp, prefill_tp, 1, kinds="L")
    assert _computed_done_by(decode_tp, prefill) == done_by
    rid, remote, first, local = _request(prefill, np.random.default_rng(7 + decode_tp))
    for child in prefill.ranks:
        child.send(rid, remote, first)
    spec = _spec(prefill, rid, remote, first, local)
    _load_in_turn(prefill, decodes, spec, done_by)
    for r, child in enumerate(prefill.ranks):
        assert rid in child.sent, f"prefill rank {r} never freed {rid}"
    for d, r in zip(decodes, reads, strict=True):
        _check_heads(prefill, d, (tp.HeadSlice(r, 0, 0, 1),), remote, first, local)
        assert d.worker.metrics.descriptors_posted == 12  # 2 layers x 6 chunks, one source
        assert d.worker.metrics.bytes_read == TOKENS * 2 * 8 * 2  # 2 layers, 8 fp16 latent
        assert d.worker.metrics.receiver_rewrites == 0
    for child in prefill.ranks:
        assert child.digest() == child.replica_digest()  # nothing rewrote the latent


def test_a_state_group_across_tp_sizes_fails_the_load_naming_both_sizes(setup):
    """Decode TP 1, prefill TP 2, a model with a state group: the handshake refuses each
    prefill rank by name (a rank's state is a shard kvbridge cannot map across sizes);
    the load fails with that reason instead of moving anything."""
    prefill, (decode,) = setup(1, 2, 4, kinds="FM")
    rid, remote, first, local = _request(prefill, np.random.default_rng(5))
    for child in prefill.ranks:
        child.send(rid, remote, first)
    spec = _spec(prefill, rid, remote, first, local)
    decode.load(spec)
    _pump([decode], prefill, lambda: bool(decode.failed), "the load to fail")
    reason = decode.failed[spec.request_id]
    assert "tp_size: local=1 remote=2" in reason, reason
    assert "groups [1] hold recurrent (Mamba-like) state" in reason, reason
    assert "same TP size (both 1 or both 2)" in reason, reason
    assert decode.loaded == set()
    assert decode.worker.metrics.descriptors_posted == 0
    assert decode.worker.metrics.bytes_read == 0


@pytest.mark.parametrize(
    ("decode_tp", "prefill_tp", "heads", "kinds"),
    [
        (1, 2, 4, KINDS),
        (2, 1, 4, KINDS),
        (4, 2, 4, KINDS),
        (1, 4, 2, KINDS),
        (1, 2, 1, "L"),  # MLA: prefill rank 1 is written by nobody, told Done by decode 0
        (2, 4, 1, "L"),
    ],
)
def test_push_mode_writes_each_decode_rank_its_heads(setup, decode_tp, prefill_tp, heads, kinds):
    """Push: every prefill rank a decode rank reads from WRITEs that rank's heads into its
    blocks (its own handshake with each decode rank, the same head-major plan); decode
    ranks post nothing; prefill frees after the last decode rank's Done."""
    prefill, decodes = setup(decode_tp, prefill_tp, heads, "push", kinds)
    rid, remote, first, local = _request(
        prefill, np.random.default_rng(100 + decode_tp * 10 + prefill_tp)
    )
    for child in prefill.ranks:
        child.send(rid, remote, first)
    spec = _spec(prefill, rid, remote, first, local)
    for d in decodes:
        d.load(spec)
    _pump(
        decodes,
        prefill,
        lambda: (
            all(spec.request_id in d.loaded or d.failed for d in decodes)
            and all(rid in c.sent for c in prefill.ranks)
        ),
        "every decode rank pushed to and every prefill rank freed",
    )
    for d in decodes:
        assert not d.failed, d.failed
        slices = tp.sources(d.rank, decode_tp, prefill_tp, heads)
        _check_heads(prefill, d, slices, remote, first, local)
        assert d.worker.metrics.descriptors_posted == 0
        assert d.worker.metrics.bytes_read > 0
    for child in prefill.ranks:
        assert child.digest() == child.replica_digest()  # the rewrite after save was undone
