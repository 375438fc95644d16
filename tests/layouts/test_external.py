"""Describing KV-cache tensors an engine allocated (``kvbridge.layouts.external``).

The reference is kvbridge's own allocator: memory it lays out is handed back as an
engine would hand it (contiguous, or a logical shape with permuted strides, or per-layer
views into one cross-layer buffer) and the adopted buffers must address the very same
bytes. vLLM 0.32's CPU layout (``[B, H, N, K|V]``) is checked value by value.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers, read_group_token_major
from kvbridge.layouts.external import ExternalLayoutError, adopt_kv_caches, describe_layer
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import FullAttentionSpec, SlidingWindowSpec

H, D = 2, 4


def _config(block_size: int = 4, num_blocks: int = 5, hybrid: bool = False) -> KVCacheConfig:
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=H, head_size=D, dtype=torch.float16
    )
    groups = [KVCacheGroup(group_id=0, layer_names=("l0", "l2"), spec=full)]
    if hybrid:
        sw = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=H,
            head_size=D,
            dtype=torch.float16,
            sliding_window=6,
        )
        groups.append(KVCacheGroup(group_id=1, layer_names=("l1", "l3"), spec=sw))
    return KVCacheConfig(groups=tuple(groups), num_blocks=num_blocks)


def _engine_view(rows: torch.Tensor, shape: tuple[int, ...], perm: tuple[int, ...] | None):
    """Reinterpret a layer's contiguous bytes as ``shape`` fp16, then (optionally) show it
    in a logical axis order ``perm`` of that physical shape (strides permuted)."""
    t = rows.reshape(-1).view(torch.float16).view(shape) if rows.is_contiguous() else None
    if t is None:  # strided rows (cross-layer): build the view over the storage
        raise AssertionError("use _cross_layer_views for strided rows")
    return t.permute(*perm) if perm else t


def _fill(buffers: KVCacheBuffers, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in buffers.tensors:
        t.copy_(torch.randint(0, 255, t.shape, generator=g, dtype=torch.uint8))


def _same_bytes(a: KVCacheBuffers, b: KVCacheBuffers) -> None:
    assert a.config.layer_names == b.config.layer_names
    for name in a.config.layer_names:
        x, y = a.layer_bytes(name), b.layer_bytes(name)
        assert (x.data_ptr(), x.shape, x.stride()) == (y.data_ptr(), y.shape, y.stride()), name
    for g in a.config.groups:
        ids = np.arange(a.config.num_blocks)
        torch.testing.assert_close(
            read_group_token_major(a, g.group_id, ids), read_group_token_major(b, g.group_id, ids)
        )
        sa, sb = a.unit_slots(g.group_id), b.unit_slots(g.group_id)
        assert [s.region for s in sa] == [s.region for s in sb]


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize("kernel", [4, 2])
@pytest.mark.parametrize("permuted", [False, True])
def test_adopting_own_allocation_addresses_the_same_bytes(layout, packing, kernel, permuted):
    config = _config(hybrid=True)
    fmt = CacheFormat(layout=layout, kernel_block_size=kernel, packing=packing)
    own = KVCacheBuffers(config, fmt)
    _fill(own, seed=3)
    nk = config.num_blocks * (4 // kernel)
    block = (kernel, H, D) if layout is KVLayout.NHD else (H, kernel, D)
    shape = (2, nk, *block) if packing is KVPacking.KV_SPLIT else (nk, 2, *block)
    # A logical order that differs from memory order, as vLLM's stride-order views do.
    perm = (1, 0, 2, 3, 4) if permuted else None
    tensors = {n: _engine_view(own.layer_bytes(n), shape, perm) for n in config.layer_names}
    adopted = adopt_kv_caches(config, tensors, layout_hint=layout)
    assert adopted.format == fmt
    _same_bytes(own, adopted)


def test_adopting_cross_layer_views():
    config = _config(hybrid=True)
    fmt = CacheFormat(layout=KVLayout.HND, cross_layer=True)
    own = KVCacheBuffers(config, fmt)
    _fill(own, seed=5)
    buf = own.tensors[0]
    page_elems = config.page_size_bytes // 2
    row = buf.stride(0) // 2
    base = buf.view(torch.float16)
    tensors = {}
    for i, name in enumerate(config.layer_names):
        tensors[name] = base.as_strided(
            (config.num_blocks, 2, H, 4, D), (row, H * 4 * D, 4 * D, D, 1), i * page_elems
        )
    adopted = adopt_kv_caches(config, tensors, layout_hint=KVLayout.HND)
    assert adopted.format.cross_layer
    assert adopted.tensors[0].data_ptr() == buf.data_ptr()
    _same_bytes(own, adopted)


def test_cross_layer_views_in_another_layer_order_are_refused():
    config = _config(hybrid=True)
    own = KVCacheBuffers(config, CacheFormat(layout=KVLayout.HND, cross_layer=True))
    base = own.tensors[0].view(torch.float16)
    row, page = own.tensors[0].stride(0) // 2, config.page_size_bytes // 2
    order = ["l0", "l1", "l2", "l3"]  # model order, not kvbridge's group-major l0 l2 l1 l3
    tensors = {
        n: base.as_strided((config.num_blocks, 2, H, 4, D), (row, H * 4 * D, 4 * D, D, 1), i * page)
        for i, n in enumerate(order)
    }
    with pytest.raises(ExternalLayoutError, match=r"layer 'l2'.*expected \d+ B"):
        adopt_kv_caches(config, tensors)


def test_vllm_cpu_interleaved_layout_values():
    """vLLM 0.32 CPU: per layer ``[B, H, N, K|V]`` contiguous (``LBHNC``)."""
    config = _config(block_size=4, num_blocks=3)
    nb, bs = config.num_blocks, 4
    k = torch.arange(nb * H * bs * D, dtype=torch.float16).view(nb, H, bs, D)
    v = -k - 1
    tensors = {n: torch.cat([k, v], dim=-1).contiguous() for n in config.layer_names}
    buffers = adopt_kv_caches(config, tensors, layout_hint=KVLayout.HND)
    spec = buffers.config.groups[0].spec
    assert spec.kv_interleaved and spec.num_kv_parts == 1
    assert buffers.format.layout is KVLayout.HND and not buffers.format.cross_layer
    assert buffers.tensors[0].data_ptr() == tensors["l0"].data_ptr()
    (view,) = buffers.attention_views("l0")  # (nb, r, H, kb, 2D)
    torch.testing.assert_close(view[:, 0], tensors["l0"])
    tm = read_group_token_major(buffers, 0, np.array([2, 0]))  # (L, 1, tokens, H, 2D)
    got = tm.view(torch.float16)[0, 0]
    want = torch.cat([torch.cat([k[b], v[b]], -1).transpose(0, 1) for b in (2, 0)])
    torch.testing.assert_close(got, want)


def test_hybrid_groups_sharing_tensors_register_each_allocation_once():
    """vLLM's hybrid allocator: layer i of every group is the same tensor."""
    config = _config(block_size=4, num_blocks=3, hybrid=True)
    shared = [torch.zeros(3, H, 4, 2 * D, dtype=torch.float16) for _ in range(2)]
    tensors = {"l0": shared[0], "l1": shared[0], "l2": shared[1], "l3": shared[1]}
    buffers = adopt_kv_caches(config, tensors, layout_hint=KVLayout.HND)
    assert sorted(t.data_ptr() for t in buffers.tensors) == sorted(t.data_ptr() for t in shared)
    assert buffers.layer_bytes("l0").data_ptr() == buffers.layer_bytes("l1").data_ptr()
    shared[0][1, 0, 2, 3] = 7.0  # group 0 and group 1 see the same bytes
    assert torch.equal(buffers.layer_bytes("l0")[1], buffers.layer_bytes("l1")[1])


