"""FlashInfer and the MLA backends' caches, from vLLM 0.32's own classes and allocation.

``test_vllm_allocation`` covers the backends whose modules import on vLLM's CPU build; this
file covers the rest of vLLM's registry that a dense-attention model can pick: FlashInfer
(and its Triton composite) and every dense MLA backend, loaded by ``backends.load`` (the
narrow, recorded stand-ins their modules need to import here). For every layout each backend
accepts, block sizes 16 to 128, kernel blocks smaller than manager blocks where the backend
declares them, and an fp8 cache where the backend takes one, kvbridge adopts what vLLM would
pass ``register_kv_caches`` and reads every token's K|V per head (MLA: the latent, one
"head" of ``kv_lora_rank + qk_rope_head_dim``) where vLLM's own views keep it, or it refuses
with a typed error that names what to change. Two pairs move between OS processes with real
NIXL through ``test_vllm_pairs``' harness.
"""

from __future__ import annotations

import pytest
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

import tests.vllm_layouts.test_vllm_pairs as pairs
from kvbridge.connector.common.config import ConfigError
from kvbridge.examples.vllm.allocation import KVCacheLayout, Model, allocate, backend
from kvbridge.examples.vllm.attention_backends import (
    SHIMS,
    BackendImportError,
    class_path,
    import_cause,
    load,
)
from kvbridge.examples.vllm.layout_peer import SideSpec
from kvbridge.layouts.arrangement import HeadOrder
from tests.vllm_layouts.test_vllm_allocation import BLOCK_SIZES, adopt, check_every_token

pytestmark = pytest.mark.vllm

# DeepSeek-V3's MLA: vLLM's MLAAttention caches kv_lora_rank + qk_rope_head_dim per token
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64
MLA_HEAD = KV_LORA_RANK + QK_ROPE_HEAD_DIM
FLASHINFER = ("FLASHINFER", "TRITON_FLASHINFER")
# dense MLA backends that test_vllm_allocation does not cover (TRITON_MLA, FLASHMLA it does)
MLA = (
    "FLASHINFER_MLA",
    "CUTLASS_MLA",
    "FLASH_ATTN_MLA",
    "ROCM_AITER_MLA",
    "ROCM_AITER_TRITON_MLA",
    "TOKENSPEED_MLA",
    "CPU_MLA",
    "AMX_MLA",
    # sparse MLA (DeepSeek V3.2): the latent cache; the indexer's own cache is not covered
    "FLASHMLA_SPARSE",
    "FLASHINFER_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_SM120",
    "FLASHINFER_MLA_SPARSE_SM90",
    "FLASH_ATTN_MLA_SPARSE",
    "ROCM_AITER_MLA_SPARSE",
    "XPU_MLA_SPARSE",
)
NAMES = FLASHINFER + MLA


def model(name: str, kv_cache_dtype: str = "auto") -> Model:
    """The model's layers as vLLM's would declare them under ``--kv-cache-dtype``."""
    if name in MLA:  # vLLM's MLAAttention.get_kv_cache_spec builds the latent spec
        return Model(mla=True, head_size=MLA_HEAD, mla_kv_cache_dtype=kv_cache_dtype)
    dtype = kv_cache_dtype_str_to_dtype(kv_cache_dtype, None)  # vLLM's (fp8: one byte)
    return Model(head_size=128, dtype=dtype)  # FlashInfer's smallest head size is 64


def expected_kernel_block(name: str, layout: KVCacheLayout, block_size: int) -> int | None:
    """The kernel block size the backend's declaration admits for ``block_size`` (None: no
    divisor of it is declared); block-outermost caches never split their blocks."""
    if layout.is_block_outermost:
        return block_size
    declared = backend(name).get_supported_kernel_block_sizes()
    fits = [
        s if isinstance(s, int) else block_size
        for s in declared
        if (isinstance(s, int) and block_size % s == 0)
        or (isinstance(s, MultipleOf) and block_size % s.base == 0)
    ]
    return block_size if block_size in fits else max(fits, default=None)


