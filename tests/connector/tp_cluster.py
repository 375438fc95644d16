"""Prefill and decode engines at different TP sizes, as OS processes (not a test).

A :class:`Prefill` is one child process per rank (``_prefill_child.py``: its own NIXL
agent, its side channel on an ephemeral port (``kv_port`` 0) that it reports, a cache
holding that rank's KV heads, seeded bytes the test can rebuild); the params list every
rank's port (``remote_ports``), as a kv_port-0 prefill scheduler advertises them.
A :class:`DecodeRank` is a :class:`KVBridgeWorker` in the test process with its own agent.
:class:`TPCluster` builds them for a test and tears every one down after it. The helpers
below make one request, load it and check that a decode rank's heads equal the prefill
heads :func:`kvbridge.handshake.tp.sources` assigns it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvbridge.connector.common.metadata import ConnectorMetadata, LoadSpec
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.worker import KVBridgeWorker
from kvbridge.handshake import tp
from kvbridge.layouts.allocation import KVCacheBuffers, read_group_token_major
from kvbridge.layouts.layout import KVLayout
from tests.connector.conftest import (
    MODEL,
    NUM_BLOCKS,
    SideFormat,
    make_buffers,
    new_id,
    transfer_config,
)
from tests.connector.packed_engine import ENGINE_ORDER, HndRepacker
from tests.connector.test_worker_multiprocess import Child

KINDS = "FS"
STATE_KINDS = "MT"  # groups that keep one state block per request, no tokens
TOKENS = 96
PREFILL_FMT = SideFormat(block_size=16, cross_layer=True)  # head-major: 1 desc per chunk
DECODE_FMT = SideFormat(block_size=32, layout=KVLayout.HND, kernel_block_size=16)
PUMP_TIMEOUT_S = 20.0


def packed(block_size: int) -> SideFormat:
    """vLLM CPU's engine-packed pages, heads kept in runs (``tests.connector.packed_engine``)."""
    return SideFormat(
        block_size=block_size,
        layout=KVLayout.HND,
        block_packing=ENGINE_ORDER,
        packed_heads_major=True,
        kv_interleaved=True,
    )


