"""Staging slots (connector/worker/staging/arenas.py) on a real NIXL agent: leases, slot sizes
sharing one arena, and the descriptor rows a read (or a pushing writer) lands in
(``extra.staging_mib`` itself: tests/connector/test_config_decoder.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvbridge.connector.transfer.nixl_engine import NixlEngineConfig, NixlTransferEngine
from kvbridge.connector.worker.staging.arenas import (
    StagingPools,
    slot_offsets,
    slot_region,
)
from kvbridge.layouts.descriptors import block_descriptors
from kvbridge.layouts.errors import KVBridgeError


@pytest.fixture
def engine() -> Iterator[NixlTransferEngine]:
    e = NixlTransferEngine(NixlEngineConfig(agent_name=f"stage-{uuid.uuid4().hex[:8]}"))
    try:
        yield e
    finally:
        e.close()


def test_slots_are_leased_until_given_back(engine):
    pool = StagingPools(engine, capacity_bytes=3500).pool(1000)
    assert pool.num_slots == 3
    first = pool.lease(2)
    assert first.tolist() == [0, 1]
    assert pool.lease(5).tolist() == [2]  # only what is free
    assert pool.lease(1).size == 0
    pool.give_back(first)
    assert pool.num_free == 2
    with pytest.raises(KVBridgeError, match="slot 0 given back but it was not leased"):
        pool.give_back(np.array([0]))
    with pytest.raises(KVBridgeError, match="slot 2 given back but it was not leased"):
        pool.give_back(np.array([2, 2]))  # twice in one call


def test_local_list_rows_address_one_piece_of_each_slot(engine):
    pools = StagingPools(engine, capacity_bytes=96 * 4)
    pool = pools.pool(96)
    dl = pool.local_list(32, 64)
    assert dl.num_descs == 4 and dl.lens.tolist() == [64] * 4
    assert pool.local_list(32, 64) is dl  # prepared once
    with pytest.raises(KVBridgeError, match=r"outside a 96 B slot"):
        pool.local_list(64, 64)
    # a pushing writer addresses the same bytes from the advertised arena alone
    region = pools.region
    assert region is not None and region.block_bytes == 96 * 4
    theirs = block_descriptors(
        slot_region(region, 96), np.arange(4), offsets=np.array([32]), length=64
    )
    assert np.array_equal(theirs, dl.table)
    slots = pool._slots
    slots.copy_(torch.arange(4 * 96, dtype=torch.int64).view(4, 96).to(torch.uint8))
    got = pool.pages(np.array([2, 0]), 32, 64)
    assert torch.equal(got, slots[[2, 0], 32:96])


def test_a_pool_smaller_than_one_slot_is_an_error_naming_the_knob(engine):
    pools = StagingPools(engine, capacity_bytes=100)
    with pytest.raises(KVBridgeError, match=r"needs 4096 B .* raise extra.staging_mib"):
        pools.pool(4096)
    assert pools.pool(50) is pools.pool(50)


def test_slot_sizes_share_one_arena_byte_for_byte(engine):
    """Slots of two sizes overlap in the arena: a leased slot of one size keeps every slot
    of the other size that touches one of its bytes out of reach, until it comes back."""
    pools = StagingPools(engine, capacity_bytes=6 * 96)
    small, large = pools.pool(96), pools.pool(144)  # 6 and 4 slots over the same bytes
    assert (small.num_slots, large.num_slots) == (6, 4)
    region = pools.open()
    assert pools.open() == region  # registered once
    held = small.lease(1)  # bytes [0, 96): large slot 0 ([0, 144)) is out of reach
    assert held.tolist() == [0] and large.num_free == 3
    got = large.lease(4)
    assert got.tolist() == [1, 2, 3]  # bytes [144, 576): small slots 1..5 all touched
    assert small.num_free == 0 and small.lease(1).size == 0
    large.give_back(np.array([2]))  # bytes [288, 432): small slot 3 ([288, 384)) is free,
    assert small.lease(6).tolist() == [3]  # slot 4 ([384, 480)) reaches into large slot 3
    assert pools.num_leased_bytes == 2 * 96 + 2 * 144
    small.give_back(np.array([0, 3]))
    large.give_back(np.array([1, 3]))
    assert pools.num_leased_bytes == 0 and large.num_free == 4 and small.num_free == 6


def test_slot_offsets_put_a_plans_streams_back_to_back():
    from kvbridge.handshake.plan_model import GroupPlan, PieceStream
    from kvbridge.layouts.specs import KVCacheKind

    def stream(chunk: int, offset: int = 0) -> PieceStream:
        return PieceStream(
            local_region=0,
            remote_region=0,
            local_offsets=(offset,),
            remote_offsets=(0,),
            length=chunk - offset,
            local_chunk_bytes=chunk,
            remote_chunk_bytes=chunk,
        )

    g = GroupPlan(
        group_id=0,
        kind=KVCacheKind.FULL_ATTENTION,
        wire_tokens=128,
        local_chunks_per_block=1,
        remote_chunks_per_block=1,
        sender=None,
        receiver=None,
        streams=(stream(256), stream(512), stream(128)),
        split_from=128,
    )
    assert slot_offsets(g) == (0, 256, 768)
    assert g.staging_bytes == 896