def test_each_backend_needs_exactly_its_recorded_stand_ins():
    """The shims are no wider than needed: each named module fails here for the recorded
    cause (unless its dependency got installed), and loads vLLM's own class."""
    for name in NAMES:
        cause = import_cause(name)
        if name in SHIMS and cause is not None:
            assert SHIMS[name].cause in cause, (name, cause)
        else:
            assert cause is None, (name, cause)
        cls = load(name)
        assert ".".join(class_path(name)) == f"{cls.__module__}.{cls.__qualname__}"


def test_a_backend_vllm_does_not_ship_fails_loudly():
    with pytest.raises(BackendImportError, match="no attention backend named NO_SUCH"):
        load("NO_SUCH")
    # vLLM 0.32's registry names a module it does not ship
    with pytest.raises(BackendImportError, match=r"no_attention \(NO_ATTENTION\)"):
        load("NO_ATTENTION")


CASES = [
    (name, layout, bs)
    for name in NAMES
    for layout in get_supported_kv_cache_layouts([load(name)])
    for bs in BLOCK_SIZES
]


@pytest.mark.parametrize(("backend_name", "layout", "block_size"), CASES, ids=str)
def test_backend_layout_block_size_reads_every_token(backend_name, layout, block_size):
    kb = expected_kernel_block(backend_name, layout, block_size)
    if kb is None:
        with pytest.raises(ValueError, match=f"No common block size for {block_size}"):
            allocate(
                model(backend_name), block_size=block_size, layout=layout, backend_name=backend_name
            )
        return
    if layout is KVCacheLayout.LHBNC and kb < block_size and backend_name not in MLA:
        # heads outside blocks: split kernel blocks leave no dense page (one latent head: do)
        with pytest.raises(ValueError, match=r"LHBNC\) does not store blocks as dense"):
            allocate(
                model(backend_name), block_size=block_size, layout=layout, backend_name=backend_name
            )
        return
    a = allocate(
        model(backend_name), block_size=block_size, layout=layout, backend_name=backend_name
    )
    assert a.kernel_block_sizes == [kb]
    view = next(iter(a.kv_caches.values()))  # [kernel blocks, H, kb, C]
    if backend_name in MLA:
        assert (view.shape[1], view.shape[3]) == (1, MLA_HEAD)  # one latent "head"
    else:
        assert (view.shape[1], view.shape[3]) == (4, 2 * 128)  # K|V in one content axis
    buffers = adopt(a)
    fmt = buffers.format
    assert fmt.cross_layer is layout.is_block_outermost
    assert fmt.kernel_block_size_for(block_size) == kb
    head_outer = layout is KVCacheLayout.BHLNC and backend_name not in MLA
    assert (fmt.heads is HeadOrder.IN_CHUNK) is head_outer
    heads_outside_blocks = layout is KVCacheLayout.LHBNC and backend_name not in MLA
    assert (fmt.heads is HeadOrder.OUTER) is heads_outside_blocks
    check_every_token(a, buffers)


FP8_CASES = [
    (name, layout)
    for name in NAMES
    if "fp8" in load(name).supported_kv_cache_dtypes
    for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BHLNC)
]


@pytest.mark.parametrize(("backend_name", "layout"), FP8_CASES, ids=str)
def test_fp8_cache_one_byte_elements(backend_name, layout):
    a = allocate(
        model(backend_name, "fp8"), block_size=128, layout=layout, backend_name=backend_name
    )
    assert next(iter(a.kv_caches.values())).element_size() == 1
    b = adopt(a)
    assert b.config.groups[0].spec.itemsize == 1
    check_every_token(a, b)


