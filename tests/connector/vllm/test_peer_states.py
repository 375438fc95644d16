"""Peer states and failures by reason through vLLM's stats: a decode whose secret differs
from its prefill's shows the prefill as bad_secret (connector.vllm.scheduler_side, stats)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.common.signing import ParamsSigner
from kvbridge.connector.vllm.scheduler_side import VLLMSchedulerSide
from kvbridge.connector.vllm.stats import PEER_FAILURES, PEER_STATES, KVBridgeStats, PeerDelta
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.specs import FullAttentionSpec

pytestmark = pytest.mark.vllm

PREFILL_SECRET = b"p" * 32
DECODE_SECRET = "d" * 32


@dataclass
class _Request:
    request_id: str
    kv_transfer_params: dict[str, Any]
    prompt_token_ids: list[int]


def _decode() -> VLLMSchedulerSide:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=8
    )
    config = KVTransferConfig.from_dict(
        {"kv_role": "kv_consumer", "engine_id": "d", "secret": DECODE_SECRET}
    )
    return VLLMSchedulerSide(config, kv)


def _request(rid: str) -> _Request:
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="prefill-0",
        remote_host="10.0.0.5",
        remote_port=5600,
        remote_block_ids=[[3, 4, 5, 6]],
        remote_block_size=32,
        num_tokens=100,
        resume_tokens=99,
        remote_request_id=f"p-{rid}",
    )
    signed = ParamsSigner(PREFILL_SECRET).sign(params, ttl_s=30)
    return _Request(rid, signed.to_dict(), list(range(100)))


def test_params_signed_with_another_secret_mark_the_prefill_bad_secret_once(caplog) -> None:
    side = _decode()
    with caplog.at_level(logging.DEBUG, logger="kvbridge.connector.vllm.scheduler_side"):
        for i in range(3):
            assert side.get_num_new_matched_tokens(_request(f"r{i}"), 0) == (0, False)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "peer 10.0.0.5:5600 (engine prefill-0) is bad_secret" in errors[0]
    assert "set the same `secret`" in errors[0]
    data = side.stats().data
    assert data[PEER_STATES] == {"10.0.0.5:5600": "bad_secret"}
    assert data[PEER_FAILURES] == {"bad_secret": 3}
    assert data["bad_params"] == 3
    assert PEER_STATES not in side.stats().data  # unchanged: not reported again


def test_reports_merge_states_and_add_failures() -> None:
    a = KVBridgeStats(data={PEER_STATES: {"p:1": "ready"}, PEER_FAILURES: {"unreachable": 1}})
    b = KVBridgeStats(data={PEER_STATES: {"p:1": "bad_secret"}, PEER_FAILURES: {"unreachable": 2}})
    merged = a.aggregate(b).data
    assert merged[PEER_STATES] == {"p:1": "bad_secret"}
    assert merged[PEER_FAILURES] == {"unreachable": 3}
    assert a.aggregate(b).reduce() == {"peer_failures_unreachable": 3}


def test_peer_delta_reports_changes_only() -> None:
    delta = PeerDelta()
    assert delta.take({"p:1": "connecting"}, {}) == {PEER_STATES: {"p:1": "connecting"}}
    assert delta.take({"p:1": "connecting"}, {}) == {}
    assert delta.take({"p:1": "unreachable"}, {"unreachable": 1}) == {
        PEER_STATES: {"p:1": "unreachable"},
        PEER_FAILURES: {"unreachable": 1},
    }
