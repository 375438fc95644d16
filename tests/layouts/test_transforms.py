"""In-place rewrites (permute, split, merge) checked byte by byte against the naive
reference: data lands where the destination arrangement says, round trips are the
identity, bytes of other blocks and groups are never written, scratch stays within the
budget. Every put-back path runs here on CPU tensors, the GPU's batched one included."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import Arr, NaiveLayout, attention_cases, build_side, divisors, fill_random

from kvbridge.layouts import staging
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.arrangement import BlockArrangement, UnitGeometry, token_major
from kvbridge.layouts.errors import BlockIdError, LayoutError
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import FullAttentionSpec, SlidingWindowSpec, StateSpec
from kvbridge.layouts.staging import RewriteStrategy
from kvbridge.layouts.transforms import (
    chunked_arrangement,
    merge_blocks,
    permute_layout,
    rewrite_group,
    rewrite_units,
    split_blocks,
)

OTHER = {KVLayout.NHD: KVLayout.HND, KVLayout.HND: KVLayout.NHD}


PATHS = ("gather", "scatter", "batched")


@st.composite
def split_cases(draw):
    """An attention case plus a receiver block size, its kernel size and its layout."""
    case = draw(attention_cases())
    case["sub"] = draw(st.sampled_from(divisors(case["block_size"])))
    case["sub_kernel"] = draw(st.sampled_from(divisors(case["sub"])))
    case["to_layout"] = draw(st.sampled_from([KVLayout.NHD, KVLayout.HND]))
    return case


budgets = st.one_of(st.none(), st.integers(0, 4096))


@contextmanager
def _forced(path: str, budget: int | None = None) -> Iterator[dict]:
    """Force one put-back path whatever the unit size and device: the small-scratch
    strategy's row gather (big units) or batch scatter (small units), or the batched
    strategy GPUs use; yields the keywords to pass to a rewrite."""
    strategy = RewriteStrategy.BATCHED if path == "batched" else RewriteStrategy.SMALL_SCRATCH
    threshold = 0 if path == "gather" else 1 << 62
    with mock.patch.object(staging, "_ROW_GATHER_MIN_BYTES", threshold):
        yield {"strategy": strategy, "scratch_budget_bytes": budget}


def _other(path: str) -> str:
    return PATHS[(PATHS.index(path) + 1) % len(PATHS)]


def _native(case: dict) -> Arr:
    return Arr(1, case["kernel"], case["layout"].value)


def _chunked(case: dict) -> Arr:
    return Arr(case["block_size"] // case["sub"], case["sub_kernel"], case["to_layout"].value)


def _same_bytes(buffers, a: Arr, b: Arr) -> bool:
    ids = np.arange(buffers.config.num_blocks)
    ta, ba = NaiveLayout.element_bytes(buffers.config, buffers.format, 0, ids, a)
    tb, bb = NaiveLayout.element_bytes(buffers.config, buffers.format, 0, ids, b)
    return np.array_equal(ta, tb) and np.array_equal(ba, bb)


def _assert_only_blocks_changed(buffers, before: list[np.ndarray], group_id, ids, arr: Arr):
    masks = NaiveLayout.touched(buffers, group_id, ids, arr)
    for image, old, mask in zip(NaiveLayout.byte_images(buffers), before, masks, strict=True):
        np.testing.assert_array_equal(image[~mask], old[~mask], err_msg="stray write")


def _assert_stats(stats, buffers, case, same: bool, forced: dict, group_id: int = 0):
    n = len(case["block_ids"])
    block = buffers.group_block_bytes(group_id)
    assert stats.num_blocks == (0 if same else n)
    assert stats.bytes_moved == (0 if same else n * block)
    if same:
        assert stats.scratch_bytes == 0 and stats.strategy is None
        return
    assert stats.strategy is forced["strategy"]
    _assert_scratch(stats, buffers, group_id, n, forced["scratch_budget_bytes"])


def _assert_scratch(stats, buffers, group_id: int, n: int, budget: int | None):
    """Whole units, at least one, at most the budget when the budget holds one unit; by
    default one group block on the small-scratch path and 64 MiB on the batched one."""
    unit = buffers.unit_slots(group_id)[0].geometry.unit_bytes
    if budget is None:
        budget = stats.strategy.default_budget_bytes(buffers.group_block_bytes(group_id))
    assert stats.scratch_bytes == unit * max(1, min(n, budget // unit))
    if budget >= unit:
        assert stats.scratch_bytes <= budget
    else:
        assert stats.scratch_bytes == unit


@settings(max_examples=120, deadline=None)
@given(case=attention_cases(), path=st.sampled_from(PATHS), budget=budgets)
def test_permute_moves_every_element_and_round_trips(case, path, budget):
    buffers = build_side(case, seed=1)
    ids = np.array(case["block_ids"])
    before = NaiveLayout.byte_images(buffers)
    want = NaiveLayout.read(buffers, 0, ids, _native(case))
    to = OTHER[case["layout"]]
    dst = Arr(1, case["kernel"], to.value)

    with _forced(path, budget) as forced:
        stats = permute_layout(buffers, 0, ids, to, **forced)

    _assert_stats(stats, buffers, case, _same_bytes(buffers, _native(case), dst), forced)
    np.testing.assert_array_equal(NaiveLayout.read(buffers, 0, ids, dst), want)
    _assert_only_blocks_changed(buffers, before, 0, ids, _native(case))
    native = buffers.format.native_arrangement(case["block_size"])
    back = BlockArrangement(layout=to, sub_blocks_per_chunk=native.sub_blocks_per_chunk)
    with _forced(_other(path), budget) as forced:
        rewrite_group(buffers, 0, ids, back, native, **forced)
    for image, old in zip(NaiveLayout.byte_images(buffers), before, strict=True):
        np.testing.assert_array_equal(image, old)


@settings(max_examples=150, deadline=None)
@given(case=split_cases(), path=st.sampled_from(PATHS), budget=budgets)
def test_split_lands_as_receiver_blocks_and_merge_undoes_it(case, path, budget):
    buffers = build_side(case, seed=2)
    ids = np.array(case["block_ids"])
    before = NaiveLayout.byte_images(buffers)
    want = NaiveLayout.read(buffers, 0, ids, _native(case))

    with _forced(path, budget) as forced:
        stats = split_blocks(
            buffers,
            0,
            ids,
            sub_block_size=case["sub"],
            kernel_block_size=case["sub_kernel"],
            to_layout=case["to_layout"],
            **forced,
        )

    same = _same_bytes(buffers, _native(case), _chunked(case))
    _assert_stats(stats, buffers, case, same, forced)
    np.testing.assert_array_equal(NaiveLayout.read(buffers, 0, ids, _chunked(case)), want)
    _assert_only_blocks_changed(buffers, before, 0, ids, _native(case))
    with _forced(_other(path), budget) as forced:
        merge_blocks(
            buffers,
            0,
            ids,
            sub_block_size=case["sub"],
            kernel_block_size=case["sub_kernel"],
            from_layout=case["to_layout"],
            **forced,
        )
    for image, old in zip(NaiveLayout.byte_images(buffers), before, strict=True):
        np.testing.assert_array_equal(image, old)


@settings(max_examples=120, deadline=None)
@given(case=split_cases(), path=st.sampled_from(PATHS), budget=budgets)
def test_merge_assembles_sender_chunks_into_the_native_format(case, path, budget):
    buffers = build_side(case, seed=3)
    ids = np.array(case["block_ids"])
    before = NaiveLayout.byte_images(buffers)
    # what a receiver got: c sender blocks back to back inside each of its blocks
    want = NaiveLayout.read(buffers, 0, ids, _chunked(case))

    with _forced(path, budget) as forced:
        stats = merge_blocks(
            buffers,
            0,
            ids,
            sub_block_size=case["sub"],
            kernel_block_size=case["sub_kernel"],
            from_layout=case["to_layout"],
            **forced,
        )

    same = _same_bytes(buffers, _native(case), _chunked(case))
    _assert_stats(stats, buffers, case, same, forced)
    np.testing.assert_array_equal(NaiveLayout.read(buffers, 0, ids, _native(case)), want)
    _assert_only_blocks_changed(buffers, before, 0, ids, _native(case))


def _hybrid(cross: bool, packing: KVPacking = KVPacking.BLOCKS_FIRST) -> KVCacheBuffers:
    full = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=4, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=2, dtype=torch.bfloat16, sliding_window=32
    )
    state = StateSpec(block_size=8, shapes=((5, 3),), dtypes=(torch.float32,))
    config = KVCacheConfig.uniform(
        [
            KVCacheGroup(group_id=0, layer_names=("a0", "a1", "a2"), spec=full),
            KVCacheGroup(group_id=1, layer_names=("w0", "w1"), spec=window),
            KVCacheGroup(group_id=2, layer_names=("s0",), spec=state),
        ],
        num_blocks=9,
    )
    fmt = CacheFormat(layout=KVLayout.NHD, kernel_block_size=4, cross_layer=cross, packing=packing)
    buffers = KVCacheBuffers(config, fmt)
    fill_random(buffers, 5)
    return buffers


@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize("path", PATHS)
def test_hybrid_split_of_one_group_leaves_other_groups_alone(cross, packing, path):
    buffers = _hybrid(cross, packing)
    ids = np.array([7, 2, 4, 0, 8])
    before = NaiveLayout.byte_images(buffers)
    want = NaiveLayout.read(buffers, 1, ids, Arr(1, 4, "NHD"))

    with _forced(path) as forced:
        stats = split_blocks(
            buffers, 1, ids, sub_block_size=8, kernel_block_size=2, to_layout=KVLayout.HND, **forced
        )

    assert stats.num_blocks == 5
    _assert_scratch(stats, buffers, 1, 5, None)
    np.testing.assert_array_equal(NaiveLayout.read(buffers, 1, ids, Arr(2, 2, "HND")), want)
    _assert_only_blocks_changed(buffers, before, 1, ids, Arr(1, 4, "NHD"))


@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize("num_ids", [1, 2, 5, 9])
def test_scratch_never_exceeds_one_block_of_the_group_on_a_cpu(cross, packing, num_ids):
    buffers = _hybrid(cross, packing)
    ids = np.arange(num_ids)[::-1].copy()
    for gid in (0, 1):
        stats = permute_layout(buffers, gid, ids, KVLayout.HND)
        assert stats.num_blocks == num_ids
        assert stats.strategy is RewriteStrategy.SMALL_SCRATCH
        assert 0 < stats.scratch_bytes <= buffers.group_block_bytes(gid)
        stats = split_blocks(buffers, gid, ids, sub_block_size=4, to_layout=KVLayout.HND)
        assert stats.num_blocks == num_ids
        assert 0 < stats.scratch_bytes <= buffers.group_block_bytes(gid)


@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize("units_of_budget", [0, 0.5, 1, 2, 3.5, 100])
def test_batched_scratch_stays_within_a_budget_smaller_than_the_rewrite(
    cross, packing, units_of_budget
):
    """Nine blocks through a budget of a fraction of a unit up to many units: the scratch
    is the budget rounded down to whole units (one when the budget holds less), never
    more than the nine blocks, and the bytes land as the reference says."""
    buffers = _hybrid(cross, packing)
    ids = np.array([3, 8, 0, 5, 1, 7, 2, 6, 4])
    unit = buffers.unit_slots(0)[0].geometry.unit_bytes
    budget = int(units_of_budget * unit)
    want = NaiveLayout.read(buffers, 0, ids, Arr(1, 4, "NHD"))

    stats = split_blocks(
        buffers,
        0,
        ids,
        sub_block_size=4,
        kernel_block_size=2,
        to_layout=KVLayout.HND,
        scratch_budget_bytes=budget,
        strategy=RewriteStrategy.BATCHED,
    )

    assert stats.scratch_bytes == unit * min(9, max(1, int(units_of_budget)))
    assert stats.scratch_bytes <= max(budget, unit)
    np.testing.assert_array_equal(NaiveLayout.read(buffers, 0, ids, Arr(2, 2, "HND")), want)


@pytest.mark.parametrize(
    ("itemsize", "column", "pad"),  # where the units sit inside wider rows, and how wide
    [(2, 0, 48), (2, 2, 46), (2, 16, 48), (1, 1, 47), (1, 3, 6)],
)
@pytest.mark.parametrize("num_ids", [1, 3, 6])
@pytest.mark.parametrize("heads", [2, 1])  # 1 head, 2-byte items: 12-byte runs, 2-byte stride
@pytest.mark.parametrize("path", PATHS)
def test_rewrite_units_respects_any_scratch_budget(itemsize, column, pad, num_ids, heads, path):
    """Whatever the budget, scratch is whole units, at least one, at most max(budget, unit);
    the result is the same, and rows and columns outside the rewrite are not written.
    Odd row strides and offsets (1-byte items) included."""
    geo = UnitGeometry(
        num_layers=2, num_kv_parts=2, block_size=4, num_heads=heads, head_size=3, itemsize=itemsize
    )
    unit = geo.unit_bytes
    src = BlockArrangement(layout=KVLayout.NHD)
    dst = BlockArrangement(layout=KVLayout.HND, num_chunks=2)
    width = unit + pad
    gen = torch.Generator().manual_seed(num_ids)
    wide = torch.randint(0, 256, (7, width), dtype=torch.uint8, generator=gen)
    ids = np.random.default_rng(column).permutation(7)[:num_ids]
    want = token_major(wide[:, column : column + unit], geo, src)
    for budget in (None, 0, 1, unit, 2 * unit - 1, 2 * unit, 3 * unit + 5, 5 * unit, 10**9):
        buf = wide.clone()
        units = buf[:, column : column + unit]
        with _forced(path, budget) as forced:
            stats = rewrite_units(units, geo, ids, src, dst, **forced)
        assert stats.num_blocks == num_ids and stats.bytes_moved == num_ids * unit
        allowed = stats.strategy.default_budget_bytes(unit) if budget is None else budget
        assert stats.scratch_bytes == unit * max(1, min(num_ids, allowed // unit))
        assert unit <= stats.scratch_bytes <= max(unit, allowed)
        got = token_major(units, geo, dst)
        assert torch.equal(got[ids], want[ids])
        others = np.setdiff1d(np.arange(7), ids)
        assert torch.equal(buf[others], wide[others])
        assert torch.equal(buf[:, :column], wide[:, :column])
        assert torch.equal(buf[:, column + unit :], wide[:, column + unit :])


def test_noop_rewrites_touch_nothing():
    geo = UnitGeometry(
        num_layers=1, num_kv_parts=2, block_size=4, num_heads=1, head_size=3, itemsize=4
    )
    units = torch.randint(0, 256, (3, geo.unit_bytes), dtype=torch.uint8)
    copy = units.clone()
    # one head: NHD and HND put every element at the same byte
    stats = rewrite_units(
        copy,
        geo,
        np.array([0, 2]),
        BlockArrangement(layout=KVLayout.NHD),
        BlockArrangement(layout=KVLayout.HND),
    )
    assert stats.num_blocks == 0 and torch.equal(copy, units)
    stats = rewrite_units(
        copy,
        geo,
        np.array([], dtype=np.int64),
        BlockArrangement(layout=KVLayout.NHD),
        BlockArrangement(layout=KVLayout.NHD, sub_blocks_per_chunk=2),
    )
    assert stats.num_blocks == 0 and torch.equal(copy, units)


def test_rewrite_errors_name_the_values():
    buffers = _hybrid(cross=True)
    with pytest.raises(LayoutError, match=r"must be unique.*repeated: \[3\]"):
        permute_layout(buffers, 0, np.array([3, 1, 3, 5]), KVLayout.HND)
    with pytest.raises(BlockIdError, match=r"\[9\] outside the pool \[0, 9\)"):
        permute_layout(buffers, 0, np.array([1, 9]), KVLayout.HND)
    with pytest.raises(BlockIdError, match=r"\[-2\]"):
        split_blocks(buffers, 1, np.array([-2]), sub_block_size=8)
    with pytest.raises(LayoutError, match=r"group id 5 outside \[0, 3\)"):
        permute_layout(buffers, 5, np.array([0]), KVLayout.HND)
    with pytest.raises(LayoutError, match=r"group id -1 outside \[0, 3\)"):
        rewrite_group(
            buffers,
            -1,
            np.array([0]),
            BlockArrangement(layout=KVLayout.NHD),
            BlockArrangement(layout=KVLayout.HND),
        )
    with pytest.raises(LayoutError, match="group 2 is a state group"):
        rewrite_group(
            buffers,
            2,
            np.array([0]),
            BlockArrangement(layout=KVLayout.NHD),
            BlockArrangement(layout=KVLayout.HND),
        )
    with pytest.raises(LayoutError, match="sub-block size 3 does not divide block_size=16"):
        split_blocks(buffers, 1, np.array([0]), sub_block_size=3)
    with pytest.raises(LayoutError, match="kernel_block_size=3 does not divide the 8-token"):
        merge_blocks(buffers, 1, np.array([0]), sub_block_size=8, kernel_block_size=3)
    with pytest.raises(LayoutError, match="sub-block size 0"):
        chunked_arrangement(16, 0, 1, KVLayout.NHD)
    geo = buffers.unit_slots(0)[0].geometry
    units = buffers.unit_slots(0)[0].units
    with pytest.raises(BlockIdError, match=r"\[9\] outside \[0, 9\)"):
        rewrite_units(
            units,
            geo,
            np.array([4, 9]),
            BlockArrangement(layout=KVLayout.NHD),
            BlockArrangement(layout=KVLayout.HND),
        )


def test_chunked_arrangement_fields():
    arr = chunked_arrangement(64, 16, 4, KVLayout.HND)
    assert (arr.num_chunks, arr.sub_blocks_per_chunk, arr.layout) == (4, 4, KVLayout.HND)
    assert arr.sub_block_size(64) == 4
