"""Shared fixtures and helpers for worker-connector tests over real NIXL.

A :class:`Cluster` builds :class:`KVBridgeWorker` s (one NIXL agent each) for a cache
format, keeps the most recently used ones for reuse across test cases (an agent costs
10-400 ms to create), pumps them (a worker is driven only through ``get_finished``, as an
engine step would drive it) and shuts every one of them down at the end of the module.

Every wait is a bounded loop: :meth:`Cluster.pump` fails the test with what it waited
for and what it saw when its deadline passes.

A :class:`Request` is one transfer as the engines would describe it; :func:`expectations`
records, before anything moves, the bytes decode must hold afterwards, and
:func:`check_loaded` compares them token-major (state groups: the state block at ``end``).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import pytest
import torch

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.common.metadata import ConnectorMetadata, LoadFailure, LoadSpec, SendSpec
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.worker import KVBridgeWorker, ModelInfo
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers, read_group_token_major
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import AttentionSpec, KVCacheKind, MLASpec, SlidingWindowSpec, StateSpec
from tests.connector.packed_engine import HndRepacker
from tests.handshake.plan_harness import make_groups
from tests.ports import dead_port as held_dead_port
from tests.verified_loads import is_decode, verifying

MODEL = ModelInfo(model_name="m", dtype="float16", num_kv_heads=2, head_size=4)
NUM_BLOCKS = 64
PUMP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SideFormat:
    """One side's cache format; ``str()`` is a short test id such as ``b16-x-HND-k8``."""

    block_size: int
    layout: KVLayout = KVLayout.NHD
    cross_layer: bool = False
    packing: KVPacking = KVPacking.BLOCKS_FIRST
    kernel_block_size: int | None = None
    # engine-packed pages (tests.connector.packed_engine): moved whole, the worker gets
    # an HndRepacker
    block_packing: str = ""
    packed_heads_major: bool = False  # such pages keep each head in one run (TP slices)
    kv_interleaved: bool = False  # K|V side by side per (head, token), as vLLM 0.32 shows

    @property
    def cache_format(self) -> CacheFormat:
        return CacheFormat(
            layout=self.layout,
            kernel_block_size=self.kernel_block_size,
            cross_layer=self.cross_layer,
            packing=self.packing,
            block_packing=self.block_packing,
            packed_heads_major=self.packed_heads_major,
        )

    def __str__(self) -> str:
        alloc = "x" if self.cross_layer else ("ks" if self.packing is KVPacking.KV_SPLIT else "bf")
        kernel = f"-k{self.kernel_block_size}" if self.kernel_block_size else ""
        packed = "-packed" if self.block_packing else ""
        kv = "-kv" if self.kv_interleaved else ""
        return f"b{self.block_size}-{alloc}-{self.layout.value}{kernel}{packed}{kv}"


def fill_buffers(buffers: KVCacheBuffers, seed: int) -> None:
    """Seeded random bytes in every registered tensor, in order; a process that builds the
    same buffers and calls this with the same seed holds the same bytes."""
    gen = torch.Generator().manual_seed(seed)
    for t in buffers.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def make_buffers(
    fmt: SideFormat,
    kinds: str,
    num_blocks: int = NUM_BLOCKS,
    num_kv_heads: int = 2,
    device: str = "cpu",
    tp_size: int = 1,
    layers: Sequence[int] = (0, 1),
    group_layers: Sequence[Sequence[int]] | None = None,
) -> KVCacheBuffers:
    """kinds as in ``plan_harness.make_groups``: 'F' full, 'S' sliding window, 'M' state,
    'T' state sharded over ``tp_size`` ranks; ``num_kv_heads``: the heads this rank holds;
    ``layers``: the model layers it holds (a pipeline stage's), ``group_layers`` as in
    ``make_groups``."""
    groups = make_groups(fmt.block_size, kinds, num_kv_heads, tp_size, layers, group_layers)
    if fmt.kv_interleaved:
        groups = [
            replace(g, spec=replace(g.spec, kv_interleaved=True))
            if isinstance(g.spec, AttentionSpec) and not isinstance(g.spec, MLASpec)
            else g
            for g in groups
        ]
    config = KVCacheConfig.uniform(groups, num_blocks)
    return KVCacheBuffers(config, fmt.cache_format, device)