def test_interleaved_and_split_specs_are_different_pages_of_the_same_size():
    split = FullAttentionSpec(block_size=4, num_kv_heads=H, head_size=D, dtype=torch.float16)
    inter = FullAttentionSpec(
        block_size=4, num_kv_heads=H, head_size=D, dtype=torch.float16, kv_interleaved=True
    )
    assert split.page_size_bytes == inter.page_size_bytes
    assert (split.num_kv_parts, inter.num_kv_parts) == (2, 1)
    assert inter.part_head_size == 2 * D


def test_unknown_shape_names_layer_shape_strides_and_expectation():
    config = _config()
    bad = torch.zeros(config.num_blocks, 3, 4, D, dtype=torch.float16)  # 3 "heads"
    with pytest.raises(ExternalLayoutError) as info:
        adopt_kv_caches(config, {"l0": bad, "l2": bad})
    text = str(info.value)
    assert "layer 'l0'" in text and "(5, 3, 4, 4)" in text and "strides" in text
    assert "expected one of" in text and "blocks_first HND" in text


def test_non_dense_inner_axis_is_refused():
    config = _config()
    big = torch.zeros(config.num_blocks, 2, H, 4, 2 * D, dtype=torch.float16)
    gappy = big[..., :D]  # every head row skips D elements
    with pytest.raises(ExternalLayoutError, match="only the block axis may be strided"):
        describe_layer("l0", gappy, config.groups[0].spec, config.num_blocks)


def test_wrong_dtype_missing_and_extra_layers_are_refused():
    config = _config()
    spec = config.groups[0].spec
    good = torch.zeros(config.num_blocks, 2, H, 4, D, dtype=torch.float16)
    with pytest.raises(ExternalLayoutError, match=r"expected dtype torch\.float16"):
        describe_layer("l0", good.float(), spec, config.num_blocks)
    with pytest.raises(ExternalLayoutError, match=r"missing \['l2'\], unexpected \['x'\]"):
        adopt_kv_caches(config, {"l0": good, "x": good})


def test_ambiguous_shape_needs_the_layout_hint():
    # kernel block 2 == heads 2: NHD (kb, H, D) and HND (H, kb, D) have the same shape.
    config = _config(block_size=2)
    t = torch.zeros(config.num_blocks, 2, 2, 2, D, dtype=torch.float16)
    spec = config.groups[0].spec
    with pytest.raises(ExternalLayoutError, match="fits several layouts"):
        describe_layer("l0", t, spec, config.num_blocks)
    assert describe_layer("l0", t, spec, config.num_blocks, layout_hint=KVLayout.NHD).layout is (
        KVLayout.NHD
    )


def test_layers_in_different_formats_are_refused():
    config = _config()
    hnd = torch.zeros(config.num_blocks, 2, H, 4, D, dtype=torch.float16)
    nhd_inter = torch.zeros(config.num_blocks, 4, H, 2 * D, dtype=torch.float16)
    with pytest.raises(ExternalLayoutError, match="kvbridge needs one format"):
        adopt_kv_caches(config, {"l0": hnd, "l2": nhd_inter})