def test_sparse_mla_packed_fp8_tokens_are_refused_by_name():
    """FlashMLA sparse's fp8_ds_mla packs NoPE + RoPE + scales into an opaque 656-byte
    token (vLLM's spec says so in state_content_bytes): kvbridge refuses it, typed, and
    names the vLLM flag that avoids it."""
    a = allocate(
        model("FLASHMLA_SPARSE", "fp8_ds_mla"),
        block_size=64,
        layout=KVCacheLayout.LBHNC,
        backend_name="FLASHMLA_SPARSE",
    )
    assert next(iter(a.kv_caches.values())).shape[-1] == 656
    with pytest.raises(
        ConfigError, match=r"state_content_bytes=656 is not supported.*--kv-cache-dtype auto"
    ):
        adopt(a)


def test_flashinfer_on_blackwell_declares_head_major_layouts(monkeypatch):
    """On SM100 FlashInfer's trtllm-gen kernels take head-major blocks only: vLLM's own
    declaration, asked with the device capability a B200 reports."""
    monkeypatch.setattr(
        current_platform, "get_device_capability", lambda *_: DeviceCapability(10, 0)
    )
    layouts = get_supported_kv_cache_layouts([load("FLASHINFER")])
    assert layouts == [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC]
    for layout in layouts:
        a = allocate(model("FLASHINFER"), block_size=128, layout=layout, backend_name="FLASHINFER")
        check_every_token(a, adopt(a))


# Two OS processes, real NIXL, the adapter's register_kv_caches on both sides:
# test_vllm_pairs' harness and assertions, with these backends' caches.
host = pairs.host
ranks = pairs.ranks
PAIRS = [
    (
        SideSpec("FLASHINFER", "LBHNC", 128, head_size=128),  # kernel blocks of 64, HND
        SideSpec("FLASH_ATTN", "LBNHC", 64, head_size=128),
        "pull",
    ),
    (
        SideSpec("FLASHINFER", "BLNHC", 16, head_size=128),
        SideSpec("FLASH_ATTN", "BHLNC", 16, head_size=128, tp_size=2),
        "push",
    ),
    (
        SideSpec("CUTLASS_MLA", "LBHNC", 128, mla=True, head_size=MLA_HEAD),
        SideSpec("FLASHINFER_MLA", "BLHNC", 32, mla=True, head_size=MLA_HEAD),
        "pull",
    ),
    (
        SideSpec("FLASHINFER_MLA", "LBHNC", 128, mla=True, head_size=MLA_HEAD),  # kernel 64
        SideSpec("TRITON_MLA", "LBHNC", 32, mla=True, head_size=MLA_HEAD),
        "push",
    ),
]
# A source whose kernel blocks are split finer by decode's blocks, read natively (vLLM's
# prefill may not rewrite its blocks): decode's chunks are not evenly spaced in the
# source's block (tokens 0..31 and 32..63 of a 64-token kernel block lie 32 rows apart, the
# next kernel block a whole kernel block further), so the plan lists each chunk's start
# (handshake/native_read.py). Once refused at load time ("chunks are not evenly spaced").
KERNEL_SPLIT_PAIRS = [
    (
        SideSpec("FLASHINFER", "LBHNC", 128, head_size=128),  # kernel blocks of 64
        SideSpec("FLASH_ATTN", "LBHNC", 32, head_size=128),
        "pull",
    ),
    (
        SideSpec("FLASHINFER", "LBHNC", 128, head_size=128),
        SideSpec("FLASH_ATTN", "LBNHC", 32, head_size=128),
        "push",
    ),
    (
        SideSpec("ROCM_AITER_FA", "LBHNC", 64, head_size=128),  # kernel blocks of 32
        SideSpec("FLASH_ATTN", "LBNHC", 16, head_size=128),
        "pull",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize("case", PAIRS, ids=[pairs._label(c) for c in PAIRS])
def test_pair_moves_every_token_byte_for_byte(ranks, case) -> None:
    pairs.test_pair_moves_every_token_byte_for_byte(ranks, case)


@pytest.mark.integration
@pytest.mark.parametrize(
    "case", KERNEL_SPLIT_PAIRS, ids=[pairs._label(c) for c in KERNEL_SPLIT_PAIRS]
)
def test_kernel_split_source_into_smaller_blocks(ranks, case) -> None:
    pairs.test_pair_moves_every_token_byte_for_byte(ranks, case)
