"""Every KV-cache layout vLLM 0.32 can hand the connector, allocated by vLLM's own code.

For each backend that imports on the CPU build, each layout it supports, block sizes 16 to
128 (kernel blocks smaller than manager blocks where the backend declares them), MLA,
hybrid and fp8 caches: kvbridge adopts the tensors vLLM would pass to
``register_kv_caches`` and reads every token's K|V per head back exactly where vLLM's
per-layer views keep it (LHBNC included: one region per (layer, head)); or it refuses at
startup with a typed error that names what to change. The tensors come from
``vllm_alloc`` (vLLM's allocation, no hand-typed shapes).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.model_executor.layers.mamba.abstract import MambaBase

from kvbridge.connector.common.config import ConfigError
from kvbridge.connector.vllm import translate
from kvbridge.examples.vllm.allocation import (
    BACKENDS,
    MLA_BACKENDS,
    Allocation,
    KVCacheLayout,
    Model,
    allocate,
    backend,
    get_supported_kv_cache_layouts,
    mamba2_layer_spec,
)
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers, read_group_token_major
from kvbridge.layouts.arrangement import HeadOrder
from kvbridge.layouts.errors import KVBridgeError, LayoutError
from kvbridge.layouts.external import ExternalLayoutError, adopt_kv_caches
from kvbridge.layouts.specs import KVCacheKind

pytestmark = pytest.mark.vllm

BLOCK_SIZES = (16, 32, 64, 128)


def adopt(a: Allocation) -> KVCacheBuffers:
    """What the adapter's register_kv_caches does with vLLM's tensors."""
    config = translate.kv_cache_config(a.kv_cache_config)
    hint, _ = translate.kv_layout(a.kv_cache_config)
    tensors = {n: a.kv_caches[n] for n in config.layer_names}
    return adopt_kv_caches(config, tensors, layout_hint=hint)


def vllm_tokens(a: Allocation, layer: str, block_ids: np.ndarray, gid: int) -> torch.Tensor:
    """``(tokens, H, C)`` of ``block_ids`` read through vLLM's own per-layer view (kernel
    blocks ``b * r .. b * r + r - 1`` make manager block ``b``), as integers."""
    view = a.kv_caches[layer]  # [kernel blocks, H, kb, C]
    r = a.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size // view.shape[2]
    kernel_ids = (torch.as_tensor(block_ids)[:, None] * r + torch.arange(r)).reshape(-1)
    blocks = view.index_select(0, kernel_ids)  # (n*r, H, kb, C)
    ints = blocks.view({1: torch.uint8, 2: torch.int16}[view.element_size()])
    return ints.permute(0, 2, 1, 3).reshape(-1, view.shape[1], view.shape[3])


def check_every_token(
    a: Allocation, buffers: KVCacheBuffers, groups: list[int] | None = None
) -> None:
    """Random bytes in vLLM's buffer; kvbridge's token-major read equals vLLM's views."""
    first = next(iter(a.kv_caches.values()))
    raw = first.untyped_storage()
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (raw.nbytes(),), dtype=torch.uint8, generator=gen)
    torch.empty(0, dtype=torch.uint8).set_(raw).copy_(data)
    n = buffers.config.num_blocks
    block_ids = np.array([n - 1, 1, 3], dtype=np.int64)
    for g in buffers.config.groups:
        if groups is not None and g.group_id not in groups:
            continue
        got = read_group_token_major(buffers, g.group_id, block_ids)  # (L, P, T, H, D)
        assert got.shape[1] == 1  # vLLM 0.32 keeps K|V (or the latent) in one content axis
        for i, name in enumerate(g.layer_names):
            want = vllm_tokens(a, name, block_ids, g.group_id)
            mine = got[i, 0].contiguous().view(want.dtype)
            assert torch.equal(mine, want), (a.layout.name, name)


def supported(backend_name: str) -> list[KVCacheLayout]:
    return get_supported_kv_cache_layouts([backend(backend_name)])


CASES = [(b, layout, bs) for b in BACKENDS for layout in supported(b) for bs in BLOCK_SIZES]


