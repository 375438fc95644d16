"""kvbridge asks vLLM for the layout that moves best, through vLLM's own resolution.

``KVBridgeConnector.get_required_kvcache_layout`` is what vLLM 0.32's engine core asks
(``get_kv_connector_cache_layout`` -> ``resolve_kv_cache_layout``), with real model
configs of the tiny generated checkpoints.
"""

from __future__ import annotations

import pytest
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge.connector.vllm.translate import preferred_layout
from kvbridge.examples.vllm.allocation import backend, get_supported_kv_cache_layouts
from kvbridge.examples.vllm.models import ensure_model

pytestmark = pytest.mark.vllm


def _config(model: str, block_size: int = 16) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(ensure_model(model)), dtype="float32"),
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBridgeConnector",
            kv_connector_module_path="kvbridge.connector.vllm",
            kv_role="kv_both",
        ),
    )


@pytest.fixture(scope="module")
def llama() -> VllmConfig:
    return _config("tiny-llama")


def test_gpu_asks_for_head_outer_cross_layer(llama):
    assert preferred_layout(llama, is_cpu=False) == "BHLNC"


def test_hybrid_and_large_blocks_ask_for_head_major_per_layer():
    assert preferred_layout(_config("tiny-gemma3"), is_cpu=False) == "LBHNC"
    assert preferred_layout(_config("tiny-llama", block_size=128), is_cpu=False) == "LBHNC"


def test_vllm_asks_the_connector_and_resolves_it():
    """On this CPU build vLLM's own call gets LBHNC (its CPU attention's only layout), and
    resolution keeps it; a GPU worker's FlashAttention candidates take kvbridge's BHLNC."""
    llama = _config("tiny-llama")  # resolution records its answer in this config
    assert get_kv_connector_cache_layout(llama) == "LBHNC"
    cpu = get_supported_kv_cache_layouts([backend("CPU_ATTN")])
    assert resolve_kv_cache_layout(llama, [[m.name for m in cpu]]) is KVCacheLayout.LBHNC
    fa = get_supported_kv_cache_layouts([backend("FLASH_ATTN")])
    assert KVCacheLayout[preferred_layout(llama, is_cpu=False)] in fa
