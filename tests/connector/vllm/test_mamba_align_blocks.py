"""The Mamba state block kvbridge hands over, on block lists from vLLM's own KV-cache manager.

Prefix caching puts a Mamba group in vLLM's "align" mode: the request's state blocks are
position-indexed, earlier columns nulled once skipped, and the running state in the
column of the last computed token (``cdiv(computed, block_size) - 1``, vLLM's
``mamba_utils.preprocess_mamba``). These tests take the block lists vLLM's
``KVCacheManager`` gives a chunked prefill (after ``remove_skipped_blocks``, as vLLM's
scheduler does before ``request_finished``) and a decode that loads ``E`` tokens
asynchronously, and check that kvbridge hands over, and loads into, exactly that column's
block, which must be a real one. A vLLM upgrade that moves the running state or nulls that
column fails here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.config import CacheConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import Request, RequestStatus

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.vllm import translate
from kvbridge.connector.vllm.scheduler_side import VLLMSchedulerSide
from kvbridge.connector.vllm.step_metadata import KVBridgeHandshakeMetadata
from kvbridge.examples.vllm.allocation import Model

pytestmark = pytest.mark.vllm

BLOCK = 64
NULL = 0  # vLLM's null block


class _Blocks:
    def __init__(self, ids: tuple[list[int], ...]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


@pytest.fixture
def vllm_config():
    """A Mamba2 hybrid's groups as vLLM's engine core builds them, "align" mode."""
    vc = VllmConfig(cache_config=CacheConfig(block_size=BLOCK))
    vc.cache_config.mamba_cache_mode = "align"
    vc.cache_config.kv_cache_layout = "LBHNC"
    specs = {
        name: replace(
            spec,
            mamba_cache_mode="align",
            # what vLLM's Mamba2 mixer declares (a checkpoint state at the replay boundary)
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=1,
        )
        if isinstance(spec, MambaSpec)
        else spec
        for name, spec in Model(num_layers=2, mamba_layers=2).specs(BLOCK).items()
    }
    groups = get_kv_cache_groups(vc, specs)
    probe = get_kv_cache_config_from_groups(vc, groups, 1 << 40)
    per_block = probe.kv_cache_tensors[0].size // probe.num_blocks
    return get_kv_cache_config_from_groups(vc, groups, per_block * 64)


def _manager(kv_cache_config) -> KVCacheManager:
    return KVCacheManager(
        kv_cache_config,
        max_model_len=1024,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
    )


def _side(kv_cache_config, role: str) -> VLLMSchedulerSide:
    config = KVTransferConfig.from_dict({"kv_role": role, "engine_id": role, "kv_port": 0})
    side = VLLMSchedulerSide(
        config,
        translate.kv_cache_config(kv_cache_config),
        single_block_groups=translate.single_block_groups(kv_cache_config),
    )
    side.set_handshake_metadata({0: KVBridgeHandshakeMetadata(0, 41000)})  # rank 0's port
    return side


def _request(rid: str, prompt: list[int], params: dict) -> Request:
    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params})
    return Request(
        rid, prompt, sampling, None, block_hasher=get_request_block_hasher(BLOCK, sha256)
    )


@pytest.mark.parametrize("num_prompt", [65, 121, 129, 200])
def test_prefill_hands_over_the_running_state_column_and_decode_loads_into_its_own(
    vllm_config, num_prompt
):
    groups = vllm_config.kv_cache_groups
    state = next(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec))
    assert translate.single_block_groups(vllm_config) == frozenset()  # align: positional

    # prefill: the state model's prompt is shortened to N - 1, computed in 64-token chunks
    manager, prefill = _manager(vllm_config), _side(vllm_config, "kv_producer")
    req = _request("p", list(range(10, 10 + num_prompt)), {"do_remote_decode": True})
    prefill.on_new_request(req)
    computed = num_prompt - 1
    assert req.num_prompt_tokens == computed
    while req.num_computed_tokens < computed:
        chunk = min(BLOCK, computed - req.num_computed_tokens)
        assert manager.allocate_slots(req, chunk) is not None
        req.num_computed_tokens += chunk
    manager.remove_skipped_blocks("p", computed, req.num_prompt_tokens)
    ids = manager.get_block_ids_for_computed_tokens("p", computed)
    running = ids[state][-(-computed // BLOCK) - 1]
    assert running != NULL
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = prefill.request_finished(req, ids)
    assert delay is True
    assert params["remote_block_ids"][state] == [running]
    assert params["remote_first_block"][state] == (computed - 1) // BLOCK

    # decode: the whole prompt, E = N - 1 tokens loaded asynchronously (vLLM allocates
    # the blocks before the load with no new tokens)
    manager, decode = _manager(vllm_config), _side(vllm_config, "kv_consumer")
    dreq = _request("d", list(range(2000, 2000 + num_prompt)), {})
    dreq.kv_transfer_params = KVTransferParams.from_dict(params).to_dict()
    assert decode.get_num_new_matched_tokens(dreq, 0) == (computed, True)
    manager.allocate_slots(dreq, 0, num_external_computed_tokens=computed, delay_cache_blocks=True)
    dids = manager.get_block_ids("d")
    decode.update_state_after_alloc(dreq, _Blocks(dids), computed)
    [load] = decode.build_connector_meta().meta.reqs_to_load
    # vLLM reads the state for the first computed token from column (E - 1) // block_size
    column = (computed - 1) // BLOCK
    assert dids[state][column] != NULL
    assert load.local_block_ids[state][-1] == dids[state][column]
