"""KVCacheBuffers against the naive byte-layout reference: model views, token-major reads,
state views, unit slots of hybrid configs, and errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from layout_reference import Arr, NaiveLayout, as_uint, attention_cases, build_side, fill_random

from kvbridge.layouts.allocation import (
    CacheFormat,
    KVCacheBuffers,
    pool_bytes,
    read_group_token_major,
)
from kvbridge.layouts.errors import BlockIdError, LayoutError
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import FullAttentionSpec, SlidingWindowSpec, StateSpec


def _native(case: dict) -> Arr:
    return Arr(1, case["kernel"], case["layout"].value)


@settings(max_examples=120, deadline=None)
@given(case=attention_cases())
def test_token_major_read_matches_naive_reference(case):
    buffers = build_side(case, seed=len(case["block_ids"]))
    expected = NaiveLayout.read(buffers, 0, case["block_ids"], _native(case))
    got = read_group_token_major(buffers, 0, np.array(case["block_ids"]))
    # read_group_token_major: (layer, part, token, head, dim); reference: (layer, token, part, ...)
    assert got.shape == (
        expected.shape[0],
        expected.shape[2],
        expected.shape[1],
        *expected.shape[3:],
    )
    np.testing.assert_array_equal(as_uint(got).transpose(0, 2, 1, 3, 4), expected)


@settings(max_examples=120, deadline=None)
@given(case=attention_cases())
def test_attention_views_match_naive_reference(case):
    buffers = build_side(case, seed=7)
    nb, bs, kb = case["num_blocks"], case["block_size"], case["kernel"]
    r = bs // kb
    all_ids = np.arange(nb)
    expected = NaiveLayout.read(buffers, 0, all_ids, _native(case))  # (L, nb*bs, P, H, D)
    heads, dim = expected.shape[3], expected.shape[4]
    for i, name in enumerate(buffers.config.layer_names):
        views = buffers.attention_views(name)
        assert len(views) == (1 if case["mla"] else 2)
        for p, view in enumerate(views):
            assert view.dtype == case["dtype"]
            want = expected[i, :, p].reshape(nb, r, kb, heads, dim)
            if case["layout"] is KVLayout.NHD:
                assert view.shape == (nb, r, kb, heads, dim)
            else:
                assert view.shape == (nb, r, heads, kb, dim)
                want = want.transpose(0, 1, 3, 2, 4)
            np.testing.assert_array_equal(as_uint(view), want)


@settings(max_examples=40, deadline=None)
@given(case=attention_cases())
def test_writes_through_attention_views_land_where_the_reference_says(case):
    """Views alias the buffer: zeroing the last layer's last part through the model's view
    zeroes exactly those elements in the reference and nothing else."""
    buffers = build_side(case, seed=3)
    all_ids = np.arange(case["num_blocks"])
    before = NaiveLayout.read(buffers, 0, all_ids, _native(case))
    buffers.attention_views(buffers.config.layer_names[-1])[-1].zero_()
    after = NaiveLayout.read(buffers, 0, all_ids, _native(case))
    assert not after[-1, :, -1].any()
    after[-1, :, -1] = before[-1, :, -1]
    np.testing.assert_array_equal(after, before)


def _hybrid_config(num_blocks: int = 5) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=4, dtype=torch.float16)
    # half the heads, twice the tokens: the same page size
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=4, dtype=torch.float16, sliding_window=24
    )
    state = StateSpec(block_size=8, shapes=((3, 5), (7,)), dtypes=(torch.float32, torch.float16))
    groups = [
        KVCacheGroup(group_id=0, layer_names=("a0", "a1"), spec=full),
        KVCacheGroup(group_id=1, layer_names=("w0", "w1", "w2"), spec=window),
        KVCacheGroup(group_id=2, layer_names=("s0",), spec=state),
    ]
    return KVCacheConfig.uniform(groups, num_blocks=num_blocks)


@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("packing", list(KVPacking))
def test_hybrid_unit_slots_cover_exactly_their_layers_columns(cross, packing):
    config = _hybrid_config()
    page = config.page_size_bytes
    assert page == 2 * 8 * 2 * 4 * 2 == 256
    buffers = KVCacheBuffers(
        config,
        CacheFormat(layout=KVLayout.HND, kernel_block_size=4, cross_layer=cross, packing=packing),
    )
    owner = [np.full(t.numel(), -1) for t in buffers.tensors]
    for g in config.groups:
        for slot in buffers.unit_slots(g.group_id):
            assert slot.group_id == g.group_id
            assert slot.units.data_ptr() == slot.region.base_addr
            region = slot.region
            ti = next(
                i
                for i, t in enumerate(buffers.tensors)
                if t.data_ptr() <= region.base_addr < t.data_ptr() + t.numel()
            )
            rel = region.base_addr - buffers.tensors[ti].data_ptr()
            for b in range(region.num_blocks):
                lo = rel + b * region.block_stride_bytes
                seg = owner[ti][lo : lo + region.block_bytes]
                assert (seg == -1).all(), "two slots claim the same bytes"
                seg[:] = g.group_id
    names = list(config.layer_names)
    if cross:
        (only,) = owner
        grid = only.reshape(config.num_blocks, len(names), page)
        for li, name in enumerate(names):
            assert (grid[:, li] == config.group_of(name).group_id).all(), name
    else:
        for li, name in enumerate(names):
            assert (owner[li] == config.group_of(name).group_id).all(), name


def test_hybrid_cross_layer_regions_and_block_bytes():
    config = _hybrid_config(num_blocks=4)
    buffers = KVCacheBuffers(config, CacheFormat(cross_layer=True))
    page, total = config.page_size_bytes, config.num_layers
    base = buffers.tensors[0].data_ptr()
    assert buffers.tensors[0].shape == (4, page * total)
    assert buffers.nbytes() == pool_bytes(config) == 4 * page * 6
    firsts = {0: 0, 1: 2, 2: 5}
    for gid, first in firsts.items():
        (slot,) = buffers.unit_slots(gid)
        n = config.groups[gid].num_layers
        assert slot.region.base_addr - base == first * page
        assert slot.region.block_bytes == n * page == buffers.group_block_bytes(gid)
        assert slot.region.block_stride_bytes == total * page
        assert slot.region.num_blocks == 4
    assert [r.name for r in buffers.regions()] == ["g0", "g1", "g2"]
    assert buffers.unit_slots(2)[0].geometry is None
    geo = buffers.unit_slots(1)[0].geometry
    assert (geo.num_layers, geo.num_kv_parts, geo.block_size, geo.num_heads) == (3, 2, 16, 1)


@pytest.mark.parametrize("cross", [True, False])
def test_state_views_shapes_and_offsets(cross):
    config = _hybrid_config(num_blocks=3)
    buffers = KVCacheBuffers(config, CacheFormat(cross_layer=cross))
    fill_random(buffers, 11)
    spec = config.groups[2].spec
    assert spec.page_size_bytes == config.page_size_bytes == 256
    assert spec.state_bytes == 3 * 5 * 4 + 7 * 2
    rows = buffers.layer_bytes("s0")
    conv, ssm = buffers.state_views("s0")
    assert conv.shape == (3, 3, 5) and conv.dtype == torch.float32
    assert ssm.shape == (3, 7) and ssm.dtype == torch.float16
    # states back to back from the page start: conv at byte 0, ssm at byte 60
    assert conv.data_ptr() == rows.data_ptr()
    assert ssm.data_ptr() == rows.data_ptr() + 60
    assert conv.stride(0) * 4 == ssm.stride(0) * 2 == rows.stride(0)
    for b in range(3):
        raw = rows[b].numpy()
        np.testing.assert_array_equal(as_uint(conv[b]).reshape(-1), raw[:60].view(np.uint32))
        np.testing.assert_array_equal(as_uint(ssm[b]), raw[60:74].view(np.uint16))


def test_state_views_align_each_state_to_its_dtype():
    state = StateSpec(block_size=4, shapes=((3,), (2,)), dtypes=(torch.int8, torch.float32))
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype=torch.float16)
    config = KVCacheConfig.uniform(
        [
            KVCacheGroup(group_id=0, layer_names=("a",), spec=full),
            KVCacheGroup(group_id=1, layer_names=("s",), spec=state),
        ],
        num_blocks=2,
    )
    buffers = KVCacheBuffers(config, CacheFormat(cross_layer=True))
    small, big = buffers.state_views("s")
    rows = buffers.layer_bytes("s")
    assert small.data_ptr() == rows.data_ptr()
    assert big.data_ptr() == rows.data_ptr() + 4  # 3 int8 bytes, padded to a float32 boundary
    big.fill_(1.5)
    small.fill_(-1)
    assert (big == 1.5).all()


def test_mla_views_have_one_part_and_one_head():
    case = dict(
        dtype=torch.float16,
        mla=True,
        heads=1,
        head_size=9,
        num_layers=2,
        block_size=8,
        kernel=2,
        layout=KVLayout.NHD,
        packing=KVPacking.KV_SPLIT,
        cross=False,
        num_blocks=3,
        block_ids=[2, 0],
    )
    buffers = build_side(case)
    (latent,) = buffers.attention_views("layer.1")
    assert latent.shape == (3, 4, 2, 1, 9)
    assert buffers.config.page_size_bytes == 8 * 9 * 2
    slots = buffers.unit_slots(0)  # one slot per layer: MLA pages are not split by part
    assert len(slots) == 2
    assert all(s.geometry.num_kv_parts == 1 and s.region.block_bytes == 144 for s in slots)
    got = read_group_token_major(buffers, 0, np.array([2, 0]))
    assert got.shape == (2, 1, 16, 1, 9)


def test_errors_name_the_values():
    config = _hybrid_config()
    buffers = KVCacheBuffers(config, CacheFormat())
    with pytest.raises(LayoutError, match="'s0' is a state layer"):
        buffers.attention_views("s0")
    with pytest.raises(LayoutError, match="'a1' is a full_attention layer"):
        buffers.state_views("a1")
    with pytest.raises(LayoutError, match="unknown layer 'nope'"):
        buffers.layer_bytes("nope")
    with pytest.raises(LayoutError, match=r"group id 3 outside \[0, 3\)"):
        buffers.unit_slots(3)
    with pytest.raises(BlockIdError, match=r"\[5, -1\] outside the pool \[0, 5\)"):
        buffers.check_block_ids(np.array([0, 5, -1]))
    with pytest.raises(BlockIdError, match=r"\[9\]"):
        read_group_token_major(buffers, 0, np.array([9]))
    with pytest.raises(LayoutError, match="group 2 is a state group"):
        read_group_token_major(buffers, 2, np.array([0]))


def test_kernel_block_size_must_divide_every_attention_block_size():
    config = _hybrid_config()  # block sizes 8 and 16
    with pytest.raises(LayoutError, match="kernel_block_size=3 does not divide block_size=8"):
        KVCacheBuffers(config, CacheFormat(kernel_block_size=3))
    with pytest.raises(LayoutError, match="kernel_block_size=16 does not divide block_size=8"):
        KVCacheBuffers(config, CacheFormat(kernel_block_size=16))


@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize("layout", list(KVLayout))
def test_hybrid_groups_read_their_own_columns(cross, packing, layout):
    """Every attention group of a hybrid config reads (token-major and through the model's
    views) exactly what the reference finds at its own layers' bytes."""
    config = _hybrid_config(num_blocks=4)
    buffers = KVCacheBuffers(
        config,
        CacheFormat(layout=layout, kernel_block_size=4, cross_layer=cross, packing=packing),
    )
    fill_random(buffers, 21)
    ids = np.array([3, 1, 2])
    for gid in (0, 1):
        group = config.groups[gid]
        bs = group.spec.block_size
        expected = NaiveLayout.read(buffers, gid, ids, Arr(1, 4, layout.value))
        got = read_group_token_major(buffers, gid, ids)
        np.testing.assert_array_equal(as_uint(got).transpose(0, 2, 1, 3, 4), expected)
        everything = NaiveLayout.read(buffers, gid, np.arange(4), Arr(1, 4, layout.value))
        for li, name in enumerate(group.layer_names):
            for p, view in enumerate(buffers.attention_views(name)):
                want = everything[li, :, p].reshape(4, bs // 4, 4, *everything.shape[3:])
                if layout is KVLayout.HND:
                    want = want.transpose(0, 1, 3, 2, 4)
                np.testing.assert_array_equal(as_uint(view), want)
