"""Different tensor-parallel sizes across OS processes, at the worker level (no engine).

Each prefill rank is its own child process (``_prefill_child.py``: its own NIXL agent, its
side channel on ``base port + rank``, a cache holding that rank's KV heads, seeded bytes
the test can rebuild). Each decode rank is a :class:`KVBridgeWorker` in the test process
with its own agent. Every decode rank loads the same request; afterwards its cache holds,
byte for byte, the heads :func:`handshake.tp.sources` assigns it, each prefill rank frees
the request only after the last decode rank reading it said ``Done``, and its blocks are
byte-exact again (the head-major rewrite after save is undone).
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

    def __init__(self, tmp: Path, tp_size: int, heads: int, mode: str = "pull") -> None:
        self.engine_id = new_id("P")
        self.tp_size, self.heads = tp_size, heads
        self.port = _free_port_range(tp_size)
        self.ranks = [
            Child(
                PREFILL_FMT,
                engine_id=self.engine_id,
                kv_port=self.port,
                seed=100 + r,
                log=tmp / f"{self.engine_id}-r{r}.log",
                kinds=KINDS,
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
    def __init__(self, rank: int, tp_size: int, heads: int, mode: str = "pull") -> None:
        self.rank = rank
        self.buffers: KVCacheBuffers = make_buffers(
            DECODE_FMT, KINDS, NUM_BLOCKS, tp.rank_heads(rank, tp_size, heads).count
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

    def _make(decode_tp: int, prefill_tp: int, heads: int, mode: str = "pull"):
        prefill = Prefill(tmp, prefill_tp, heads, mode)
        made.append(prefill)
        decodes = [DecodeRank(d, decode_tp, heads, mode) for d in range(decode_tp)]
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


def _request(prefill: Prefill, rng: np.random.Generator) -> tuple[str, list, list, list]:
    """Prefill block ids per group (same on every rank), decode block ids, first blocks."""
    pb, db = PREFILL_FMT.block_size, DECODE_FMT.block_size
    rid = new_id("send")
    first = [0, max(0, TOKENS - 24) // pb]  # sliding window 24: only its tail is kept
    remote = [rng.permutation(NUM_BLOCKS)[: -(-TOKENS // pb) - f] for f in first]
    local = [rng.permutation(NUM_BLOCKS)[: -(-TOKENS // db)] for _ in KINDS]
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


def _check_heads(prefill: Prefill, decode: DecodeRank, decode_tp: int, remote, first, local):
    """The decode rank's heads equal the prefill ranks' heads it was assigned."""
    for g in range(len(KINDS)):
        lo = 0 if g == 0 else TOKENS - 24
        got = read_group_token_major(decode.buffers, g, np.asarray(local[g]))
        for s in tp.sources(decode.rank, decode_tp, prefill.tp_size, prefill.heads):
            src = prefill.ranks[s.remote_rank].buffers
            want = read_group_token_major(src, g, np.asarray(remote[g]))
            off = first[g] * PREFILL_FMT.block_size
            a = got[:, :, lo:TOKENS, s.local_head : s.local_head + s.num_heads]
            b = want[:, :, lo - off : TOKENS - off, s.remote_head : s.remote_head + s.num_heads]
            assert torch.equal(a, b), (decode.rank, s, g)


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
    # other decode ranks that read it
    decodes[0].load(spec)
    _pump(
        decodes[:1],
        prefill,
        lambda: spec.request_id in decodes[0].loaded or bool(decodes[0].failed),
        "rank 0",
    )
    assert not decodes[0].failed, decodes[0].failed
    for r in tp.notified_by(0, decode_tp, prefill_tp, heads):
        child = prefill.ranks[r]
        deadline = time.monotonic() + PUMP_TIMEOUT_S
        while (done := _held(child, rid)) != [0]:
            assert done is None or done == [], done
            if done is None:  # freed: only right when decode rank 0 was its only reader
                assert tp.expected_done(r, decode_tp, prefill_tp, heads) == 1
                break
            assert time.monotonic() < deadline, f"prefill rank {r} never saw decode rank 0's Done"
            decodes[0].pump()
        if tp.expected_done(r, decode_tp, prefill_tp, heads) > 1:
            assert rid not in child.sent
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
        _check_heads(prefill, d, decode_tp, remote, first, local)
    for child in prefill.ranks:
        assert child.digest() == child.replica_digest()  # the rewrite after save was undone
    descs = [d.worker.metrics.descriptors_posted for d in decodes]
    # prefill cross-layer, decode per-layer: one descriptor per (layer, 16-token chunk,
    # source rank); group 0 moves 6 chunks, the sliding-window group 2 (tokens 72..95)
    for d, n in zip(decodes, descs, strict=True):
        sources = len(tp.sources(d.rank, decode_tp, prefill_tp, heads))
        assert n == sources * 2 * (6 + 2), (d.rank, n)


@pytest.mark.parametrize(
    ("decode_tp", "prefill_tp", "heads"),
    [(1, 2, 4), (2, 1, 4), (4, 2, 4), (1, 4, 2)],
)
def test_push_mode_writes_each_decode_rank_its_heads(setup, decode_tp, prefill_tp, heads):
    """Push: every prefill rank a decode rank reads from WRITEs that rank's heads into its
    blocks (its own handshake with each decode rank, the same head-major plan); decode
    ranks post nothing; prefill frees after the last decode rank's Done."""
    prefill, decodes = setup(decode_tp, prefill_tp, heads, "push")
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
        _check_heads(prefill, d, decode_tp, remote, first, local)
        assert d.worker.metrics.descriptors_posted == 0
        assert d.worker.metrics.bytes_read > 0
    for child in prefill.ranks:
        assert child.digest() == child.replica_digest()  # the rewrite after save was undone
