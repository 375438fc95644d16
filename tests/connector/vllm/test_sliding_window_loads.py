"""Sliding-window loads on vLLM 0.32's own block accounting, every prompt length across two
windows, every block-size pair of the heterogeneity matrix.

Both of kvbridge's vLLM scheduler sides run against vLLM's ``KVCacheManager`` (a full and a
sliding-window group, as tiny-gemma3), called as vLLM's scheduler calls it::

    prefill  on_new_request; allocate_slots for the tokens it computes; at finish, as
             Scheduler._connector_finished: remove_skipped_blocks on the computed tokens
             (frees the blocks wholly out of the window), get_block_ids_for_computed_tokens
             -> request_finished -> params
    decode   get_num_new_matched_tokens; allocate_slots with the external tokens (null
             blocks before the window); update_state_after_alloc -> the load;
             group_rows -> the rows each group moves

Every prompt of ``N >= 2`` tokens loads ``N - 1``; the window group's rows fill exactly the
decode blocks vLLM's window for token ``N - 1`` reads (its ``get_num_skipped_tokens``) and
read only prefill blocks vLLM still holds.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.vllm.scheduler_side import VLLMSchedulerSide
from kvbridge.connector.vllm.step_metadata import KVBridgeHandshakeMetadata
from kvbridge.connector.worker.rows import group_rows
from kvbridge.handshake.plan import negotiate
from kvbridge.handshake.plan_model import GroupPlan
from kvbridge.layouts import specs as kb
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from tests.handshake.plan_harness import cache_format, make_side

pytestmark = pytest.mark.vllm

# docs/heterogeneity.md: 16/32/64/128 any pair, and the non-multiples either way
MATRIX = [(p, d) for p in (16, 32, 64, 128) for d in (16, 32, 64, 128)] + [
    pair for p, d in ((80, 32), (96, 64), (528, 64), (48, 32)) for pair in ((p, d), (d, p))
]
WINDOWS = (64, 100)  # tiny-gemma3's, and one no block size divides
NULL_BLOCK_ID = 0  # vLLM's null block


def _kvbridge_groups(block_size: int, window: int) -> KVCacheConfig:
    attn = dict(block_size=block_size, num_kv_heads=2, head_size=4, dtype=torch.float16)
    return KVCacheConfig(
        groups=(
            KVCacheGroup(
                group_id=0, layer_names=("g0.a", "g0.b"), spec=kb.FullAttentionSpec(**attn)
            ),
            KVCacheGroup(
                group_id=1,
                layer_names=("g1.a", "g1.b"),
                spec=kb.SlidingWindowSpec(**attn, sliding_window=window),
            ),
        ),
        num_blocks=64,
    )


def _vllm_manager(block_size: int, window: int, max_tokens: int) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    attn = dict(block_size=block_size, num_kv_heads=2, head_size=4, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=2 * -(-max_tokens // block_size) + 2,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["g0.a", "g0.b"], FullAttentionSpec(**attn)),
            KVCacheGroupSpec(["g1.a", "g1.b"], SlidingWindowSpec(**attn, sliding_window=window)),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=4 * max_tokens,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=False,
    )


def _side(role: str, block_size: int, window: int) -> VLLMSchedulerSide:
    config = KVTransferConfig.from_dict({"kv_role": role, "engine_id": role, "kv_port": 0})
    side = VLLMSchedulerSide(config, _kvbridge_groups(block_size, window))
    side.set_handshake_metadata({0: KVBridgeHandshakeMetadata(0, 41000)})
    return side


def _request(rid: str, num_tokens: int, params: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=16, extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(num_tokens)), sampling, None)


def _prefill(side: VLLMSchedulerSide, mgr: Any, n: int) -> tuple[dict[str, Any], list[set[int]]]:
    """An ``n``-token prompt through prefill: its params, and per group the blocks vLLM
    still held when it handed them to the connector."""
    from vllm.v1.request import RequestStatus

    req = _request(f"p{n}", n, {"do_remote_decode": True})
    side.on_new_request(req)
    computed = req.num_prompt_tokens
    assert mgr.allocate_slots(req, computed) is not None
    req.num_computed_tokens = computed
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    # Scheduler._connector_finished
    mgr.remove_skipped_blocks(req.request_id, computed, num_prompt_tokens=computed)
    block_ids = mgr.get_block_ids_for_computed_tokens(req.request_id, computed)
    delay, params = side.request_finished(req, block_ids)
    mgr.free(req)  # kvbridge holds them (delay); the ids are all this test reads
    assert delay and params is not None, n
    return params, [{b for b in ids if b != NULL_BLOCK_ID} for ids in block_ids]


def _writer_blocks(g: GroupPlan, rows: Any) -> set[int]:
    out: set[int] = set()
    for i, _, writer in rows.rows:
        m = g.streams[i].num_pieces
        out |= set((writer // m // g.remote_chunks_per_block).tolist())
    if rows.staged is not None:
        s = rows.staged
        out |= set(np.asarray(s.writer_ids)[np.asarray(s.blocks) - s.writer_first].tolist())
    return out


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("prefill_bs", "decode_bs"), MATRIX)
def test_every_prompt_past_the_window_loads_all_but_its_last_token(
    prefill_bs: int, decode_bs: int, window: int, caplog: pytest.LogCaptureFixture
) -> None:
    max_tokens = 2 * window + 2
    prefill, decode = (
        _side("kv_producer", prefill_bs, window),
        _side("kv_consumer", decode_bs, window),
    )
    p_mgr = _vllm_manager(prefill_bs, window, max_tokens)
    d_mgr = _vllm_manager(decode_bs, window, max_tokens)
    d_window = d_mgr.coordinator.single_type_managers[1]  # vLLM's SlidingWindowManager
    fmt = cache_format("NHD", False)
    num_blocks = 2 * -(-max_tokens // min(prefill_bs, decode_bs)) + 2
    plan = negotiate(
        make_side("d", decode_bs, fmt, "FS", num_blocks).layout,
        make_side("p", prefill_bs, fmt, "FS", num_blocks).layout,
    )
    d_specs = [g.spec for g in decode.sched.kv_cache_config.groups]
    caplog.set_level(logging.WARNING)
    caplog.clear()  # the sides' unsigned-params warnings
    for n in range(1, max_tokens):
        params, held = _prefill(prefill, p_mgr, n)
        req = _request(f"d{n}", n, params)
        count, is_async = decode.get_num_new_matched_tokens(req, 0)
        assert (count, is_async) == ((n - 1, True) if n > 1 else (0, False)), n
        if not count:
            continue
        assert d_mgr.allocate_slots(
            req, 0, num_external_computed_tokens=count, delay_cache_blocks=True
        )
        decode.update_state_after_alloc(req, d_mgr.get_blocks(req.request_id), count)
        [load] = decode.build_connector_meta().meta.reqs_to_load
        end = load.end_token
        assert (load.start_token, end) == (0, n - 1)
        first_token = {0: 0, 1: d_window.get_num_skipped_tokens(end)}  # what token end reads
        for g, spec in enumerate(d_specs):
            rows = group_rows(
                plan.groups[g],
                spec,
                np.asarray(load.local_block_ids[g]),
                np.asarray(params["remote_block_ids"][g]),
                params["remote_first_block"][g],
                load.start_token,
                end,
            )
            local = load.local_block_ids[g]
            want = local[first_token[g] // decode_bs : -(-end // decode_bs)]
            touched = () if rows.touched is None else tuple(np.unique(rows.touched).tolist())
            if rows.staged is None:
                assert touched == tuple(sorted(want)), (n, g)
            assert NULL_BLOCK_ID not in want and min(want) > 0, (n, g)
            assert _writer_blocks(plan.groups[g], rows) <= held[g], (n, g)
        d_mgr.free(req)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert decode.stats().data.get("loads_unserved", 0) == 0


def test_a_window_prefill_did_not_keep_is_a_counted_warning_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A prefill that computed the whole prompt (another connector shortened nothing, a
    prompt given as embeddings): at ``N = w + bs - 1`` vLLM freed the block of token
    ``N - w`` at finish, and decode computes the prompt itself, saying why."""
    from vllm.v1.request import RequestStatus

    bs, window = 32, 64
    n = window + bs - 1
    prefill, decode = _side("kv_producer", bs, window), _side("kv_consumer", bs, window)
    mgr = _vllm_manager(bs, window, 2 * window)
    req = _request("p", n, {"do_remote_decode": True})  # not shortened: no on_new_request
    assert mgr.allocate_slots(req, n) is not None
    req.num_computed_tokens = n
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    mgr.remove_skipped_blocks("p", n, num_prompt_tokens=n)
    block_ids = mgr.get_block_ids_for_computed_tokens("p", n)
    assert block_ids[1][0] == NULL_BLOCK_ID  # tokens 0..31 freed; decode needs token 31
    _, params = prefill.request_finished(req, block_ids)
    assert params["remote_first_block"] == [0, 1]
    caplog.set_level(logging.WARNING)
    caplog.clear()
    dreq = _request("d", n, params)
    assert decode.get_num_new_matched_tokens(dreq, 0) == (0, False)
    assert decode.get_num_new_matched_tokens(dreq, 0) == (0, False)  # asked again: once
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "cannot serve its load" in record.getMessage()
    assert "group 1 (sliding window 64): tokens [31, 94)" in record.getMessage()
    assert "prefill kept the window from block 1" in record.getMessage()
    assert decode.stats().data["loads_unserved"] == 1
