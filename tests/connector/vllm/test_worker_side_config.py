"""The adapter's worker side refuses, by name, what cannot apply under vLLM."""

from __future__ import annotations

import pytest
from vllm.config.kv_transfer import KVTransferConfig as VLLMTransferConfig

from kvbridge.connector.common.config import ConfigError
from kvbridge.connector.vllm import translate
from kvbridge.connector.vllm.worker_side import VLLMWorkerSide
from kvbridge.examples.vllm.layout_peer import SideSpec, build_allocation


def test_rewrite_on_save_is_refused_by_name_not_dropped():
    """vLLM's prefix cache may read a kept request's blocks: kvbridge never rewrites them
    in place there, so ``rewrite_on_save`` could not apply. Before, it was dropped
    without a word."""
    allocation = build_allocation(SideSpec("FLASH_ATTN", "LBNHC", 16))
    config = VLLMTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_producer",
        engine_id="prefill",
        kv_port=0,
        kv_connector_extra_config={"kv_ip": "127.0.0.1", "extra": {"rewrite_on_save": True}},
    )
    with pytest.raises(ConfigError, match="rewrite_on_save=true cannot apply under vLLM"):
        VLLMWorkerSide(
            translate.transfer_config(config),
            translate.kv_cache_config(allocation.kv_cache_config),
            model_name="tiny",
            total_kv_heads=4,
            layout_hint=None,
            rank=0,
            tp_size=1,
            cpu_attention=False,
        )
