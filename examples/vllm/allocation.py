"""What vLLM's GPU worker hands ``register_kv_caches``, built by vLLM's own code on CPU.

The path of ``GPUModelRunner.initialize_kv_cache`` (vLLM 0.32), step by step:

    backends' supported_kv_cache_layouts -> get_supported_kv_cache_layouts
    resolve_kv_cache_layout (the connector's get_required_kvcache_layout is asked here)
    get_kv_cache_groups -> get_kv_cache_config_from_groups     (engine core)
    customize_attention_spec + prepare_kernel_block_sizes        (worker)
    allocate_kv_cache(config, device, layout, kernel_block_sizes)

Nothing here types a shape or a stride: a vLLM upgrade that changes a layout changes
these tensors, and the tests that compare them byte for byte fail.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import vllm.config  # vLLM's backends import it first (circular imports otherwise)
import vllm.model_executor.layers.attention  # noqa: F401
from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import (
    AttentionGroup,
    allocate_kv_cache,
    customize_attention_spec,
    prepare_kernel_block_sizes,
)

from kvbridge.examples.vllm import attention_backends as backends

# Backends whose class imports on vLLM's CPU build. Any other name vLLM's registry knows
# (FlashInfer, CUTLASS MLA, FlashAttention MLA, ...) is loaded by ``backends.load``, with
# the narrow stand-ins its module needs to import here.
BACKENDS = {
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
    "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend",
    "FLEX_ATTENTION": "vllm.v1.attention.backends.flex_attention:FlexAttentionBackend",
    "ROCM_ATTN": "vllm.v1.attention.backends.rocm_attn:RocmAttentionBackend",
    "ROCM_AITER_FA": "vllm.v1.attention.backends.rocm_aiter_fa:AiterFlashAttentionBackend",
    "CPU_ATTN": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
    "TRITON_MLA": "vllm.v1.attention.backends.mla.triton_mla:TritonMLABackend",
    "FLASHMLA": "vllm.v1.attention.backends.mla.flashmla:FlashMLABackend",
}
MLA_BACKENDS = ("TRITON_MLA", "FLASHMLA")


def backend(name: str) -> Any:
    if name not in BACKENDS:
        return backends.load(name)
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class Model:
    """A tiny model's per-layer specs (vLLM's spec classes, as its layers declare them)."""

    num_layers: int = 3
    num_kv_heads: int = 4
    head_size: int = 16
    dtype: torch.dtype = torch.float16
    sliding_window: int | None = None  # every other layer sliding (hybrid) when set
    mla: bool = False
    # set: the MLA layers' spec comes from vLLM's own MLAAttention.get_kv_cache_spec for
    # this --kv-cache-dtype (e.g. "fp8_ds_mla": opaque 656-byte tokens); dtype is then unused
    mla_kv_cache_dtype: str | None = None
    mamba_layers: int = 0  # Mamba2-style state layers after the attention layers

    def specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        out: dict[str, KVCacheSpec] = {}
        for i in range(self.num_layers):
            name = f"model.layers.{i}.self_attn.attn"
            if self.mla and self.mla_kv_cache_dtype is not None:
                out[name] = mla_layer_spec(self.head_size, self.mla_kv_cache_dtype, block_size)
            elif self.mla:
                out[name] = MLAAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=self.head_size,
                    dtype=self.dtype,
                )
            elif self.sliding_window is not None and i % 2 == 1:
                out[name] = SlidingWindowSpec(
                    block_size=block_size,
                    num_kv_heads=self.num_kv_heads,
                    head_size=self.head_size,
                    dtype=self.dtype,
                    sliding_window=self.sliding_window,
                )
            else:
                out[name] = FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=self.num_kv_heads,
                    head_size=self.head_size,
                    dtype=self.dtype,
                )
        for i in range(self.mamba_layers):
            out[f"model.layers.{self.num_layers + i}.mixer"] = mamba2_layer_spec(
                block_size, self.dtype
            )
        return out


def mamba2_layer_spec(block_size: int, dtype: torch.dtype, tp_size: int = 1) -> MambaSpec:
    """A Mamba2 mixer's spec as vLLM's layer builds it: state shapes and dtypes from
    vLLM's own calculators (conv state ``(conv_kernel - 1, conv_dim)``, SSM state
    ``(heads, head_dim, state_size)``; an fp32 SSM state as vLLM's CPU build resets it)."""
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp_size,
        intermediate_size=128,
        n_groups=1,
        num_heads=4,
        head_dim=32,
        state_size=16,
        conv_kernel=4,
    )
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(dtype, "auto", "float32")
    return MambaSpec(block_size=block_size, shapes=shapes, dtypes=dtypes)


def mla_layer_spec(head_size: int, kv_cache_dtype: str, block_size: int) -> KVCacheSpec:
    """What vLLM's ``MLAAttention.get_kv_cache_spec`` returns for a dense MLA layer caching
    ``head_size`` (kv_lora_rank + qk_rope_head_dim) under ``--kv-cache-dtype``: vLLM's
    method, run on the attributes it reads (a layer needs a whole model to construct)."""
    # a dense layer: no sliding window, no sparse indexer
    layer = SimpleNamespace(sliding_window=None, indexer=None, non_causal_multi_token_decode=False)
    layer.kv_cache_dtype, layer.head_size = kv_cache_dtype, head_size
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size), model_config=None)
    return MLAAttention.get_kv_cache_spec(layer, config)


@dataclass
class Allocation:
    """One worker's cache as vLLM allocated it."""

    layout: KVCacheLayout
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    kernel_block_sizes: list[int]
    kv_caches: dict[str, torch.Tensor]  # what register_kv_caches receives


def resolve_layout(backend_names: list[str], requested: str | None) -> KVCacheLayout:
    """vLLM's pick: the backends' common layouts, the request first when it is one."""
    candidates = get_supported_kv_cache_layouts([backend(n) for n in backend_names])
    if requested is not None and KVCacheLayout[requested] in candidates:
        return KVCacheLayout[requested]
    return candidates[0]


def allocate(
    model: Model,
    *,
    block_size: int,
    layout: KVCacheLayout,
    backend_name: str,
    num_blocks: int = 12,
) -> Allocation:
    """Run vLLM's engine-core and worker allocation for ``model`` on CPU memory."""
    vc = VllmConfig(cache_config=CacheConfig(block_size=block_size))
    vc.cache_config.kv_cache_layout = layout.name
    specs = model.specs(block_size)
    groups = get_kv_cache_groups(vc, specs)
    # enough memory for num_blocks blocks of every group's layers
    probe = get_kv_cache_config_from_groups(vc, groups, 1 << 40)
    bytes_per_block = probe.kv_cache_tensors[0].size // probe.num_blocks
    config = get_kv_cache_config_from_groups(vc, groups, bytes_per_block * num_blocks)
    attn_backend = backend(backend_name)
    attn_groups = []
    for gid, g in enumerate(config.kv_cache_groups):
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec):
            attn_groups.append([])
            continue
        spec = customize_attention_spec(attn_backend, spec)
        attn_groups.append(
            [
                AttentionGroup(
                    backend=attn_backend,
                    layer_names=list(g.layer_names),
                    kv_cache_spec=spec,
                    kv_cache_group_id=gid,
                )
            ]
        )
    kernel_block_sizes = prepare_kernel_block_sizes(config, attn_groups)
    config.kv_cache_layout = layout.name
    kv_caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)
    return Allocation(layout, vc, config, kernel_block_sizes, kv_caches)
