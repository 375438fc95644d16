"""The vLLM scheduler-side adapter on vLLM-shaped requests (no engine needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from connector.config import KVTransferConfig
from connector.vllm.scheduler_side import VLLMSchedulerSide
from layouts.groups import KVCacheConfig, KVCacheGroup
from layouts.specs import FullAttentionSpec

pytestmark = pytest.mark.vllm


@dataclass
class _Status:
    name: str


@dataclass
class _Request:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(100)))
    status: _Status = field(default_factory=lambda: _Status("FINISHED_LENGTH_CAPPED"))


def _side() -> VLLMSchedulerSide:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=8
    )
    config = KVTransferConfig.from_dict({"kv_role": "kv_both", "engine_id": "e"})
    return VLLMSchedulerSide(config, kv)


def test_bad_params_are_counted_once_per_request_and_served_locally():
    side = _side()
    req = _Request("r1", {"do_remote_prefill": True, "remote_blocks": [[1]]})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again
    assert side.request_finished(req, [[1, 2]]) == (False, None)
    assert side.counters["bad_params"] == 1
