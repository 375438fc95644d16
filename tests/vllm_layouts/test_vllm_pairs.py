"""Pairs of vLLM GPU workers that picked different layouts, moving KV byte for byte.

Prefill runs in its own OS process(es) (one per TP rank), decode in the test process;
both hold what vLLM's own allocation code builds for their backend, layout and block
size, registered through the adapter's ``register_kv_caches``; real NIXL moves the
bytes, pull (decode READs) or push (prefill WRITEs). Every token's K|V of every head
on decode, read through vLLM's own per-layer views, must equal prefill's.

CI runs a representative matrix (:data:`PAIRS`); ``KVBRIDGE_VLLM_LAYOUT_MATRIX=1``
adds every pair of (layout, block size) for FlashAttention, pull and push
(:data:`WIDE_PAIRS`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

import numpy as np
import pytest

from kvbridge.connector.common.metadata import ConnectorMetadata, LoadSpec
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.examples.vllm.allocation import Allocation
from kvbridge.examples.vllm.layout_peer import (
    NUM_BLOCKS,
    TOTAL_HEADS,
    SideSpec,
    bind,
    build_allocation,
    fill,
    states,
    tokens,
    worker_side,
)
from kvbridge.examples.vllm.prefill_host import EVENT_TIMEOUT_S, PrefillHost
from kvbridge.handshake import tp
from tests.connector.conftest import new_id

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

TOKENS = 120  # not a multiple of any block size: the last block is partial

FA, TRITON, AITER, ROCM = "FLASH_ATTN", "TRITON_ATTN", "ROCM_AITER_FA", "ROCM_ATTN"

# (prefill, decode, mode): layouts, backends, block sizes (kernel blocks), TP sizes, MLA,
# fp8 differ between the two sides. Token-major (NHD) <-> head-major (HND, BHLNC) pairs
# move one (token, head) piece per descriptor: kvbridge reads pieces of 512 B and more
# only, so those pairs use head size 128 (a real model's; 16 keeps the others small).
H128 = 128
PAIRS = [
    (SideSpec(FA, "LBNHC", 16, head_size=H128), SideSpec(FA, "BHLNC", 32, head_size=H128), "pull"),
    (SideSpec(FA, "BHLNC", 32), SideSpec(TRITON, "LBHNC", 16), "push"),
    (
        SideSpec(AITER, "LBHNC", 64, head_size=H128),
        SideSpec(FA, "BLNHC", 64, head_size=H128),
        "pull",
    ),  # aiter: kernel blocks of 32
    (SideSpec(FA, "BHLNC", 16, tp_size=2), SideSpec(FA, "BHLNC", 16), "pull"),
    (SideSpec(FA, "BLHNC", 16), SideSpec(FA, "BHLNC", 16, tp_size=2), "push"),
    (
        SideSpec("FLASHMLA", "LBHNC", 128, mla=True),
        SideSpec("TRITON_MLA", "BLHNC", 64, mla=True),
        "pull",
    ),
    (
        SideSpec(FA, "BHLNC", 32, dtype="float8_e4m3fn"),
        SideSpec(FA, "LBHNC", 16, dtype="float8_e4m3fn"),
        "push",
    ),
    # LHBNC (ROCm's pick): each (layer, head) of a block is a run of its own on that side
    (SideSpec(ROCM, "LHBNC", 64), SideSpec(FA, "LBHNC", 16), "pull"),
    (SideSpec(FA, "BHLNC", 32), SideSpec(ROCM, "LHBNC", 16), "push"),
    (SideSpec(FA, "LHBNC", 16), SideSpec(TRITON, "LHBNC", 64), "pull"),
    (SideSpec(AITER, "LHBNC", 32, tp_size=2), SideSpec(FA, "LHBNC", 16), "push"),
    (
        SideSpec(FA, "LBNHC", 32, head_size=H128),
        SideSpec(ROCM, "LHBNC", 16, head_size=H128, tp_size=2),
        "pull",
    ),
    # Mamba2 hybrid (attention group 0, state group 1; vLLM overlays the groups' layers):
    # one state block moves beside the attention blocks
    (
        SideSpec(FA, "LBHNC", 64, num_layers=2, mamba_layers=2),
        SideSpec(TRITON, "LBHNC", 128, num_layers=2, mamba_layers=2),
        "pull",
    ),
    (
        SideSpec(FA, "LBNHC", 128, num_layers=2, mamba_layers=2),
        SideSpec(FA, "LBNHC", 64, num_layers=2, mamba_layers=2),
        "push",
    ),
]
_LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC", "LHBNC")
WIDE_PAIRS = [
    (SideSpec(FA, pl, pb, head_size=H128), SideSpec(FA, dl, db, head_size=H128), mode)
    for pl, dl in itertools.product(_LAYOUTS, repeat=2)
    for pb, db in [(16, 64), (64, 16), (32, 32)]
    for mode in ("pull", "push")
]
MATRIX = PAIRS + (WIDE_PAIRS if os.environ.get("KVBRIDGE_VLLM_LAYOUT_MATRIX") == "1" else [])


@dataclass
class PrefillRank:
    key: str
    port: int
    replica: Allocation

    def sent(self, host: PrefillHost, rid: str) -> bool:
        return rid in host.sent.get(self.key, set())


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillHost]:
    h = PrefillHost(tmp_path_factory.mktemp("vllm-prefill") / "prefill.log")
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def ranks(host: PrefillHost) -> Iterator:
    opened: list[PrefillRank] = []
    decodes: list = []

    def start(spec: SideSpec, mode: str) -> tuple[str, list[PrefillRank]]:
        engine_id = new_id("P")
        out = []
        for r in range(spec.tp_size):
            rank_spec = replace(spec, rank=r)
            key = f"{engine_id}-r{r}"
            port = host.open_rank(key, asdict(rank_spec), engine_id, mode, seed=1000 + r)
            replica = build_allocation(rank_spec)
            fill(replica, 1000 + r)
            out.append(PrefillRank(key, port, replica))
            opened.append(out[-1])
        return engine_id, out

    try:
        yield host, start, decodes
    finally:
        for d in decodes:
            d.shutdown()
        for p in opened:
            host.close_rank(p.key)


def _label(case: tuple[SideSpec, SideSpec, str]) -> str:
    p, d, mode = case
    return f"{p.label()}-{p.dtype[:5]}-to-{d.label()}-{mode}"


@pytest.mark.parametrize("case", MATRIX, ids=[_label(c) for c in MATRIX])
def test_pair_moves_every_token_byte_for_byte(ranks, case) -> None:
    host, start, decodes = ranks
    pspec, dspec, mode = case
    engine_id, prefill = start(pspec, mode)
    rng = np.random.default_rng(7)
    shuffled = rng.permutation(np.arange(1, NUM_BLOCKS))
    remote = shuffled[: -(-TOKENS // pspec.block_size)]
    # a state group keeps the state after the last loaded token, in a block of its own
    # (the groups share one pool: never one of the attention blocks)
    hybrid = bool(pspec.mamba_layers)
    remote_state = int(shuffled[len(remote)])
    block_ids, first_block = [remote.tolist()], [0]
    if hybrid:
        block_ids.append([remote_state])
        first_block.append((TOKENS - 1) // pspec.block_size)
    rid = new_id("req")
    for p in prefill:
        host.send(p.key, rid, block_ids, first_block)
    d_allocs, d_sides = [], []
    for r in range(dspec.tp_size):
        spec = replace(dspec, rank=r)
        a = build_allocation(spec)
        fill(a, 5 + r)  # stale bytes the load must overwrite
        side = worker_side(spec, a, "kv_consumer", new_id("D"), mode)
        decodes.append(side)
        d_allocs.append(a)
        d_sides.append(side)
    shuffled = rng.permutation(np.arange(1, NUM_BLOCKS))
    local = shuffled[: -(-TOKENS // dspec.block_size)]
    local_state = int(shuffled[len(local)])
    local_ids = (tuple(int(b) for b in local),)
    if hybrid:  # decode's state block at the position of the last loaded token
        local_ids += ((local_state,) * len(local),)
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=engine_id,
        remote_host="127.0.0.1",
        remote_port=prefill[0].port,
        remote_ports=[p.port for p in prefill],
        remote_rank=0,
        remote_tp_size=pspec.tp_size,
        remote_block_ids=block_ids,
        remote_first_block=first_block,
        remote_block_size=pspec.block_size,
        num_tokens=TOKENS,
        remote_request_id=rid,
    )
    load = LoadSpec(
        request_id=new_id("load"),
        params=params,
        local_block_ids=local_ids,
        start_token=0,
        end_token=TOKENS,
    )
    for side in d_sides:
        bind(side, ConnectorMetadata(reqs_to_load=(load,)))
    loaded: set[int] = set()
    failed: dict[int, set[str]] = {}
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while len(loaded) + len(failed) < len(d_sides) or not all(p.sent(host, rid) for p in prefill):
        if failed:
            break
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {EVENT_TIMEOUT_S} s waiting for every decode rank to load "
                f"and every prefill rank to free (loaded {loaded}, sent "
                f"{[p.sent(host, rid) for p in prefill]})"
            )
        for i, side in enumerate(d_sides):
            bind(side, ConnectorMetadata())
            _, recving, bad = side.transfer_results()
            if bad:
                failed[i] = bad
            elif load.request_id in recving:
                loaded.add(i)
        host.drain()
    assert not failed, (failed, [s.worker.get_finished() for s in d_sides])
    heads = 1 if pspec.mla else TOTAL_HEADS
    if (
        mode == "pull"
        and pspec.layout == dspec.layout == "BHLNC"
        and pspec.block_size <= dspec.block_size
    ):
        # head-outer on both sides: one descriptor per (prefill block, source rank), no
        # rewrite on the prefill side, at any TP ratio (a larger prefill block is read as
        # chunks of decode's size: one piece per (head, layer, chunk))
        for r, side in enumerate(d_sides):
            sources = tp.sources(r, dspec.tp_size, pspec.tp_size, heads)
            assert side.worker.metrics.descriptors_posted == len(remote) * len(sources)
    if mode == "pull" and "LHBNC" in (pspec.layout, dspec.layout) and not pspec.mla:
        # a heads-outer side: one descriptor per (layer, head, wire chunk) at most (runs of
        # consecutive blocks may join); per (layer, head, token) from a token-major
        # prefill, which may not rewrite its blocks (vLLM's prefix cache reads them)
        chunk = min(pspec.block_size, dspec.block_size)
        rows = chunk if pspec.layout in ("LBNHC", "BLNHC") else 1
        for side in d_sides:
            most = dspec.num_layers * (TOTAL_HEADS // dspec.tp_size) * -(-TOKENS // chunk)
            assert 0 < side.worker.metrics.descriptors_posted <= most * rows
    if hybrid:
        want_states = states(prefill[0].replica, remote_state)
        assert all(
            g.equal(w) for g, w in zip(states(d_allocs[0], local_state), want_states, strict=True)
        )
    for r, a in enumerate(d_allocs):
        got = tokens(a, local)[:, :TOKENS]
        slices = tp.sources(r, dspec.tp_size, pspec.tp_size, heads) if not pspec.mla else None
        if slices is None:
            want = tokens(prefill[0].replica, remote)[:, :TOKENS]
            assert got.equal(want)
            continue
        for s in slices:
            want = tokens(prefill[s.remote_rank].replica, remote)[:, :TOKENS]
            a_heads = got[:, :, s.local_head : s.local_head + s.num_heads]
            b_heads = want[:, :, s.remote_head : s.remote_head + s.num_heads]
            assert a_heads.equal(b_heads), (r, s)