def transfer_config(role: str, engine_id: str, **overrides) -> KVTransferConfig:
    """A worker's config; a decode verifies every load unless ``overrides`` say otherwise
    (``tests/verified_loads.py``)."""
    raw = {"kv_role": role, "engine_id": engine_id, "kv_port": 0, **overrides}
    if is_decode(role):
        raw = verifying(raw)
    return KVTransferConfig.from_dict(raw)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def params_for(
    engine_id: str, port: int, block_size: int, request_id: str, block_ids, first_block, end: int
) -> KVTransferParams:
    """The ``kv_transfer_params`` a prefill would hand to the proxy."""
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=engine_id,
        remote_host="127.0.0.1",
        remote_port=port,
        remote_block_ids=[[int(b) for b in ids] for ids in block_ids],
        remote_first_block=[int(f) for f in first_block],
        remote_block_size=block_size,
        num_tokens=end,
        remote_request_id=request_id,
    )


class Source(Protocol):
    """A prefill as tests see it: its bytes (or a replica of them) and its address."""

    buffers: KVCacheBuffers
    engine_id: str

    @property
    def port(self) -> int: ...


def block_size_of(side: Source) -> int:
    return side.buffers.config.groups[0].spec.block_size


@dataclass
class Node:
    """A registered worker plus what its ``get_finished`` reported so far."""

    worker: KVBridgeWorker
    buffers: KVCacheBuffers
    engine_id: str
    kinds: str
    sent: set[str] = field(default_factory=set)
    loaded: set[str] = field(default_factory=set)
    failed: dict[str, LoadFailure] = field(default_factory=dict)
    expired: set[str] = field(default_factory=set)

    @property
    def port(self) -> int:
        return self.worker.side_channel_port

    @property
    def block_size(self) -> int:
        return block_size_of(self)

    def fill(self, seed: int) -> None:
        fill_buffers(self.buffers, seed)

    def send(self, request_id: str, block_ids, first_block, *, lease_s: float = 30.0) -> None:
        """Prefill: keep ``block_ids`` (per group) for a reader, as an engine step would."""
        spec = SendSpec(
            request_id=request_id,
            block_ids=tuple(tuple(int(b) for b in ids) for ids in block_ids),
            first_block=tuple(int(f) for f in first_block),
            lease_s=lease_s,
        )
        self.worker.bind_connector_metadata(ConnectorMetadata(reqs_to_send=(spec,)))
        self.worker.start_load_kv()

    def load(self, *specs: LoadSpec) -> None:
        self.worker.bind_connector_metadata(ConnectorMetadata(reqs_to_load=specs))
        self.worker.start_load_kv()

    def collect(self) -> None:
        out = self.worker.get_finished()
        self.sent |= out.finished_sending
        self.loaded |= out.finished_recving
        self.expired |= out.expired_leases
        for failure in out.failed_loads:
            self.failed[failure.request_id] = failure


# -- requests and expected bytes -------------------------------------------------------------


