"""Data path of two KVBridgeWorkers in one process (two real NIXL agents).

Each case: prefill keeps a request's blocks (SendSpec), decode loads them (LoadSpec),
both are pumped through ``get_finished`` until decode reports the load and prefill the
send. Then:

* decode's blocks, read back token-major, equal prefill's ORIGINAL bytes for the tokens
  moved (full attention: ``[start, end)``; sliding window: ``[end - window, end)``; state:
  the state block at ``end``);
* blocks decode did not load are untouched (its prefix hit and every other block);
* prefill's memory is byte-exact again after ``Done`` (the sender's rewrite is undone).
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, replace

import msgspec
import numpy as np
import pytest
import torch

from kvbridge.connector.transfer.nixl_engine import MergeRuns, NixlEngineConfig, NixlTransferEngine
from kvbridge.handshake.client import ClientConfig
from kvbridge.layouts.allocation import read_group_token_major
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import KVCacheKind
from tests.connector.conftest import (
    NUM_BLOCKS,
    Cluster,
    Node,
    Request,
    SideFormat,
    assert_restored,
    block_ids_for,
    check_loaded,
    expectations,
    moved_range,
    new_id,
    plan_request,
    snapshot,
)
from tests.connector.packed_engine import ENGINE_ORDER

NHD, HND = KVLayout.NHD, KVLayout.HND
SPLIT, FIRST = KVPacking.KV_SPLIT, KVPacking.BLOCKS_FIRST


def fmt(code: str, block_size: int) -> SideFormat:
    """``"x-NHD-k8"``: x cross-layer, ks per-layer kv_split, bf per-layer blocks_first."""
    alloc, layout, *kernel = code.split("-")
    return SideFormat(
        block_size=block_size,
        layout=KVLayout(layout),
        cross_layer=alloc == "x",
        packing=SPLIT if alloc == "ks" else FIRST,
        kernel_block_size=int(kernel[0][1:]) if kernel else None,
    )


# (prefill, decode) formats; together they cover NHD/HND, cross-layer on/off and both
# per-layer packings on either side, kernel blocks of 8 on either or both sides.
FORMAT_PAIRS = [
    ("x-NHD", "x-NHD"),
    ("x-NHD", "x-HND-k8"),
    ("x-HND", "bf-NHD"),
    ("ks-NHD", "x-HND-k8"),
    ("bf-HND-k8", "ks-NHD-k8"),
    ("ks-NHD", "ks-HND"),
    ("x-NHD-k8", "x-NHD-k8"),
    ("bf-NHD", "bf-HND-k8"),
    ("ks-HND-k8", "bf-HND"),
    ("x-HND-k8", "ks-NHD"),
]
LEASE_S = 4.0  # a short lease for the tests that wait for it to pass

BLOCK_PAIRS = [(16, 16), (16, 64), (64, 16), (64, 64)]
KINDS = ["FSM", "FS", "F"]


@dataclass(frozen=True)
class Case:
    prefill: SideFormat
    decode: SideFormat
    kinds: str
    start: int  # tokens decode already holds (prefix hit)
    end: int

    def __str__(self) -> str:
        return f"P[{self.prefill}]-D[{self.decode}]-{self.kinds}-{self.start}:{self.end}"


def _cases() -> list[Case]:
    out = []
    for i, ((pb, db), (pf, df)) in enumerate(itertools.product(BLOCK_PAIRS, FORMAT_PAIRS)):
        kinds = KINDS[i % 3]
        start = 64 if i % 4 == 3 else 0  # a prefix hit aligned to both block sizes
        end = 200 if ("M" not in kinds and i % 2) else 256  # states need aligned ends
        out.append(Case(fmt(pf, pb), fmt(df, db), kinds, start, end))
    return out


def untouched_blocks(decode: Node, req: Request) -> dict[int, torch.Tensor]:
    """Decode's attention blocks outside this request (must not change)."""
    out = {}
    for group in decode.buffers.config.groups:
        if group.kind is KVCacheKind.STATE:
            continue
        others = np.setdiff1d(np.arange(NUM_BLOCKS), req.local_ids[group.group_id])
        out[group.group_id] = read_group_token_major(decode.buffers, group.group_id, others)
    return out


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", _cases(), ids=str)
def test_load_matrix(cluster: Cluster, case: Case, mode: str) -> None:
    """Pull: decode READs. Push: prefill WRITEs into decode's blocks (decode posts
    nothing); the same bytes land either way."""
    _load_case(cluster, case, mode, Placement())


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", _cases()[::4], ids=str)
def test_host_staged_loads(cluster: Cluster, case: Case, mode: str) -> None:
    """Both sides move a host mirror of their cache (``kv_buffer_device: "cpu"`` with a
    CUDA cache; forced here for caches in host memory): the same bytes land, and the
    bytes copied to and from the mirrors are counted."""
    _load_case(cluster, case, mode, Placement(host_staging=True))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", _cases(), ids=str)
