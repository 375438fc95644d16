"""The example engine's block pool: allocation, refcounts, typed misuse errors, prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.examples.block_pool import (
    BlockLeakError,
    BlockPool,
    BlockPoolError,
    DoubleFreeError,
    ForeignBlockError,
    PoolExhaustedError,
    block_hashes,
    local_prefix_hit,
)
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.specs import FullAttentionSpec, SlidingWindowSpec, StateSpec


def test_allocate_and_free_round_trip() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert (pool.num_free, pool.num_used) == (5, 3)
    assert [pool.refcount(b) for b in ids] == [1, 1, 1]
    pool.free(ids)
    assert pool.num_free == 8
    pool.assert_all_free()


def test_freed_blocks_are_reused_least_recent_first() -> None:
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.free([a[2]])
    pool.free([a[0], a[1]])  # appended tail first: 1, then 0
    assert pool.allocate(3) == [2, 1, 0]


def test_exhaustion_is_typed_and_leaves_the_pool_alone() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    assert not pool.can_allocate(2)
    with pytest.raises(PoolExhaustedError, match=r"allocate\(2\): only 1 of 2"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_names_the_block_and_changes_nothing() -> None:
    pool = BlockPool(6)
    ids = pool.allocate(3)
    pool.free([ids[1]])
    with pytest.raises(DoubleFreeError, match=r"blocks \[1\]"):
        pool.free([ids[0], ids[1]])
    assert pool.refcount(ids[0]) == 1  # all or nothing
    with pytest.raises(DoubleFreeError, match=r"blocks \[2\]"):
        pool.free([ids[2], ids[2]])  # twice in one call
    assert pool.refcount(ids[2]) == 1


@pytest.mark.parametrize("bad", [-1, 6, 100])
def test_foreign_ids_are_rejected(bad: int) -> None:
    pool = BlockPool(6)
    pool.allocate(2)
    with pytest.raises(ForeignBlockError, match=rf"\[{bad}\]"):
        pool.free([0, bad])
    assert pool.refcount(0) == 1
    with pytest.raises(ForeignBlockError):
        pool.ref([bad])


def test_refcounts_share_blocks_until_the_last_free() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.ref(ids)
    pool.free(ids)
    assert pool.num_free == 2 and pool.refcount(ids[0]) == 1
    pool.free(np.array(ids))
    pool.assert_all_free()


def test_leak_report_names_ids_and_refcounts() -> None:
    pool = BlockPool(10)
    ids = pool.allocate(5)
    pool.ref([ids[3]])
    pool.free(ids[:3])
    with pytest.raises(
        BlockLeakError,
        match=r"2 of 10 blocks still referenced: ids \[3, 4\], "
        r"refcounts \[2, 1\]",
    ):
        pool.assert_all_free()


def test_block_hashes_chain_over_the_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = block_hashes([1, 2, 3, 9, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3  # partial trailing block has no hash
    assert a[0] == b[0]
    assert a[1] != b[1]
    assert a[2] != b[2]  # same tokens 5, 6 but a different prefix
    assert block_hashes([5, 6], 2)[0] != a[2]


def test_prefix_cache_survives_free_until_evicted() -> None:
    pool = BlockPool(3)
    hashes = block_hashes(range(8), 4)
    ids = pool.allocate(2)
    pool.cache(0, hashes, ids)
    assert pool.lookup(0, hashes).tolist() == [True, True]
    assert pool.lookup(1, hashes).tolist() == [False, False]  # per group
    pool.free(ids)
    assert pool.cached_block_ids(0, hashes) == ids
    pool.ref([ids[0]])  # revive a cached free block
    assert pool.num_free == 2
    fresh = pool.allocate(2)  # takes the free blank block, then evicts ids[1]
    assert ids[1] in fresh and ids[0] not in fresh
    assert pool.lookup(0, hashes).tolist() == [True, False]
    pool.free([*fresh, ids[0]])
    pool.assert_all_free()


def test_ref_of_a_blank_free_block_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError, match=r"blocks \[1\] are free and hold no cached prefix"):
        pool.ref([1])


def test_cache_needs_in_use_blocks() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError, match="not in use"):
        pool.cache(0, block_hashes([1, 2], 2), [0])


def _hybrid_config(block_size: int = 4, window: int = 8) -> KVCacheConfig:
    attn = dict(block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float32)
    groups = [
        KVCacheGroup(group_id=0, layer_names=("l0",), spec=FullAttentionSpec(**attn)),
        KVCacheGroup(
            group_id=1, layer_names=("l1",), spec=SlidingWindowSpec(**attn, sliding_window=window)
        ),
        KVCacheGroup(
            group_id=2,
            layer_names=("l2",),
            spec=StateSpec(block_size=block_size, shapes=((2,),), dtypes=(torch.float32,)),
        ),
    ]
    return KVCacheConfig.uniform(groups, num_blocks=64)


def test_local_prefix_hit_meets_every_group() -> None:
    config = _hybrid_config()
    pool = BlockPool(64)
    prompt = list(range(100, 125))  # 25 tokens, 6 full blocks of 4
    hashes = block_hashes(prompt, 4)
    full = pool.allocate(6)
    pool.cache(0, hashes, full)
    window = pool.allocate(6)
    pool.cache(1, hashes, window)
    states = pool.allocate(2)  # only the states after 8 and 16 tokens
    pool.cache(2, [hashes[1], hashes[3]], states)
    hit = local_prefix_hit(pool, config, prompt)
    assert hit.num_tokens == 16
    assert hit.num_blocks_per_group == (4, 4, 4)
    pool.free(full + window + states)
    assert local_prefix_hit(pool, config, prompt).num_tokens == 16  # cached while free
    pool.assert_all_free()


def test_local_prefix_hit_leaves_the_last_token_to_compute() -> None:
    config = _hybrid_config()
    pool = BlockPool(64)
    prompt = list(range(16))
    hashes = block_hashes(prompt, 4)
    for g in range(3):
        pool.cache(g, hashes, pool.allocate(4))
    assert local_prefix_hit(pool, config, prompt).num_tokens == 12
    assert local_prefix_hit(pool, config, [*prompt, 99]).num_tokens == 16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60))
def test_random_alloc_free_keeps_counts_consistent(ops: list[tuple[bool, int]]) -> None:
    pool = BlockPool(16)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc and pool.can_allocate(n):
            held += pool.allocate(n)
        elif held:
            n = min(n, len(held))
            pool.free(held[:n])
            held = held[n:]
        assert pool.num_used == len(held) == len(set(held))
    pool.free(held)
    pool.assert_all_free()
    assert pool.num_free == 16