class Prefill:
    """A prefill engine at TP ``tp_size``: one child process per rank (per TP rank of
    every pipeline stage, stage-major, when ``pp_layers`` lists the model layers
    ``[first, end)`` of each stage)."""

    def __init__(
        self,
        tmp: Path,
        tp_size: int,
        heads: int,
        mode: str = "pull",
        kinds: str = KINDS,
        fmt: SideFormat = PREFILL_FMT,
        rewrites_in_place: bool = True,
        pp_layers: tuple[tuple[int, int], ...] = (),
        group_layers: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        self.engine_id = new_id("P")
        self.tp_size, self.heads, self.kinds, self.fmt = tp_size, heads, kinds, fmt
        self.pp_layers = pp_layers
        self.ranks = [
            Child(
                fmt,
                engine_id=self.engine_id,
                kv_port=0,  # ephemeral: each rank reports the port it bound
                seed=100 + s * tp_size + r,
                log=tmp / f"{self.engine_id}-pp{s}-r{r}.log",
                kinds=kinds,
                rank=r,
                tp_size=tp_size,
                total_kv_heads=heads,
                wait_ready=False,
                transfer_mode=mode,
                rewrites_in_place=rewrites_in_place,
                pp_rank=s,
                pp_layers=pp_layers,
                group_layers=group_layers,
            )
            for s in range(len(pp_layers) or 1)
            for r in range(tp_size)
        ]
        for child in self.ranks:  # the children import torch and nixl in parallel
            child.wait_ready()
        self.ports = [child.port for child in self.ranks]  # rank order
        self.port = self.ports[0]

    def close(self) -> None:
        for child in self.ranks:
            child.close()


class DecodeRank:
    def __init__(
        self,
        rank: int,
        tp_size: int,
        heads: int,
        mode: str = "pull",
        kinds: str = KINDS,
        fmt: SideFormat = DECODE_FMT,
        pp_rank: int = 0,
        pp_layers: tuple[tuple[int, int], ...] = (),
        group_layers: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        self.rank, self.fmt, self.pp_rank = rank, fmt, pp_rank
        self.buffers: KVCacheBuffers = make_buffers(
            fmt,
            kinds,
            NUM_BLOCKS,
            tp.rank_heads(rank, tp_size, heads).count,
            tp_size=tp_size,
            layers=range(*pp_layers[pp_rank]) if pp_layers else (0, 1),
            group_layers=group_layers,
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
            pp_rank=pp_rank,
            pp_layers=pp_layers,
        )
        if fmt.block_packing:  # engine-packed pages: the engine merges and splits them
            self.worker.set_repacker(HndRepacker(self.buffers))
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


class TPCluster:
    """``make(decode_tp, prefill_tp, heads, ...)`` -> (Prefill, decode ranks); all of them
    are shut down on exit."""

    def __init__(self, tmp: Path) -> None:
        self._tmp = tmp
        self._prefills: list[Prefill] = []
        self._decodes: list[DecodeRank] = []

    def make(
        self,
        decode_tp: int,
        prefill_tp: int,
        heads: int,
        mode: str = "pull",
        kinds: str = KINDS,
        formats: tuple[SideFormat, SideFormat] = (PREFILL_FMT, DECODE_FMT),
        prefill_rewrites: bool = True,
        stages: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] = ((), ()),
        group_layers: tuple[tuple[int, ...], ...] | None = None,
    ) -> tuple[Prefill, list[DecodeRank]]:
        """``prefill_rewrites=False``: prefill may not rewrite its blocks (read natively).
        ``stages``: the model layers ``[first, end)`` of each pipeline stage of prefill and
        of decode (empty: no pipeline parallelism); decode ranks are stage-major."""
        prefill = Prefill(
            self._tmp,
            prefill_tp,
            heads,
            mode,
            kinds,
            formats[0],
            rewrites_in_place=prefill_rewrites,
            pp_layers=stages[0],
            group_layers=group_layers,
        )
        self._prefills.append(prefill)
        decodes = [
            DecodeRank(d, decode_tp, heads, mode, kinds, formats[1], s, stages[1], group_layers)
            for s in range(len(stages[1]) or 1)
            for d in range(decode_tp)
        ]
        self._decodes.extend(decodes)
        return prefill, decodes

    def __enter__(self) -> TPCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for prefill in self._prefills:
            prefill.close()
        for decode in self._decodes:
            decode.worker.shutdown()


def pump(decodes: list[DecodeRank], prefill: Prefill, done, what: str) -> None:
    deadline = time.monotonic() + PUMP_TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {PUMP_TIMEOUT_S} s waiting for {what}")
        for d in decodes:
            d.pump()
        for child in prefill.ranks:
            child.drain()


def held(child: Child, request_id: str) -> list[int] | None:
    child.command(cmd="held", request_id=request_id)
    return child.wait_for("held")["readers_done"]


def window_lo(kind: str) -> int:
    """First token a load moves for a group kind: a sliding window (24) only its tail, the
    23 tokens before the next one (``SlidingWindowSpec.window_start``)."""
    return TOKENS - 24 + 1 if kind == "S" else 0


@dataclass(frozen=True)
class Request:
    """One prompt's blocks: prefill's per group (the same on every rank) from
    ``first[g]`` on, and decode's."""

    rid: str
    remote: list[np.ndarray]
    first: list[int]
    local: list[np.ndarray]


def new_request(prefill: Prefill, decode_fmt: SideFormat, rng: np.random.Generator) -> Request:
    pb, db = prefill.fmt.block_size, decode_fmt.block_size
    # a window keeps only its tail, a state group its last block
    first = [TOKENS // pb - 1 if k in STATE_KINDS else window_lo(k) // pb for k in prefill.kinds]
    remote = [rng.permutation(NUM_BLOCKS)[: -(-TOKENS // pb) - f] for f in first]
    local = [rng.permutation(NUM_BLOCKS)[: -(-TOKENS // db)] for _ in prefill.kinds]
    return Request(new_id("send"), remote, first, local)


def send(prefill: Prefill, req: Request) -> None:
    """Every prefill rank keeps the request's blocks for decode."""
    for child in prefill.ranks:
        child.send(req.rid, req.remote, req.first)


def load_spec(prefill: Prefill, req: Request) -> LoadSpec:
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=prefill.engine_id,
        remote_host="127.0.0.1",
        remote_port=prefill.port,
        remote_ports=prefill.ports,
        remote_rank=0,
        remote_tp_size=prefill.tp_size,
        remote_pp_layers=[list(s) for s in prefill.pp_layers],
        remote_block_ids=[[int(b) for b in ids] for ids in req.remote],
        remote_first_block=req.first,
        remote_block_size=prefill.fmt.block_size,
        num_tokens=TOKENS,
        remote_request_id=req.rid,
    )
    return LoadSpec(
        request_id=new_id("load"),
        params=params,
        local_block_ids=tuple(tuple(int(b) for b in ids) for ids in req.local),
        start_token=0,
        end_token=TOKENS,
    )


def check_heads(
    prefill: Prefill,
    decode: DecodeRank,
    slices: tuple[tp.HeadSlice, ...],
    req: Request,
    end: int = TOKENS,
) -> None:
    """The decode rank's heads of tokens up to ``end`` equal, byte for byte, the prefill
    heads ``slices`` name (every prefill rank's cache holds different seeded bytes, so
    this also proves which rank was read)."""
    for g, kind in enumerate(prefill.kinds):
        if kind in STATE_KINDS:  # no heads: the state tests check those groups
            continue
        lo = window_lo(kind)
        got = read_group_token_major(decode.buffers, g, np.asarray(req.local[g]))
        for s in slices:
            src = prefill.ranks[s.remote_rank].buffers
            want = read_group_token_major(src, g, np.asarray(req.remote[g]))
            off = req.first[g] * prefill.fmt.block_size
            a = got[:, :, lo:end, s.local_head : s.local_head + s.num_heads]
            b = want[:, :, lo - off : end - off, s.remote_head : s.remote_head + s.num_heads]
            assert a.equal(b), (decode.rank, s, g)


def load_all(prefill: Prefill, decodes: list[DecodeRank], spec: LoadSpec, what: str) -> None:
    """Every decode rank loads ``spec`` at once; wait until each has loaded (or failed)
    and every prefill rank has freed the request."""
    rid = spec.params.remote_request_id
    for d in decodes:
        d.load(spec)
    pump(
        decodes,
        prefill,
        lambda: (
            all(spec.request_id in d.loaded or d.failed for d in decodes)
            and (any(d.failed for d in decodes) or all(rid in c.sent for c in prefill.ranks))
        ),
        what,
    )
