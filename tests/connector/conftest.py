"""Shared fixtures for worker-connector tests over real NIXL.

A :class:`Cluster` builds :class:`KVBridgeWorker` s (one NIXL agent each) for a given
cache format, keeps the most recently used ones for reuse across test cases (an agent
costs 10-400 ms to create), pumps them (each worker is driven only through
``get_finished``, as an engine step would) and shuts every one of them down at the end.

Every wait is a bounded loop: :meth:`Cluster.pump` fails the test with what it waited
for and what it saw when its deadline passes.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from connector.config import KVTransferConfig
from connector.metadata import ConnectorMetadata, LoadFailure, LoadSpec, SendSpec
from connector.params import KVTransferParams
from connector.worker import KVBridgeWorker, ModelInfo
from layouts.allocation import CacheFormat, KVCacheBuffers
from layouts.groups import KVCacheConfig
from layouts.layout import KVLayout, KVPacking
from tests.handshake.plan_harness import make_groups

MODEL = ModelInfo(model_name="m", dtype="float16", num_kv_heads=2, head_size=4)
NUM_BLOCKS = 64
PUMP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SideFormat:
    """One side's cache format; ``str()`` is a short test id such as ``x-NHD-k8``."""

    block_size: int
    layout: KVLayout = KVLayout.NHD
    cross_layer: bool = False
    packing: KVPacking = KVPacking.BLOCKS_FIRST
    kernel_block_size: int | None = None

    @property
    def cache_format(self) -> CacheFormat:
        return CacheFormat(
            layout=self.layout,
            kernel_block_size=self.kernel_block_size,
            cross_layer=self.cross_layer,
            packing=self.packing,
        )

    def __str__(self) -> str:
        alloc = "x" if self.cross_layer else ("ks" if self.packing is KVPacking.KV_SPLIT else "bf")
        kernel = f"-k{self.kernel_block_size}" if self.kernel_block_size else ""
        return f"b{self.block_size}-{alloc}-{self.layout.value}{kernel}"


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
    def block_size(self) -> int:
        return self.buffers.config.groups[0].spec.block_size

    def fill(self, seed: int) -> None:
        """Overwrite every cache byte with a seeded pattern (see :func:`fill_buffers`)."""
        fill_buffers(self.buffers, seed)

    def send(self, request_id: str, block_ids, first_block, *, lease_s: float = 30.0) -> None:
        """Prefill: keep ``block_ids`` (per group) for a reader, as an engine step would."""
        spec = SendSpec(
            request_id=request_id,
            block_ids=tuple(tuple(int(b) for b in ids) for ids in block_ids),
            first_block=tuple(first_block),
            lease_s=lease_s,
        )
        self.worker.bind_connector_metadata(ConnectorMetadata(reqs_to_send=(spec,)))
        self.worker.start_load_kv()

    def load(self, *specs: LoadSpec) -> None:
        self.worker.bind_connector_metadata(ConnectorMetadata(reqs_to_load=specs))
        self.worker.start_load_kv()

    def params_for(
        self, remote_request_id: str, block_ids, first_block, num_tokens: int
    ) -> KVTransferParams:
        """The ``kv_transfer_params`` this (prefill) node would hand to the proxy."""
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_host="127.0.0.1",
            remote_port=self.worker.side_channel_port,
            remote_block_ids=[[int(b) for b in ids] for ids in block_ids],
            remote_first_block=[int(f) for f in first_block],
            remote_block_size=self.block_size,
            num_tokens=num_tokens,
            remote_request_id=remote_request_id,
        )

    def collect(self) -> None:
        out = self.worker.get_finished()
        self.sent |= out.finished_sending
        self.loaded |= out.finished_recving
        self.expired |= out.expired_leases
        for failure in out.failed_loads:
            self.failed[failure.request_id] = failure


def fill_buffers(buffers: KVCacheBuffers, seed: int) -> None:
    """Seeded random bytes in every registered tensor, in order; a process that builds the
    same buffers and calls this with the same seed holds the same bytes."""
    gen = torch.Generator().manual_seed(seed)
    for t in buffers.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def make_buffers(fmt: SideFormat, kinds: str, num_blocks: int = NUM_BLOCKS) -> KVCacheBuffers:
    config = KVCacheConfig.uniform(make_groups(fmt.block_size, kinds), num_blocks)
    return KVCacheBuffers(config, fmt.cache_format)


def transfer_config(role: str, engine_id: str, **overrides) -> KVTransferConfig:
    raw = {"kv_role": role, "engine_id": engine_id, "kv_port": 0, **overrides}
    return KVTransferConfig.from_dict(raw)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Cluster:
    """Workers of one test module; the ``keep`` most recently used ones stay alive."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._cache: OrderedDict[tuple, Node] = OrderedDict()
        self._extra: list[Node] = []

    def node(self, role: str, fmt: SideFormat, kinds: str) -> Node:
        """A cached worker for (role, format, groups), built on first use."""
        key = (role, fmt, kinds)
        node = self._cache.pop(key, None)
        if node is None:
            node = self.new_node(role, fmt, kinds, cached=True)
        self._cache[key] = node
        while len(self._cache) > self._keep:
            _, old = self._cache.popitem(last=False)
            old.worker.shutdown()
        return node

    def new_node(
        self, role: str, fmt: SideFormat, kinds: str, *, cached: bool = False, **config
    ) -> Node:
        """A fresh worker (shut down with the cluster); ``config`` overrides the defaults."""
        engine_id = new_id("P" if role == "kv_producer" else "D")
        worker = KVBridgeWorker(transfer_config(role, engine_id, **config), MODEL)
        buffers = make_buffers(fmt, kinds)
        node = Node(worker=worker, buffers=buffers, engine_id=engine_id, kinds=kinds)
        if not cached:
            self._extra.append(node)
        try:
            worker.register_kv_caches(buffers)
        except BaseException:
            worker.shutdown()
            raise
        return node

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


def free_port() -> int:
    """A TCP port nothing listens on right now (bound, read and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_port() -> int:
    return free_port()


def block_ids_for(rng: np.random.Generator, count: int, exclude=()) -> np.ndarray:
    """``count`` distinct block ids of the pool, none in ``exclude``."""
    pool = np.setdiff1d(np.arange(NUM_BLOCKS), np.asarray(list(exclude), dtype=np.int64))
    return rng.permutation(pool)[:count]