def test_load_matrix_cuda(cluster: Cluster, case: Case, mode: str) -> None:
    """The matrix with CUDA caches, NIXL moving VRAM."""
    _load_case(cluster, case, mode, Placement(device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", _cases()[::2], ids=str)
def test_load_matrix_cuda_host_staged(cluster: Cluster, case: Case, mode: str) -> None:
    """CUDA caches staged through pinned host mirrors (``kv_buffer_device: "cpu"``)."""
    _load_case(cluster, case, mode, Placement(device="cuda", buffer_device="cpu"))


@dataclass(frozen=True)
class Placement:
    """Where both sides' caches live and what NIXL moves."""

    device: str = "cpu"
    buffer_device: str = "auto"
    host_staging: bool | None = None

    @property
    def staged(self) -> bool:
        return bool(self.host_staging) or (self.device != "cpu" and self.buffer_device == "cpu")


def _load_case(cluster: Cluster, case: Case, mode: str, where: Placement) -> tuple[Node, Node]:
    placed = {
        "device": where.device,
        "buffer_device": where.buffer_device,
        "host_staging": where.host_staging,
    }
    prefill = cluster.node("kv_producer", case.prefill, case.kinds, mode, **placed)
    decode = cluster.node("kv_consumer", case.decode, case.kinds, mode, **placed)
    posted = decode.worker.metrics.descriptors_posted, prefill.worker.metrics.descriptors_posted
    written = prefill.worker.metrics.bytes_written
    staged = (
        prefill.worker.metrics.staged_to_host_bytes,
        decode.worker.metrics.staged_to_device_bytes,
    )
    seed = zlib.crc32(str(case).encode())
    prefill.fill(seed)
    decode.fill(seed + 1)
    rng = np.random.default_rng(seed)
    req = plan_request(prefill, decode, case.start, case.end, rng)
    _transfer_checked(cluster, prefill, decode, req)
    assert req.send_id not in prefill.expired
    # pull: decode posts READs and prefill nothing; push: prefill posts WRITEs, decode nothing
    (mover, before_m), (idle, before_i) = (
        ((decode, posted[0]), (prefill, posted[1]))
        if mode == "pull"
        else ((prefill, posted[1]), (decode, posted[0]))
    )
    assert mover.worker.metrics.descriptors_posted > before_m, f"{mode}: nothing posted"
    assert idle.worker.metrics.descriptors_posted == before_i, f"{mode}: the other side posted"
    pushed = prefill.worker.metrics.bytes_written - written
    assert (pushed > 0) == (mode == "push"), pushed
    to_host = prefill.worker.metrics.staged_to_host_bytes - staged[0]
    to_device = decode.worker.metrics.staged_to_device_bytes - staged[1]
    if where.staged:
        # every kept block goes out whole; every touched block comes in whole
        assert to_host >= _block_bytes(prefill, req.remote_ids), to_host
        assert to_device > 0 and to_device <= _block_bytes(decode, req.local_ids), to_device
    else:
        assert to_host == to_device == 0, (to_host, to_device)
    return prefill, decode


# -- engine-packed pages (block_packing): moved whole -------------------------------------


def packed(block_size: int) -> SideFormat:
    """Per-layer HND pages under an engine's packing name (tests/connector/packed_engine)."""
    return SideFormat(block_size=block_size, layout=HND, block_packing=ENGINE_ORDER)


# (prefill, decode) block sizes: equal; decode larger (pages side by side, merged); prefill
# larger or not dividing (whole pages through decode's staging slots, split), with decode
# prefix hits that end inside a prefill page
PACKED_CASES = [
    Case(packed(32), packed(32), "FS", 0, 200),
    Case(packed(32), packed(128), "F", 128, 250),
    Case(packed(128), packed(32), "FS", 0, 200),
    Case(packed(128), packed(32), "F", 64, 256),
    Case(packed(96), packed(128), "FS", 0, 250),
    Case(packed(128), packed(96), "F", 96, 256),
]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", PACKED_CASES, ids=str)
def test_engine_packed_pages(cluster: Cluster, case: Case, mode: str) -> None:
    """Whole pages, byte-exact either way: pull READs pages into decode's staging slots,
    push has prefill WRITE them there (decode's advertised arena), and decode's engine
    splits them into its blocks; one staging round per staged group here."""
    staged = case.decode.block_size % case.prefill.block_size != 0
    prefill = cluster.node("kv_producer", case.prefill, case.kinds, mode)
    decode = cluster.node("kv_consumer", case.decode, case.kinds, mode)
    rounds = decode.worker.metrics.staging_rounds
    pushes = prefill.worker.metrics.pushes_written

    _load_case(cluster, case, mode, Placement())

    num_rounds = decode.worker.metrics.staging_rounds - rounds
    assert num_rounds == (len(case.kinds) if staged else 0), num_rounds
    assert decode.worker.num_leased_staging_bytes == 0  # every slot came back
    if mode == "push":
        # one Push per load, unless it moved in rounds: every round after the first
        assert prefill.worker.metrics.pushes_written - pushes == max(1, num_rounds)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_engine_packed_pages_in_rounds(cluster: Cluster, mode: str) -> None:
    """A staging arena of 2.5 prefill pages: 128 -> 32 moves the full group's 4 pages two
    at a time, then the sliding window's page; the bytes land exactly, the slots return."""
    prefill = cluster.node("kv_producer", packed(128), "FS", mode)
    layers = prefill.buffers.config.groups[0].layer_names
    slot = sum(prefill.buffers.layer_bytes(n).shape[1] for n in layers)
    extra = {"transfer_mode": mode, "staging_mib": 2.5 * slot / (1 << 20)}
    decode = cluster.new_node("kv_consumer", packed(32), "FS", extra=extra)
    prefill.fill(41)
    decode.fill(42)
    req = plan_request(prefill, decode, 0, 500, np.random.default_rng(5))
    pushes = prefill.worker.metrics.pushes_written

    _transfer_checked(cluster, prefill, decode, req)

    assert decode.worker.metrics.staging_rounds == 3  # 2 + 2 full-group pages, 1 window
    assert decode.worker.num_leased_staging_bytes == 0
    assert prefill.worker.metrics.pushes_written - pushes == (3 if mode == "push" else 0)


def _transfer_checked(cluster: Cluster, prefill: Node, decode: Node, req: Request) -> None:
    """Move ``req``; decode's blocks hold prefill's bytes, no other decode block changed,
    and prefill's blocks are back in its own format after ``Done``."""
    want, prefill_before = expectations(prefill, decode, req), snapshot(prefill.buffers)
    others = untouched_blocks(decode, req)

    cluster.transfer(prefill, decode, req)

    check_loaded(prefill, decode, req, want)
    for g, tm in untouched_blocks(decode, req).items():
        assert torch.equal(tm, others[g]), f"group {g}: a block outside the request changed"
    assert_restored(prefill.buffers, prefill_before, "prefill after Done")


def _block_bytes(node: Node, ids_per_group: list[np.ndarray]) -> int:
    """Bytes of the given blocks, every group, every layer."""
    return sum(
        len(np.unique(ids)) * node.buffers.group_block_bytes(g)
        for g, ids in enumerate(ids_per_group)
    )


def _expected_descriptors(node: Node, req: Request, block_size: int) -> int:
    """Cross-layer on both sides, same block size and layout: one descriptor per block
    moved per attention group, one per layer for a state group."""
    total = 0
    for group in node.buffers.config.groups:
        if group.kind is KVCacheKind.STATE:
            total += group.num_layers
            continue
        lo, hi = moved_range(node, req, group.group_id)
        total += -(-hi // block_size) - lo // block_size
    return total


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("code", ["x-NHD", "x-HND-k8"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_cross_layer_one_descriptor_per_block(
    cluster: Cluster, block_size: int, code: str, kinds: str
) -> None:
    side = fmt(code, block_size)
    prefill = cluster.node("kv_producer", side, kinds)
    decode = cluster.node("kv_consumer", side, kinds)
    prefill.fill(7)
    decode.fill(8)
    req = plan_request(prefill, decode, 0, 256, np.random.default_rng(block_size))
    before, prefill_before = expectations(prefill, decode, req), snapshot(prefill.buffers)
    posted = decode.worker.metrics.descriptors_posted
    engine_posted = decode.worker._engine.num_descriptors_posted
    rewrites = prefill.worker.metrics.sender_rewrites, decode.worker.metrics.receiver_rewrites

    cluster.transfer(prefill, decode, req)

    want = _expected_descriptors(decode, req, block_size)
    assert decode.worker.metrics.descriptors_posted - posted == want
    assert decode.worker._engine.num_descriptors_posted - engine_posted == want
    assert (
        prefill.worker.metrics.sender_rewrites,
        decode.worker.metrics.receiver_rewrites,
    ) == rewrites, "identical formats must not rewrite anything"
    check_loaded(prefill, decode, req, before)
    assert_restored(prefill.buffers, prefill_before, "prefill after Done")


# -- prefix sharing on prefill -------------------------------------------------------------

SHARED_PAIRS = [
    (fmt("x-NHD", 64), fmt("x-HND-k8", 16)),  # split + permute on the sender
    (fmt("ks-NHD", 64), fmt("bf-HND", 16)),
]


@pytest.mark.parametrize(("pfmt", "dfmt"), SHARED_PAIRS, ids=str)
def test_shared_prefix_blocks_restored_and_reusable(
    cluster: Cluster, pfmt: SideFormat, dfmt: SideFormat
) -> None:
    """Two requests share their first prefill blocks (prefix caching) and are read at
    the same time: the shared blocks are rewritten once, restored after the LAST Done,
    and a third request that reuses the prefix afterwards reads exact bytes again."""
    prefill = cluster.node("kv_producer", pfmt, "F")
    decode = cluster.node("kv_consumer", dfmt, "F")
    prefill.fill(21)
    decode.fill(22)
    rng = np.random.default_rng(3)
    a = plan_request(prefill, decode, 0, 192, rng)
    b = plan_request(prefill, decode, 0, 256, rng, used=a.remote_ids[0])
    # b's first two prefill blocks are a's (shared prefix), the rest its own
    b.remote_ids[0][:2] = a.remote_ids[0][:2]
    b.local_ids[0] = block_ids_for(rng, b.local_ids[0].size, exclude=a.local_ids[0])
    original = snapshot(prefill.buffers)
    want_a, want_b = expectations(prefill, decode, a), expectations(prefill, decode, b)
    metrics = prefill.worker.metrics
    rewrites, restores = metrics.sender_rewrites, metrics.sender_restores
    loads = {a.load_id, b.load_id}

    prefill.send(a.send_id, a.remote_ids, a.remote_first)
    prefill.send(b.send_id, b.remote_ids, b.remote_first)
    decode.load(a.spec(prefill), b.spec(prefill))
    cluster.pump(
        [prefill, decode],
        lambda: bool(loads & decode.failed.keys()) or {a.send_id, b.send_id} <= prefill.sent,
        f"sends {a.send_id} and {b.send_id} finished on prefill",
    )
    failed = {k: v.reason for k, v in decode.failed.items() if k in loads}
    assert not failed, failed
    assert {a.load_id, b.load_id} <= decode.loaded
    check_loaded(prefill, decode, a, want_a)
    check_loaded(prefill, decode, b, want_b)
    assert_restored(prefill.buffers, original, "prefill after both Dones")
    # every distinct block was rewritten and restored exactly once, shared ones included
    distinct = np.unique(np.concatenate([a.remote_ids[0], b.remote_ids[0]])).size
    assert metrics.sender_rewrites - rewrites == distinct
    assert metrics.sender_restores - restores == distinct

    c = plan_request(prefill, decode, 0, 128, rng)
    c.remote_ids[0][:] = a.remote_ids[0][:2]  # a later request hitting the prefix
    decode.fill(23)
    want_c = expectations(prefill, decode, c)
    cluster.transfer(prefill, decode, c)
    check_loaded(prefill, decode, c, want_c)
    assert_restored(prefill.buffers, original, "prefill after the prefix-sharing request")


# -- errors ---------------------------------------------------------------------------------


def test_dead_port_fails_within_handshake_timeout(cluster: Cluster, dead_port: int) -> None:
    timeout_s = 0.3
    decode = cluster.new_node("kv_consumer", fmt("x-NHD", 16), "F", handshake_timeout_s=timeout_s)
    prefill = cluster.node("kv_producer", fmt("x-NHD", 64), "F")
    req = plan_request(prefill, decode, 0, 64, np.random.default_rng(0))
    spec = req.spec(prefill)
    bad = replace(spec, params=msgspec.structs.replace(spec.params, remote_port=dead_port))
    decode.load(bad)
    # the handshake client tries (retries + 1) times, timeout_s each, with backoff between
    bound = ClientConfig(timeout_s=timeout_s).max_wait_s + 1.0
    took = cluster.pump(
        [decode],
        lambda: req.load_id in decode.failed or req.load_id in decode.loaded,
        f"LoadFailure for {req.load_id} (dead port {dead_port})",
        timeout_s=bound,
    )
    failure = decode.failed[req.load_id]
    assert "handshake" in failure.reason and str(dead_port) in failure.reason, failure.reason
    assert failure.num_valid_tokens == 0
    assert failure.invalid_block_ids == bad.local_block_ids
    assert took < bound
    assert decode.worker.metrics.handshake_failures >= 1

    # the worker keeps serving: a load from a live prefill succeeds
    prefill.fill(5)
    good = plan_request(prefill, decode, 0, 64, np.random.default_rng(1))
    want = expectations(prefill, decode, good)
    cluster.transfer(prefill, decode, good)
    check_loaded(prefill, decode, good, want)


def test_unknown_remote_request_fails_load_then_serves(cluster: Cluster) -> None:
    """The plan needs a sender rewrite, so decode asks prefill to Prepare a request it
    never kept: once prefill's lease passed (the request might still have been on its way
    to prefill's worker, which waits for it as long as it could still be kept)
    Prepared(ok=False) becomes a LoadFailure that names the request."""
    prefill = cluster.new_node(
        "kv_producer", fmt("x-NHD", 64), "FS", lease_s=LEASE_S, heartbeat_s=1.0
    )
    decode = cluster.node("kv_consumer", fmt("x-HND-k8", 16), "FS")
    prefill.fill(11)
    decode.fill(12)
    rng = np.random.default_rng(4)
    req = plan_request(prefill, decode, 0, 128, rng)
    ghost = new_id("ghost")
    original = snapshot(prefill.buffers)
    decode.load(req.spec(prefill, remote_request_id=ghost))
    cluster.pump(
        [prefill, decode],
        lambda: req.load_id in decode.failed or req.load_id in decode.loaded,
        f"LoadFailure for {req.load_id}",
        timeout_s=LEASE_S + 10,
    )
    failure = decode.failed[req.load_id]
    assert ghost in failure.reason and "prepare" in failure.reason, failure.reason
    assert req.load_id not in decode.loaded
    assert failure.invalid_block_ids == tuple(tuple(int(b) for b in g) for g in req.local_ids)
    assert_restored(prefill.buffers, original, "prefill after refusing an unknown request")

    good = plan_request(prefill, decode, 0, 128, rng)
    want = expectations(prefill, decode, good)
    cluster.transfer(prefill, decode, good)
    check_loaded(prefill, decode, good, want)
    assert_restored(prefill.buffers, original, "prefill after Done")


# -- adjacent runs posted as one descriptor (MergeRuns.ON) ---------------------------------


def _merging_engine(agent_name: str) -> NixlTransferEngine:
    return NixlTransferEngine(NixlEngineConfig(agent_name=agent_name, merge=MergeRuns.ON))


def _fresh_request(prefill: Node, decode: Node, end: int) -> Request:
    """Block ids as fresh allocations hand them out: decode's all consecutive, prefill's in
    two consecutive runs (one jump half way)."""
    n = -(-end // decode.block_size)
    half = n // 2
    remote = np.concatenate([np.arange(3, 3 + half), np.arange(40, 40 + n - half)])
    return Request(
        send_id=new_id("send"),
        load_id=new_id("load"),
        remote_ids=[remote],
        remote_first=[0],
        local_ids=[np.arange(10, 10 + n)],
        start=0,
        end=end,
    )


def _move(cluster: Cluster, prefill: Node, decode: Node, mode: str) -> tuple[int, int, int]:
    """One fresh request, checked byte-exact against prefill's original bytes; returns the
    mover's (metrics descriptors_posted, engine descriptors, engine rows) of it."""
    mover = decode if mode == "pull" else prefill
    engine = mover.worker._engine
    assert engine is not None
    before = (
        mover.worker.metrics.descriptors_posted,
        engine.num_descriptors_posted,
        engine.num_rows_posted,
    )
    idle = (prefill if mode == "pull" else decode).worker.metrics.descriptors_posted
    prefill.fill(31)
    decode.fill(32)
    req = _fresh_request(prefill, decode, 256)
    _transfer_checked(cluster, prefill, decode, req)
    assert (prefill if mode == "pull" else decode).worker.metrics.descriptors_posted == idle
    after = (
        mover.worker.metrics.descriptors_posted,
        engine.num_descriptors_posted,
        engine.num_rows_posted,
    )
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    ("pcode", "dcode", "merges"),
    [
        ("bf-NHD", "bf-NHD", True),  # one (K, V) block per layer: blocks touch
        ("ks-HND", "ks-HND", True),  # K and V tensors per layer: blocks touch in each
        ("x-NHD", "bf-NHD", False),  # a layer's piece of a cross-layer block: gaps between
    ],
)
def test_per_layer_runs_move_as_one_descriptor_each(
    cluster: Cluster, pcode: str, dcode: str, merges: bool, mode: str
) -> None:
    """Consecutive blocks whose memory touches on both sides move as one descriptor per
    run and stream; the same request through a default (by index) pair posts one per
    block. Where one side's rows do not touch (consecutive ids notwithstanding) nothing
    merges. The bytes land exactly either way."""
    pfmt, dfmt = fmt(pcode, 16), fmt(dcode, 16)
    extra = {"extra": {"transfer_mode": mode}} if mode == "push" else {}
    by_index = _move(
        cluster,
        cluster.node("kv_producer", pfmt, "F", mode),
        cluster.node("kv_consumer", dfmt, "F", mode),
        mode,
    )
    merged = _move(
        cluster,
        cluster.new_node("kv_producer", pfmt, "F", engine_factory=_merging_engine, **extra),
        cluster.new_node("kv_consumer", dfmt, "F", engine_factory=_merging_engine, **extra),
        mode,
    )
    metric, descs, rows = by_index
    assert metric == descs == rows and rows % 16 == 0, by_index  # 16 blocks per stream
    num_streams = rows // 16
    if merges:
        # two runs (prefill's ids jump once) per stream, every row still counted
        assert merged == (2 * num_streams, 2 * num_streams, rows), (by_index, merged)
    else:
        assert merged == by_index, (by_index, merged)