@pytest.mark.parametrize(("backend_name", "layout", "block_size"), CASES, ids=str)
def test_backend_layout_block_size_reads_every_token(backend_name, layout, block_size):
    try:
        a = allocate(
            Model(mla=backend_name in MLA_BACKENDS),
            block_size=block_size,
            layout=layout,
            backend_name=backend_name,
        )
    except ValueError as exc:  # vLLM itself refuses (e.g. FlashMLA needs 64-token kernels)
        assert "block size" in str(exc) or "dense, unpadded" in str(exc)
        pytest.skip(f"vLLM refuses this combination: {exc}")
    buffers = adopt(a)
    fmt = buffers.format
    assert fmt.cross_layer is layout.is_block_outermost
    kb = a.kernel_block_sizes[0]
    assert fmt.kernel_block_size_for(block_size) == kb
    head_outer = layout is KVCacheLayout.BHLNC and backend_name not in MLA_BACKENDS
    assert (fmt.heads is HeadOrder.IN_CHUNK) is head_outer
    # LHBNC of one latent head (MLA) is LBHNC byte for byte: described as that
    heads_outer = layout is KVCacheLayout.LHBNC and backend_name not in MLA_BACKENDS
    assert (fmt.heads is HeadOrder.OUTER) is heads_outer
    check_every_token(a, buffers)


def test_kernel_blocks_smaller_than_manager_blocks_are_exercised():
    """The matrix above includes backends whose kernels take smaller blocks."""
    a = allocate(Model(), block_size=128, layout=KVCacheLayout.LBNHC, backend_name="ROCM_AITER_FA")
    assert a.kernel_block_sizes == [32]
    b = adopt(a)
    assert b.format.kernel_block_size == 32
    check_every_token(a, b)
    mla = allocate(
        Model(mla=True), block_size=128, layout=KVCacheLayout.LBHNC, backend_name="FLASHMLA"
    )
    assert mla.kernel_block_sizes == [64]
    check_every_token(mla, adopt(mla))


@pytest.mark.parametrize(
    "layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.LHBNC], ids=str
)
def test_hybrid_full_and_sliding_groups(layout):
    """Two groups (full, sliding window): vLLM aliases their layer tensors; each group reads
    (LHBNC: each group's (layer, head) regions over the shared tensors)."""
    a = allocate(
        Model(num_layers=4, sliding_window=64),
        block_size=32,
        layout=layout,
        backend_name="FLASH_ATTN",
    )
    assert len(a.kv_cache_config.kv_cache_groups) == 2
    b = adopt(a)
    assert [g.spec.kind.value for g in b.config.groups] == ["full_attention", "sliding_window"]
    check_every_token(a, b)


@pytest.mark.parametrize("layout", [KVCacheLayout.BLHNC, KVCacheLayout.BHLNC], ids=str)
def test_hybrid_block_outer_is_refused_by_name(layout):
    """vLLM overlays groups inside a block-outer block; kvbridge says what to set."""
    a = allocate(
        Model(num_layers=4, sliding_window=64),
        block_size=32,
        layout=layout,
        backend_name="FLASH_ATTN",
    )
    with pytest.raises(ExternalLayoutError, match=r"cross-layer|head-outer"):
        adopt(a)


def test_fp8_cache_one_byte_elements():
    a = allocate(
        Model(dtype=torch.float8_e4m3fn),
        block_size=16,
        layout=KVCacheLayout.BHLNC,
        backend_name="FLASH_ATTN",
    )
    b = adopt(a)
    assert b.config.groups[0].spec.itemsize == 1
    check_every_token(a, b)


def test_lhbnc_is_adopted_as_one_region_per_layer_and_head():
    """ROCm prefers LHBNC: each layer keeps each head's blocks apart. kvbridge describes
    every (layer, head) as a region whose unit per block is that head's run of
    ``block_size * C`` bytes, ``num_blocks * run`` apart, and reads every token back."""
    assert supported("ROCM_ATTN")[0] is KVCacheLayout.LHBNC
    a = allocate(Model(), block_size=16, layout=KVCacheLayout.LHBNC, backend_name="ROCM_ATTN")
    b = adopt(a)
    assert b.format.heads is HeadOrder.OUTER and not b.format.cross_layer
    spec = b.config.groups[0].spec
    n, heads = b.config.num_blocks, spec.num_kv_heads
    run = 16 * 2 * spec.head_size * spec.itemsize
    regions = b.regions()
    assert len(regions) == 3 * heads  # L * H regions, K|V interleaved in each run
    for i, name in enumerate(b.config.layer_names):
        base = a.kv_caches[name].data_ptr()
        for h in range(heads):
            r = regions[i * heads + h]
            assert (r.name, r.block_bytes, r.block_stride_bytes) == (f"{name}.h{h}", run, run)
            assert (r.base_addr, r.num_blocks) == (base + h * n * run, n)
    with pytest.raises(LayoutError, match="head-outer"):
        b.layer_bytes(b.config.layer_names[0])
    check_every_token(a, b)


