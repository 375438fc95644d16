"""Staging slots (connector/staging.py) on a real NIXL agent: leases, the descriptor
rows a read lands in, and the config knob."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from connector.config import ConfigError
from connector.nixl_engine import NixlEngineConfig, NixlTransferEngine
from connector.staging import DEFAULT_STAGING_MIB, StagingPool, StagingPools, staging_capacity
from layouts.errors import KVBridgeError


@pytest.fixture
def engine() -> Iterator[NixlTransferEngine]:
    e = NixlTransferEngine(NixlEngineConfig(agent_name=f"stage-{uuid.uuid4().hex[:8]}"))
    try:
        yield e
    finally:
        e.close()


def test_slots_are_leased_until_given_back(engine):
    pool = StagingPool(engine, slot_bytes=1000, capacity_bytes=3500)
    assert pool.num_slots == 3
    first = pool.lease(2)
    assert first.tolist() == [0, 1]
    assert pool.lease(5).tolist() == [2]  # only what is free
    assert pool.lease(1).size == 0
    pool.give_back(first)
    assert pool.num_free == 2
    with pytest.raises(KVBridgeError, match="slot 0 given back but it was not leased"):
        pool.give_back(np.array([0]))


def test_local_list_rows_address_one_piece_of_each_slot(engine):
    pool = StagingPool(engine, slot_bytes=96, capacity_bytes=96 * 4)
    dl = pool.local_list(32, 64)
    assert dl.num_descs == 4 and dl.lens.tolist() == [64] * 4
    assert pool.local_list(32, 64) is dl  # prepared once
    with pytest.raises(KVBridgeError, match=r"outside a 96 B slot"):
        pool.local_list(64, 64)
    pool._buf.copy_(torch.arange(4 * 96, dtype=torch.int64).view(4, 96).to(torch.uint8))
    got = pool.pages(np.array([2, 0]), 32, 64)
    assert torch.equal(got, pool._buf[[2, 0], 32:96])


def test_a_pool_smaller_than_one_slot_is_an_error_naming_the_knob(engine):
    pools = StagingPools(engine, capacity_bytes=100)
    with pytest.raises(KVBridgeError, match=r"needs 4096 B .* raise extra.staging_mib"):
        pools.pool(4096)
    assert pools.pool(50) is pools.pool(50)


@pytest.mark.parametrize("bad", [0, -1, "64", True])
def test_staging_mib_must_be_a_positive_number(bad):
    with pytest.raises(ConfigError, match=r"extra\.staging_mib"):
        staging_capacity({"staging_mib": bad})


def test_staging_mib_defaults_and_fractions():
    assert staging_capacity({}) == DEFAULT_STAGING_MIB << 20
    assert staging_capacity({"staging_mib": 0.5}) == 1 << 19