@dataclass
class Request:
    """One transfer: block ids on both sides, as the engines would hand them out."""

    send_id: str
    load_id: str
    remote_ids: list[np.ndarray]  # per group; [0] is logical block remote_first[g]
    remote_first: list[int]
    local_ids: list[np.ndarray]  # per group, logical blocks 0..
    start: int
    end: int

    def spec(self, prefill: Source, *, remote_request_id: str | None = None) -> LoadSpec:
        params = params_for(
            prefill.engine_id,
            prefill.port,
            block_size_of(prefill),
            remote_request_id or self.send_id,
            self.remote_ids,
            self.remote_first,
            self.end,
        )
        return LoadSpec(
            request_id=self.load_id,
            params=params,
            local_block_ids=tuple(tuple(int(b) for b in ids) for ids in self.local_ids),
            start_token=self.start,
            end_token=self.end,
        )

    def state_blocks(self, prefill: Source, decode: Node, group_id: int) -> tuple[int, int]:
        """(remote, local) block ids holding the state after token ``end``."""
        r = self.end // block_size_of(prefill) - 1 - self.remote_first[group_id]
        return int(self.remote_ids[group_id][r]), int(
            self.local_ids[group_id][self.end // decode.block_size - 1]
        )


def block_ids_for(rng: np.random.Generator, count: int, exclude=()) -> np.ndarray:
    """``count`` distinct block ids of the pool, none in ``exclude``."""
    pool = np.setdiff1d(np.arange(NUM_BLOCKS), np.asarray(list(exclude), dtype=np.int64))
    return rng.permutation(pool)[:count]


def plan_request(
    prefill: Source, decode: Node, start: int, end: int, rng: np.random.Generator, *, used=()
) -> Request:
    """Prefill sends a sliding-window group's window tail and a state group's last block
    only; decode allocates every logical block of every group. Ids are distinct across
    groups (one shared pool); ``used`` prefill ids are avoided."""
    pb, db = block_size_of(prefill), decode.block_size
    remote_ids, remote_first, local_ids = [], [], []
    taken_p, taken_d = {int(b) for b in used}, set()
    for group in prefill.buffers.config.groups:
        spec = group.spec
        last = -(-end // pb) - 1
        if isinstance(spec, StateSpec):
            first = last = end // pb - 1
        elif isinstance(spec, SlidingWindowSpec):
            first = spec.window_start(end) // pb
        else:
            first = 0
        ids = block_ids_for(rng, last - first + 1, exclude=taken_p)
        taken_p |= set(ids.tolist())
        remote_ids.append(ids)
        remote_first.append(first)
        lids = block_ids_for(rng, -(-end // db), exclude=taken_d)
        taken_d |= set(lids.tolist())
        local_ids.append(lids)
    return Request(
        send_id=new_id("send"),
        load_id=new_id("load"),
        remote_ids=remote_ids,
        remote_first=remote_first,
        local_ids=local_ids,
        start=start,
        end=end,
    )


def moved_range(decode: Node, req: Request, group_id: int) -> tuple[int, int]:
    """Tokens a load moves for a group: ``[start, end)``, a sliding window only its tail."""
    spec = decode.buffers.config.groups[group_id].spec
    lo = req.start
    if isinstance(spec, SlidingWindowSpec):
        lo = max(lo, spec.window_start(req.end))
    return lo, req.end


def state_bytes(buffers: KVCacheBuffers, group_id: int, block_id: int) -> list[torch.Tensor]:
    """Bytes of every state tensor of every layer of a state group, for one block."""
    out = []
    for layer in buffers.config.groups[group_id].layer_names:
        for view in buffers.state_views(layer):
            out.append(view[block_id].contiguous().view(-1).view(torch.uint8).clone())
    return out


def expectations(prefill: Source, decode: Node, req: Request) -> dict:
    """Before the transfer: prefill's original bytes of what moves, and decode's bytes of
    the request's blocks (its prefix hit must survive the load)."""
    before: dict = {}
    for group in prefill.buffers.config.groups:
        g = group.group_id
        if group.kind is KVCacheKind.STATE:
            rblock, _ = req.state_blocks(prefill, decode, g)
            before["state", g] = state_bytes(prefill.buffers, g, rblock)
            continue
        first_token = req.remote_first[g] * block_size_of(prefill)
        tm = read_group_token_major(prefill.buffers, g, req.remote_ids[g])
        before["want", g] = (first_token, tm)
        before["decode", g] = read_group_token_major(decode.buffers, g, req.local_ids[g])
    return before


def check_loaded(prefill: Source, decode: Node, req: Request, before: dict) -> None:
    """Decode holds prefill's original bytes for every token moved (token-major), and the
    tokens it already had (``[0, start)``) are unchanged."""
    for group in decode.buffers.config.groups:
        g = group.group_id
        if group.kind is KVCacheKind.STATE:
            rblock, lblock = req.state_blocks(prefill, decode, g)
            got = state_bytes(decode.buffers, g, lblock)
            for i, (a, b) in enumerate(zip(got, before["state", g], strict=True)):
                assert torch.equal(a, b), f"group {g} state {i}: local {lblock} != remote {rblock}"
            continue
        lo, hi = moved_range(decode, req, g)
        first_token, want = before["want", g]
        got = read_group_token_major(decode.buffers, g, req.local_ids[g])
        got_part, want_part = got[:, :, lo:hi], want[:, :, lo - first_token : hi - first_token]
        if not torch.equal(got_part, want_part):
            diff = (got_part != want_part).flatten(3).any(dim=(0, 1, 3))
            tokens = (diff.nonzero().view(-1) + lo).tolist()
            raise AssertionError(f"group {g}: tokens {tokens[:12]} of [{lo}, {hi}) differ")
        prefix = before["decode", g][:, :, : req.start]
        assert torch.equal(got[:, :, : req.start], prefix), f"group {g}: prefix hit overwritten"


def snapshot(buffers: KVCacheBuffers) -> list[torch.Tensor]:
    return [t.clone() for t in buffers.tensors]


def assert_restored(buffers: KVCacheBuffers, original: list[torch.Tensor], what: str) -> None:
    """Every byte of ``buffers`` equals ``original``."""
    for i, (t, o) in enumerate(zip(buffers.tensors, original, strict=True)):
        if not torch.equal(t, o):
            rows = (t != o).reshape(t.shape[0], -1).any(dim=1).nonzero().view(-1).tolist()
            raise AssertionError(f"{what}: tensor {i} differs in rows {rows[:10]}")


# -- the cluster ----------------------------------------------------------------------------


class Cluster:
    """Workers of one test module; the ``keep`` most recently used cached ones stay alive."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._cache: OrderedDict[tuple, Node] = OrderedDict()
        self._extra: list[Node] = []

    def node(
        self,
        role: str,
        fmt: SideFormat,
        kinds: str,
        mode: str = "pull",
        *,
        device: str = "cpu",
        buffer_device: str = "auto",
        host_staging: bool | None = None,
    ) -> Node:
        """A cached worker for (role, format, groups, transfer mode, where the cache lives,
        what NIXL moves), built on first use. ``host_staging=True`` stages even a cache in
        host memory through a host mirror (the staging path without a GPU)."""
        key = (role, fmt, kinds, mode, device, buffer_device, host_staging)
        config: dict = {"kv_buffer_device": buffer_device}
        if mode != "pull":
            config["extra"] = {"transfer_mode": mode}
        node = self._cache.pop(key, None) or self._build(
            role, fmt, kinds, config, device=device, host_staging=host_staging
        )
        self._cache[key] = node
        while len(self._cache) > self._keep:
            _, old = self._cache.popitem(last=False)
            old.worker.shutdown()
        return node

    def new_node(
        self,
        role: str,
        fmt: SideFormat,
        kinds: str,
        *,
        engine_factory: Callable[[str], TransferEngine] | None = None,
        device: str = "cpu",
        host_staging: bool | None = None,
        **config,
    ) -> Node:
        """A worker of its own (not shared); ``config`` overrides KVTransferConfig fields,
        ``engine_factory`` builds its transfer engine from the agent name; ``device`` and
        ``host_staging`` as for :meth:`node`."""
        node = self._build(
            role,
            fmt,
            kinds,
            config,
            engine_factory=engine_factory,
            device=device,
            host_staging=host_staging,
        )
        self._extra.append(node)
        return node

    def _build(
        self,
        role: str,
        fmt: SideFormat,
        kinds: str,
        config: dict,
        *,
        device: str = "cpu",
        host_staging: bool | None = None,
        engine_factory: Callable[[str], TransferEngine] | None = None,
    ) -> Node:
        engine_id = new_id("P" if role == "kv_producer" else "D")
        worker = KVBridgeWorker(
            transfer_config(role, engine_id, **config),
            MODEL,
            host_staging=host_staging,
            engine_factory=engine_factory,
        )
        buffers = make_buffers(fmt, kinds, device=device)
        try:
            if fmt.block_packing:
                worker.set_repacker(HndRepacker(buffers))
            worker.register_kv_caches(buffers)
        except BaseException:
            worker.shutdown()
            raise
        return Node(worker=worker, buffers=buffers, engine_id=engine_id, kinds=kinds)

    def pump(
        self,
        nodes: list[Node],
        until: Callable[[], bool],
        what: str,
        timeout_s: float = PUMP_TIMEOUT_S,
    ) -> float:
        """Drive ``nodes`` until ``until()``; returns the seconds it took."""
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            for node in nodes:
                node.collect()
            if until():
                return time.monotonic() - start
            time.sleep(0)  # between steps an engine lets go of the GIL (pair_harness.run_until)
            if time.monotonic() > deadline:
                seen = {
                    n.engine_id: {
                        "sent": sorted(n.sent),
                        "loaded": sorted(n.loaded),
                        "failed": {k: v.reason for k, v in n.failed.items()},
                    }
                    for n in nodes
                }
                raise AssertionError(f"no {what} within {timeout_s} s; seen: {seen}")

    def transfer(self, prefill: Node, decode: Node, req: Request) -> None:
        """Send (prefill), load (decode), pump both until the load and the send finished."""
        prefill.send(req.send_id, req.remote_ids, req.remote_first)
        decode.load(req.spec(prefill))
        self.pump(
            [prefill, decode],
            lambda: (
                req.load_id in decode.failed
                or (req.load_id in decode.loaded and req.send_id in prefill.sent)
            ),
            f"load {req.load_id} on decode and send {req.send_id} finished on prefill",
        )
        failure = decode.failed.get(req.load_id)
        assert failure is None, f"load failed: {failure.reason}"

    def close(self) -> None:
        nodes = list(self._cache.values()) + self._extra
        self._cache.clear()
        self._extra.clear()
        for node in nodes:
            node.worker.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A port that refuses connections (bound by the test, never listened on)."""
    with held_dead_port() as port:
        yield port