def vllm_states(a: Allocation, layer: str) -> tuple[torch.Tensor, ...]:
    """The state tensors of a Mamba layer as vLLM's own ``MambaBase.bind_kv_cache`` views
    them (``(blocks, *shape)`` per state), on the tensor ``register_kv_caches`` gets."""
    spec = next(
        g.kv_cache_spec for g in a.kv_cache_config.kv_cache_groups if layer in g.layer_names
    )
    layer_obj = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(layer_obj, a.kv_caches[layer])
    return layer_obj.kv_cache


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC])
def test_mamba2_state_group_is_adopted_beside_attention(layout, block_size):
    """A Mamba2 hybrid: vLLM pads the state page to the attention page and overlays the
    groups (attention layer i and Mamba layer i share one tensor). kvbridge's state spec
    is vLLM's (shapes, dtypes, padded page), and every block's bytes where kvbridge reads
    each state are the bytes vLLM's Mamba layer reads as that state."""
    a = allocate(
        Model(num_layers=2, mamba_layers=2),
        block_size=block_size,
        layout=layout,
        backend_name="FLASH_ATTN",
    )
    b = adopt(a)
    state = b.config.groups[1]
    assert state.kind is KVCacheKind.STATE
    vspec = a.kv_cache_config.kv_cache_groups[1].kv_cache_spec
    assert state.spec.shapes == vspec.shapes and state.spec.dtypes == vspec.dtypes
    assert state.spec.page_size_bytes == b.config.page_size_bytes == vspec.page_size_bytes
    assert len(b.tensors) == 2  # one per shared (attention, Mamba) layer pair
    check_every_token(a, b, groups=[0])
    for name in state.layer_names:
        rows = b.layer_bytes(name)
        for want, offset, nbytes, dtype, shape in zip(
            vllm_states(a, name),
            state.spec.state_offsets,
            state.spec.state_nbytes,
            state.spec.dtypes,
            state.spec.shapes,
            strict=True,
        ):
            mine = rows[:, offset : offset + nbytes].contiguous().view(dtype)
            assert torch.equal(mine.view(-1, *shape).view(torch.uint8), want.view(torch.uint8))


def test_mamba2_state_group_in_a_block_outer_layout_is_refused_by_name():
    a = allocate(
        Model(num_layers=2, mamba_layers=2),
        block_size=64,
        layout=KVCacheLayout.BLHNC,
        backend_name="FLASH_ATTN",
    )
    with pytest.raises(KVBridgeError, match="LBHNC"):
        adopt(a)


def test_mamba_state_page_larger_than_the_attention_page_is_refused_by_name():
    """vLLM pads the attention page up to the Mamba state when the state is larger (here
    at 32-token blocks); kvbridge refuses that at startup and says what to change."""
    a = allocate(
        Model(num_layers=2, mamba_layers=2),
        block_size=32,
        layout=KVCacheLayout.LBHNC,
        backend_name="FLASH_ATTN",
    )
    with pytest.raises(ConfigError, match=r"page_size_padded=.*--block-size"):
        translate.kv_cache_config(a.kv_cache_config)


def test_mamba_speculative_scratch_blocks_move_only_the_running_state():
    """Without prefix caching (mode "none") a request's state blocks are [running state,
    scratch...]: kvbridge shows the group one block per request, the first, at every
    position (vLLM's NixlConnector keeps the same one: ``clip_ssm_state_blocks``). With
    prefix caching ("align") the scratch blocks are refused by name."""
    from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks

    spec = replace(mamba2_layer_spec(64, torch.float16), num_speculative_blocks=2)
    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=["m"], kv_cache_spec=spec)], num_blocks=8
    )
    translate.kv_cache_config(config)  # served
    single = translate.single_block_groups(config)
    blocks = [5, 6, 7]  # running state, then two scratch blocks
    assert translate.position_block_ids([blocks], single)[0][:1] == clip_ssm_state_blocks(blocks, 2)
    aligned = replace(spec, mamba_cache_mode="align")
    config.kv_cache_groups[0].kv_cache_spec = aligned
    with pytest.raises(
        ConfigError, match=r"num_speculative_blocks=2 with mamba_cache_mode='align'"
    ):
        translate.kv_cache_config(config)


def test_head_outer_buffers_refuse_per_layer_rows_and_need_cross_layer():
    """A BHLNC cache keeps no layer's page in one run: asking for one is an error, and a
    head-outer format without a cross-layer buffer cannot be built."""
    a = allocate(Model(), block_size=16, layout=KVCacheLayout.BHLNC, backend_name="FLASH_ATTN")
    b = adopt(a)
    with pytest.raises(LayoutError, match="head-outer"):
        b.layer_bytes(b.config.layer_names[0])
    with pytest.raises(LayoutError, match="needs a cross-layer cache"):
        CacheFormat(heads=HeadOrder.IN_CHUNK, cross_layer=False)
    # one region over every block, as NIXL sees it
    assert [r.block_bytes for r in b.regions()] == [b.config.page_size_bytes * 3]
