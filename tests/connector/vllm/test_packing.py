"""vLLM's CPU attention keeps its own element order inside a block: kvbridge must know.

The tensor vLLM hands to connectors is ``[blocks, H, block_size, 2 * head_size]``, but
the kernels that fill it (``cpu_attn_reshape_and_cache``) store each head's K transposed.
These tests run that kernel, so a vLLM change to the order shows up here first.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from kvbridge.connector.vllm.worker_side import block_packing
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.specs import FullAttentionSpec

pytestmark = pytest.mark.vllm

NB, H, BS, D = 2, 2, 32, 32


def _fill(block_size: int) -> torch.Tensor:
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache = torch.zeros(NB, H, block_size, 2 * D)
    key_cache, value_cache = cache.view(NB, H, 2 * block_size, D).chunk(2, dim=2)
    t = torch.arange(block_size).view(-1, 1, 1)
    h = torch.arange(H).view(1, -1, 1)
    d = torch.arange(D).view(1, 1, -1)
    key = (1 + 10_000 * t + 100 * h + d).float()
    slots = torch.arange(block_size) + block_size  # block 1
    isa = _get_attn_isa(torch.float32, block_size, D)
    ops.cpu_attn_reshape_and_cache(key, -key, key_cache, value_cache, slots, isa)
    return cache


def test_cpu_attention_stores_k_transposed_so_token_chunks_are_not_byte_ranges():
    page = _fill(BS)[1].reshape(-1)
    # K of (token 1, head 0, dim 0) sits right after token 0: tokens are the inner axis
    assert page[1].item() == 1 + 10_000 * 1
    assert page[BS].item() == 1 + 1  # then dim 1 of token 0
    # so the first half of the page's bytes is not "the first half of the tokens"
    first_half = page[: page.numel() // 2]
    tokens_there = {int(abs(v.item()) - 1) // 10_000 for v in first_half}
    assert tokens_there == set(range(BS))


def test_block_packing_names_the_instruction_set_on_cpu():
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    config = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=NB
    )
    packing = block_packing(config, {"l0": torch.zeros(NB, H, BS, 2 * D)})
    assert packing.startswith("vllm-cpu-attn:") and packing.split(":")[1]


def test_page_map_is_measured_from_the_kernel():
    from kvbridge.connector.vllm.packing import page_map

    m = page_map(torch.float32, BS, H, D)
    t, h, d = 5, 1, 7
    if _isa_name() == "vec":  # x86 without AMX: K transposed, then V row-major, per head
        assert m[0, t, h, d] == h * 2 * BS * D + d * BS + t
        assert m[1, t, h, d] == h * 2 * BS * D + BS * D + t * D + d
    assert sorted(m.reshape(-1).tolist()) == list(range(2 * BS * H * D))


def _isa_name() -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(torch.float32, BS, D)


def _fp8_supported() -> bool:
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


# an fp8 cache (uint8 pages) is written by vLLM's kernel from K and V in the model's dtype
# (float32: its "vec" path; bf16: "amx" where the CPU has it, a different page order)
FP8 = [
    pytest.param(
        ("fp8", source),
        marks=pytest.mark.skipif(not _fp8_supported(), reason="fp8 KV needs AVX-512 or AMX"),
        id=f"fp8-{source}",
    )
    for source in (torch.float32, torch.bfloat16)
]


def _writer(kind):
    """(the cache's dtype, K/V dtype, write, source) for ``kind``: a float dtype, or
    ("fp8", the model's dtype)."""
    from kvbridge.connector.vllm.packing import _kernel_write, _write

    if isinstance(kind, tuple):
        source = kind[1]
        return (
            torch.uint8,
            source,
            lambda c, k, v, s: _kernel_write(c, k, v, s, "fp8"),
            source,
        )
    return kind, kind, _write, None


def test_an_fp8_page_keeps_the_element_order_of_a_float_page():
    """vLLM stores fp8 (e4m3, e5m2) pages as uint8; their map is probed through e4m3."""
    from kvbridge.connector.vllm.packing import page_map

    if not _fp8_supported():
        pytest.skip("fp8 KV needs AVX-512 or AMX")
    for source in (torch.float32, torch.bfloat16):
        fp8 = page_map(torch.uint8, BS, H, D, source)
        assert sorted(fp8.reshape(-1).tolist()) == list(range(2 * BS * H * D))
        assert np.array_equal(fp8, page_map(source, BS, H, D)), source
    with pytest.raises(KVBridgeError, match="model's dtype"):
        page_map(torch.uint8, BS, H, D)


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16, *FP8])
@pytest.mark.parametrize("small,large", [(32, 64), (32, 128), (64, 128)])
def test_repack_of_side_by_side_small_pages_equals_writing_the_large_block(kind, small, large):
    from kvbridge.connector.vllm.packing import repack_layer

    dtype, source, _write, model = _writer(kind)
    g = torch.Generator().manual_seed(small + large)
    tokens = 2 * large
    key = torch.randn(tokens, H, D, generator=g).to(source)
    value = torch.randn(tokens, H, D, generator=g).to(source)
    src = torch.zeros(2 * large // small + 1, H, small, 2 * D, dtype=dtype)
    src_ids = torch.arange(1, 1 + tokens // small)  # prefill blocks 1.. hold the tokens
    _write(src, key, value, (src_ids.view(-1, 1) * small + torch.arange(small)).reshape(-1))
    dst = torch.zeros(4, H, large, 2 * D, dtype=dtype)
    dst_ids = torch.tensor([3, 1])  # decode blocks for tokens 0..large-1, large..2*large-1
    r = large // small
    for j, b in enumerate(dst_ids.tolist()):  # what the transfer leaves: pages side by side
        pages = src[src_ids[j * r : (j + 1) * r]].reshape(-1)
        dst[b].view(-1).copy_(pages)
    repack_layer(dst, dst_ids, small, model)
    want = torch.zeros_like(dst)
    _write(want, key, value, (dst_ids.view(-1, 1) * large + torch.arange(large)).reshape(-1))
    assert torch.equal(dst[dst_ids].view(torch.uint8), want[dst_ids].view(torch.uint8))
    assert not torch.equal(dst[dst_ids], pages_side_by_side(src, src_ids, dst_ids, r))


def pages_side_by_side(src, src_ids, dst_ids, r):
    """The bytes before the repack: they differ from a packed large block."""
    return torch.stack(
        [src[src_ids[j * r : (j + 1) * r]].reshape(-1) for j in range(len(dst_ids))]
    ).view(len(dst_ids), *src.shape[1:-2], -1, src.shape[-1])


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16, *FP8])
@pytest.mark.parametrize(
    "small,large", [(32, 64), (32, 128), (64, 128), (64, 96), (96, 64), (32, 160)]
)
def test_split_of_staged_pages_equals_writing_the_decode_blocks(kind, small, large):
    """Prefill pages ``large`` tokens long (larger than decode's or not dividing them),
    staged whole: split writes tokens ``[start, end)`` into decode's ``small``-token
    blocks, byte for byte what the kernel writes; ``end`` is the prompt's last token."""
    from kvbridge.connector.vllm.packing import CpuAttnRepacker

    dtype, source, _write, model = _writer(kind)
    g = torch.Generator().manual_seed(7 * small + large)
    tokens = 2 * large
    key = torch.randn(tokens, H, D, generator=g).to(source)
    value = torch.randn(tokens, H, D, generator=g).to(source)
    src = torch.zeros(3, H, large, 2 * D, dtype=dtype)
    src_ids = torch.tensor([2, 0])  # prefill blocks holding tokens 0..large-1, large..
    _write(src, key, value, (src_ids.view(-1, 1) * large + torch.arange(large)).reshape(-1))
    staged = [src[src_ids].reshape(2, -1).view(torch.uint8)]  # what the staging slots hold

    nb = -(-tokens // small)
    dst = torch.zeros(nb + 2, H, small, 2 * D, dtype=dtype)
    dst_ids = np.arange(nb)[::-1] + 2  # decode's blocks, out of order
    start = small  # decode already had block 0 (a prefix hit): write tokens small..end
    end = tokens - 1  # decode computes the last prompt token itself
    t = np.arange(tokens).reshape(2, large)
    slots = np.where((t >= start) & (t < end), dst_ids[t // small] * small + t % small, -1)
    layers = KVCacheConfig(
        groups=(
            KVCacheGroup(
                group_id=0,
                layer_names=("l0",),
                spec=FullAttentionSpec(block_size=small, num_kv_heads=H, head_size=D, dtype=dtype),
            ),
        ),
        num_blocks=nb + 2,
    )
    before_hit = dst[int(dst_ids[0])].clone()
    CpuAttnRepacker(layers, {"l0": dst}, model).split(0, staged, large, slots)

    want = torch.zeros_like(dst)
    keep = torch.arange(start, end)
    want_slots = torch.from_numpy(dst_ids[keep.numpy() // small] * small + keep.numpy() % small)
    _write(want, key[keep], value[keep], want_slots)
    written = torch.from_numpy(dst_ids[1:].copy())
    assert torch.equal(dst[written].view(torch.uint8), want[written].view(torch.uint8))
    assert torch.equal(dst[int(dst_ids[0])], before_hit)  # the prefix-hit block untouched


def test_split_refuses_pages_of_another_size():
    import numpy as np

    from kvbridge.connector.vllm.packing import CpuAttnRepacker
    from kvbridge.layouts.errors import KVBridgeError

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    config = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=NB
    )
    repacker = CpuAttnRepacker(config, {"l0": torch.zeros(NB, H, BS, 2 * D)})
    pages = [torch.zeros(1, 100, dtype=torch.uint8)]
    with pytest.raises(KVBridgeError, match=r"64-token pages of 100 B do not match"):
        repacker.split(0, pages, 64, np.zeros((1, 64), dtype=np.int64))


def test_cpu_attention_pages_keep_each_head_in_one_run():
    """What lets a tensor-parallel decode rank read its heads as one byte range."""
    from kvbridge.connector.vllm.worker_side import heads_major

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    config = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=NB
    )
    assert heads_major(config) is (_isa_name() == "vec")


def test_a_slice_of_the_heads_is_a_page_of_fewer_heads():
    """What a rank of another TP size holds: heads ``a .. a + n - 1`` of a 4-head page,
    shifted to the start, are the element order of an ``n``-head page."""
    from kvbridge.connector.vllm.packing import page_map

    if _isa_name() != "vec":
        pytest.skip("heads are contiguous runs only in the vec order")
    for block_size in (32, 64, 128):
        four = page_map(torch.float32, block_size, 4, D)
        per_head = four.size // 4
        for a, n in [(0, 2), (2, 2), (1, 1), (3, 1), (1, 3)]:
            want = page_map(torch.float32, block_size, n, D)
            assert np.array_equal(four[:, :, a : a + n] - a * per_head, want), (block_size, a, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("small,large,ranks", [(32, 64, 2), (32, 128, 4), (64, 96, 2)])
def test_split_of_head_slices_from_several_prefill_ranks_equals_writing_all_heads(
    dtype, small, large, ranks
):
    """Decode TP 1 with 4 heads, prefill TP ``ranks`` with ``large``-token blocks: each
    prefill rank's staged pages hold only its heads; splitting them one rank at a time
    (in any order) writes decode's blocks byte for byte as the kernel writes all heads at
    once, and a rank's split leaves the other heads and the prefix-hit block alone."""
    from kvbridge.connector.vllm.packing import CpuAttnRepacker, _write

    heads = 4
    per_rank = heads // ranks
    g = torch.Generator().manual_seed(small * large + ranks)
    tokens = 2 * large
    key = torch.randn(tokens, heads, D, generator=g).to(dtype)
    value = torch.randn(tokens, heads, D, generator=g).to(dtype)
    src_ids = torch.tensor([2, 0])
    src_slots = (src_ids.view(-1, 1) * large + torch.arange(large)).reshape(-1)
    staged = []  # per prefill rank: its pages, as its staging slots hold them
    for r in range(ranks):
        mine = slice(r * per_rank, (r + 1) * per_rank)
        src = torch.zeros(3, per_rank, large, 2 * D, dtype=dtype)
        _write(src, key[:, mine].contiguous(), value[:, mine].contiguous(), src_slots)
        staged.append([src[src_ids].reshape(2, -1).view(torch.uint8)])

    nb = -(-tokens // small)
    dst = torch.zeros(nb + 2, heads, small, 2 * D, dtype=dtype)
    dst_ids = np.arange(nb)[::-1] + 2
    start, end = small, tokens - 1
    t = np.arange(tokens).reshape(2, large)
    slots = np.where((t >= start) & (t < end), dst_ids[t // small] * small + t % small, -1)
    spec = FullAttentionSpec(block_size=small, num_kv_heads=heads, head_size=D, dtype=dtype)
    layers = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=nb + 2
    )
    repacker = CpuAttnRepacker(layers, {"l0": dst})
    before_hit = dst[int(dst_ids[0])].clone()
    keep = torch.arange(start, end)
    want_slots = torch.from_numpy(dst_ids[keep.numpy() // small] * small + keep.numpy() % small)
    written = torch.from_numpy(dst_ids[1:].copy())
    for step, r in enumerate(reversed(range(ranks))):  # the last rank's pages arrive first
        repacker.split(0, staged[r], large, slots, (r * per_rank, per_rank))
        want = torch.zeros_like(dst)  # heads of the ranks split so far, the rest still 0
        done = slice(r * per_rank, heads)
        k, v = torch.zeros_like(key[keep]), torch.zeros_like(value[keep])
        k[:, done], v[:, done] = key[keep][:, done], value[keep][:, done]
        _write(want, k, v, want_slots)
        assert torch.equal(dst[written].view(torch.uint8), want[written].view(torch.uint8)), step
    assert torch.equal(dst[int(dst_ids[0])], before_hit)


def test_split_of_a_head_slice_refuses_heads_outside_the_layer():
    from kvbridge.connector.vllm.packing import CpuAttnRepacker
    from kvbridge.layouts.errors import KVBridgeError

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    config = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=NB
    )
    repacker = CpuAttnRepacker(config, {"l0": torch.zeros(NB, H, BS, 2 * D)})
    pages = [torch.zeros(1, 2 * 64 * D * 4, dtype=torch.uint8)]
    with pytest.raises(KVBridgeError, match=r"heads 1\.\.2 are not among 2"):
        repacker.split(0, pages, 64, np.zeros((1, 64), dtype=np.int64), (1, 2))


def test_an_fp8_caches_packing_names_the_instruction_set_of_the_models_dtype():
    """uint8 pages say neither the model's dtype nor the fp8 format: the id is the kernel
    vLLM runs for them (a bf16 model on AMX writes fp8 pages in its AMX order)."""
    if not _fp8_supported():
        pytest.skip("fp8 KV needs AVX-512 or AMX")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.uint8)
    config = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=NB
    )
    tensors = {"l0": torch.zeros(NB, H, BS, 2 * D, dtype=torch.uint8)}
    for source in (torch.float32, torch.bfloat16):
        got = block_packing(config, tensors, source=source, cache_dtype="fp8")
        assert got == "vllm-cpu-attn:" + _get_attn_isa(source, BS, D, "fp8"), source
