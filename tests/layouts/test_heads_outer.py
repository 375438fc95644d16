"""Heads-outer per-layer caches (vLLM's LHBNC, ``HeadOrder.OUTER``), without vLLM.

Each layer keeps head 0's blocks, then head 1's, ...; kvbridge describes every (layer,
head) as a region whose unit is one head's run of a block. Engine tensors are built here
from kvbridge's own OUTER allocation, shown as an engine shows them (a logical
``[blocks, H, N, C]`` with the strides permuted), and must address the very same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers, read_group_token_major
from kvbridge.layouts.arrangement import HeadOrder
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.external import ExternalLayoutError, adopt_kv_caches, describe_layer
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import FullAttentionSpec

H, D, BS, N = 3, 4, 4, 5
OUTER = CacheFormat(layout=KVLayout.HND, heads=HeadOrder.OUTER)


def _config() -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float16, kv_interleaved=True
    )
    return KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0", "l1"), spec=spec),), num_blocks=N
    )


def _engine_views(own: KVCacheBuffers, kb: int = BS) -> dict[str, torch.Tensor]:
    """vLLM's LHBNC view of each layer: logical ``[kernel blocks, H, kb, C]`` over memory
    ``[H, kernel blocks, kb, C]``."""
    out = {}
    for name, t in zip(own.config.layer_names, own.tensors, strict=True):
        physical = t.reshape(-1).view(torch.float16).view(H, N * BS // kb, kb, 2 * D)
        out[name] = physical.permute(1, 0, 2, 3)
    return out


def test_own_outer_allocation_is_one_region_per_layer_and_head():
    own = KVCacheBuffers(_config(), OUTER)
    run = BS * 2 * D * 2
    slots = own.unit_slots(0)
    assert [(s.layer_index, s.head) for s in slots] == [(i, h) for i in (0, 1) for h in range(H)]
    for s in slots:
        assert s.geometry is not None and s.geometry.num_heads == 1
        base = own.tensors[s.layer_index].data_ptr()
        assert s.region.base_addr == base + s.head * N * run
        assert (s.region.block_bytes, s.region.block_stride_bytes) == (run, run)
    with pytest.raises(LayoutError, match="head-outer"):
        own.layer_bytes("l0")


@pytest.mark.parametrize("kb", [BS, BS // 2], ids=["kb=block", "kb=block/2"])
def test_adopted_lhbnc_views_address_the_same_bytes_and_tokens(kb):
    own = KVCacheBuffers(_config(), OUTER)
    views = _engine_views(own, kb)
    g = torch.Generator().manual_seed(3)
    for v in views.values():
        v.view(torch.int16).copy_(torch.randint(-(2**15), 2**15 - 1, v.shape, generator=g))
    adopted = adopt_kv_caches(_config(), views, layout_hint=KVLayout.HND)
    assert adopted.format.heads is HeadOrder.OUTER
    assert adopted.format.kernel_block_size_for(BS) == kb
    assert [r.region for r in adopted.unit_slots(0)] == [r.region for r in own.unit_slots(0)]
    ids = np.array([4, 0, 2])
    got = read_group_token_major(adopted, 0, ids)  # (L, P, T, H, C)
    for i, v in enumerate(views.values()):
        r = BS // kb
        kernel = (torch.as_tensor(ids)[:, None] * r + torch.arange(r)).reshape(-1)
        want = v.index_select(0, kernel).permute(0, 2, 1, 3).reshape(-1, H, 2 * D)
        assert torch.equal(got[i, 0], want.view(torch.int16))


def test_padding_between_heads_is_refused_by_name():
    spare = torch.zeros(H, N + 1, BS, 2 * D, dtype=torch.float16)
    views = {n: spare[:, :N].permute(1, 0, 2, 3) for n in ("l0", "l1")}
    with pytest.raises(ExternalLayoutError, match=r"layer 'l0'.*LHBNC"):
        adopt_kv_caches(_config(), views)


def test_heads_outer_mixed_with_another_format_is_refused():
    own = KVCacheBuffers(_config(), OUTER)
    views = _engine_views(own)
    views["l1"] = torch.zeros(N, H, BS, 2 * D, dtype=torch.float16)  # LBHNC
    with pytest.raises(ExternalLayoutError, match=r"'l1' is blocks_first HND.*heads-outer"):
        adopt_kv_caches(_config(), views)


def test_outer_heads_need_a_blocks_first_per_layer_cache():
    with pytest.raises(LayoutError, match="blocks-first per-layer"):
        CacheFormat(heads=HeadOrder.OUTER, cross_layer=True)
    with pytest.raises(LayoutError, match="blocks-first per-layer"):
        CacheFormat(heads=HeadOrder.OUTER, packing=KVPacking.KV_SPLIT)
    # a unit holds one head: its native arrangement is the plain one
    assert OUTER.native_arrangement(BS).heads is HeadOrder.INNER


def test_as_many_kernel_blocks_as_heads_is_refused_not_guessed():
    """[H, B, N, C] and [B, H, N, C] have the same memory order when H == B: kvbridge
    cannot tell heads outside blocks from blocks outside heads, and says so."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.float16)
    lhbnc = torch.zeros(4, 4, 16, 16, dtype=torch.float16).permute(1, 0, 2, 3)
    with pytest.raises(ExternalLayoutError, match="as many kernel blocks as heads"):
        describe_layer("l0", lhbnc, spec, 4)
    more_blocks = torch.zeros(4, 8, 16, 16, dtype=torch.float16).permute(1, 0, 2, 3)
    assert describe_layer("l0", more_blocks, spec, 8).heads_outer
