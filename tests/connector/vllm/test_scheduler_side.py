"""The vLLM scheduler-side adapter on vLLM-shaped requests (no engine needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.vllm.scheduler_side import VLLMSchedulerSide
from kvbridge.connector.vllm.step_metadata import KVBridgeHandshakeMetadata
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.specs import FullAttentionSpec

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


@dataclass
class _Blocks:
    ids: list[list[int]]

    def get_block_ids(self) -> list[list[int]]:
        return self.ids


def test_tp_ranks_reports_count_apart_and_one_failed_rank_recomputes_the_load():
    """vLLM aggregates the TP ranks' worker metadata into one: rank 0's load finished,
    rank 1's timed out, in the same step. The load is recomputed, not loaded."""
    from kvbridge.connector.common.metadata import LoadFailure, WorkerOutput
    from kvbridge.connector.common.params import KVTransferParams
    from kvbridge.connector.vllm.step_metadata import KVBridgeWorkerMetadata

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=8
    )
    config = KVTransferConfig.from_dict(
        {"kv_role": "kv_consumer", "engine_id": "d", "failure_policy": "recompute"}
    )
    side = VLLMSchedulerSide(config, kv, tp_size=2)
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_block_ids=[[3, 4, 5, 6]],
        remote_block_size=32,
        num_tokens=100,
        resume_tokens=99,  # prefill's resume point: every prompt token but the last
        remote_request_id="p-r1",
    )
    req = _Request("r1", params.to_dict())
    assert side.get_num_new_matched_tokens(req, 0) == (99, True)
    side.update_state_after_alloc(req, _Blocks([[3, 1, 2, 7]]), 99)  # 0: vLLM's null block
    [spec_out] = side.build_connector_meta().meta.reqs_to_load
    assert spec_out.request_id == "r1"
    failure = LoadFailure(
        request_id="r1", reason="timed out", invalid_block_ids=((3, 1, 2, 7),), num_valid_tokens=0
    )
    rank0 = KVBridgeWorkerMetadata(WorkerOutput(finished_recving=frozenset({"r1"})))
    rank1 = KVBridgeWorkerMetadata(WorkerOutput(failed_loads=(failure,)))
    both = rank0.aggregate(rank1)
    assert len(both.outputs) == 2
    side.update_connector_output(both)
    stats = side.stats().data
    assert stats.get("loads_recomputed") == 1
    assert not stats.get("loads_loaded")


def test_handshake_metadata_hands_every_rank_port_to_the_params():
    """vLLM gathers each worker's ``get_handshake_metadata`` into
    ``set_xfer_handshake_metadata``: a kv_port-0 prefill advertises the bound ports."""
    from kvbridge.connector.common.config import ConfigError
    from kvbridge.connector.vllm.step_metadata import KVBridgeHandshakeMetadata

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=8
    )
    config = KVTransferConfig.from_dict({"kv_role": "kv_producer", "engine_id": "p", "kv_port": 0})
    side = VLLMSchedulerSide(config, kv, tp_size=2)
    req = _Request("r1", {"do_remote_decode": True})
    # no ports yet: the request ends without params (logged), its blocks are not kept
    assert side.request_finished(req, [[1, 2, 3, 4]]) == (False, None)
    with pytest.raises(ConfigError, match=r"rank 1 of 2 \(pipeline stage 0, TP rank 1\)"):
        side.set_handshake_metadata({0: KVBridgeHandshakeMetadata(0, 41000)})
    side.set_handshake_metadata(
        {0: KVBridgeHandshakeMetadata(0, 41000), 1: KVBridgeHandshakeMetadata(1, 39000)}
    )
    delay, params = side.request_finished(
        _Request("r2", {"do_remote_decode": True}), [[1, 2, 3, 4]]
    )
    assert delay and params is not None
    assert (params["remote_port"], params["remote_ports"]) == (41000, [41000, 39000])


def test_pipeline_stages_advertise_every_stage_rank_and_its_layers():
    """PP 2 x TP 2: vLLM hands the metadata over keyed by (pp_rank, tp_rank); the params
    list the four ports stage-major and each stage's layers."""
    from kvbridge.connector.vllm.connector import KVBridgeConnector
    from kvbridge.connector.vllm.step_metadata import KVBridgeHandshakeMetadata

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=8
    )
    config = KVTransferConfig.from_dict({"kv_role": "kv_producer", "engine_id": "p", "kv_port": 0})
    side = VLLMSchedulerSide(config, kv, tp_size=2, pp_layers=[(0, 3), (3, 5)])
    ports = {(0, 0): 41000, (0, 1): 41001, (1, 0): 42000, (1, 1): 42001}
    connector = KVBridgeConnector.__new__(KVBridgeConnector)  # only its scheduler side
    connector._scheduler, connector._worker = side, None
    connector.set_xfer_handshake_metadata_pp_aware(
        {(pp, tp): KVBridgeHandshakeMetadata(pp * 2 + tp, port) for (pp, tp), port in ports.items()}
    )
    delay, params = side.request_finished(
        _Request("r1", {"do_remote_decode": True}), [[1, 2, 3, 4]]
    )
    assert delay and params is not None
    assert params["remote_ports"] == [41000, 41001, 42000, 42001]
    assert params["remote_pp_layers"] == [[0, 3], [3, 5]]
    assert params["remote_tp_size"] == 2


# -- state (Mamba) groups: vLLM's own Request, one running state per request -------------


def _hybrid_side(role: str = "kv_both", *, single: bool = False) -> VLLMSchedulerSide:
    """Group 0: a Mamba-like state group; group 1: full attention; 32-token blocks."""
    from kvbridge.layouts.specs import StateSpec

    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    state = StateSpec(
        block_size=32,
        shapes=((3, 8), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=attn.page_size_bytes,
    )
    kv = KVCacheConfig(
        groups=(
            KVCacheGroup(group_id=0, layer_names=("m0",), spec=state),
            KVCacheGroup(group_id=1, layer_names=("a0",), spec=attn),
        ),
        num_blocks=64,
    )
    config = KVTransferConfig.from_dict({"kv_role": role, "engine_id": "e", "kv_port": 0})
    side = VLLMSchedulerSide(
        config, kv, single_block_groups=frozenset({0}) if single else frozenset()
    )
    side.set_handshake_metadata({0: KVBridgeHandshakeMetadata(0, 41000)})  # rank 0's port
    return side


def _vllm_request(rid: str, prompt: list[int], params: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    sampling = SamplingParams(max_tokens=16, extra_args={"kv_transfer_params": params})
    request = Request(rid, list(prompt), sampling, None)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return request


def test_a_prefill_of_a_state_model_computes_all_but_the_last_prompt_token():
    """vLLM keeps one running state per request: prefill stops one token short, so its
    state block holds the state after N - 1 tokens, where decode resumes; the params
    still describe the N-token prompt."""
    side = _hybrid_side()
    prompt = list(range(100, 200))  # N = 100
    req = _vllm_request("r1", prompt, {"do_remote_decode": True})
    side.on_new_request(req)
    assert (req.num_prompt_tokens, len(req.prompt_token_ids), req.num_tokens) == (99, 99, 99)
    assert req.max_tokens == 1
    side.on_new_request(req)  # preempted and added again: not shortened twice
    assert req.num_prompt_tokens == 99
    # vLLM's align mode: the running state sits in the block of the last computed token
    # (token 98 -> block 3); the other state blocks hold boundary states (freed)
    state_ids, attn_ids = [11, 12, 13, 14], [21, 22, 23, 24]
    delay, params = side.request_finished(req, [state_ids, attn_ids])
    assert delay is True
    assert (params["num_tokens"], params["resume_tokens"]) == (100, 99)
    assert params["remote_block_ids"] == [[14], [21, 22, 23, 24]]
    assert params["remote_first_block"] == [3, 0]


def test_a_single_block_state_group_stands_at_every_position():
    """Without prefix caching vLLM gives a Mamba group one block per request: prefill keeps
    it as the state after N - 1 tokens, and decode loads that state into its one block."""
    from kvbridge.connector.common.params import KVTransferParams

    prefill = _hybrid_side(single=True)
    req = _vllm_request("r1", list(range(100, 200)), {"do_remote_decode": True})
    prefill.on_new_request(req)
    _, params = prefill.request_finished(req, [[7], [21, 22, 23, 24]])
    assert params["remote_block_ids"] == [[7], [21, 22, 23, 24]]
    assert params["remote_first_block"] == [3, 0]

    decode = _hybrid_side("kv_consumer", single=True)
    loaded = KVTransferParams.from_dict(params)
    dreq = _vllm_request("d1", list(range(100, 200)), loaded.to_dict())
    decode.on_new_request(dreq)  # a decode request keeps its prompt
    assert dreq.num_prompt_tokens == 100
    assert decode.get_num_new_matched_tokens(dreq, 0) == (99, True)
    decode.update_state_after_alloc(dreq, _Blocks([[9], [31, 32, 33, 34]]), 99)
    [load] = decode.build_connector_meta().meta.reqs_to_load
    assert load.local_block_ids[0][-1] == 9  # the state lands in decode's one block
    assert list(load.local_block_ids[1]) == [31, 32, 33, 34]


def test_a_model_without_state_groups_keeps_the_whole_prompt():
    side = _side()
    req = _vllm_request("r1", list(range(100)), {"do_remote_decode": True})
    side.on_new_request(req)
    assert req.num_prompt_tokens == 100 and req.max_tokens == 16


def test_a_state_model_prompt_that_cannot_be_shortened_is_not_handed_over():
    """Prompt logprobs (vLLM then reads no prefix cache), or a one-token prompt: prefill
    computes the whole prompt, so its state is the one after all N tokens, not where
    decode resumes. No params: decode computes the request."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    side = _hybrid_side()
    sampling = SamplingParams(
        max_tokens=16,
        prompt_logprobs=1,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )
    req = Request("r1", list(range(100, 200)), sampling, None)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    side.on_new_request(req)
    assert req.num_prompt_tokens == 100  # kept whole
    assert side.request_finished(req, [[11, 12, 13, 14], [21, 22, 23, 24]]) == (False, None)
    short = _vllm_request("r2", [5], {"do_remote_decode": True})
    side.on_new_request(short)
    assert short.num_prompt_tokens == 1
    assert side.request_finished(short, [[11], [21]]) == (False, None)


def test_the_shortened_prompt_is_a_new_list_and_the_params_are_marked():
    """The engine's output side may hold the list the request came with: it keeps every
    token. The params carry vLLM's ``_p_side_truncated`` mark (a NixlConnector beside
    kvbridge does not shorten the prompt again), which kvbridge's params parser drops."""
    side = _hybrid_side()
    prompt = list(range(100, 200))
    req = _vllm_request("r1", prompt, {"do_remote_decode": True})
    given = req.prompt_token_ids
    side.on_new_request(req)
    assert len(given) == 100 and len(req.prompt_token_ids) == 99
    assert req.kv_transfer_params["_p_side_truncated"] is True
    _, params = side.request_finished(req, [[11, 12, 13, 14], [21, 22, 23, 24]])
    assert params["num_tokens"] == 100


class _NoWorker:
    """The kvbridge worker behind a VLLMWorkerSide, with nothing of its own to report."""

    def bind_connector_metadata(self, meta: Any) -> None:
        pass

    def get_finished(self) -> Any:
        from kvbridge.connector.common.metadata import WorkerOutput

        return WorkerOutput()


def test_a_token_count_vllm_rounded_after_matching_fails_the_load_for_vllm_to_recompute(caplog):
    """vLLM may round ``num_external_computed_tokens`` down to a block boundary between
    ``get_num_new_matched_tokens`` and ``update_state_after_alloc`` (its sliding-window
    replay does). That must not raise into vLLM's schedule(): the load is refused with a
    warning, prefill told to free, and every worker reports it finished and failed, which
    vLLM's own scheduler turns into a recompute from the local prefix."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from kvbridge.connector.common.params import KVTransferParams
    from kvbridge.connector.vllm.worker_side import VLLMWorkerSide

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=8
    )
    config = KVTransferConfig.from_dict(
        {"kv_role": "kv_consumer", "engine_id": "d", "failure_policy": "recompute"}
    )
    side = VLLMSchedulerSide(config, kv)
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_block_ids=[[3, 4, 5, 6]],
        remote_block_size=32,
        num_tokens=100,
        resume_tokens=99,
        remote_request_id="p-r1",
    )
    req = _vllm_request("r1", list(range(100)), params.to_dict())
    req.status = RequestStatus.WAITING
    assert side.get_num_new_matched_tokens(req, 0) == (99, True)

    side.update_state_after_alloc(req, _Blocks([[0, 1, 2, 7]]), 96)  # rounded: no raise

    assert "does not fit the load offered" in caplog.text
    meta = side.build_connector_meta()
    assert meta.meta.reqs_to_load == () and meta.refused == ("r1",)
    assert [rid for rid, _ in meta.meta.reqs_to_release] == ["r1"]  # prefill frees
    assert side.build_connector_meta().refused == ()  # reported once
    assert side.stats().data.get("loads_recomputed") == 1

    worker_side = object.__new__(VLLMWorkerSide)
    worker_side.worker, worker_side._freed, worker_side._refused = _NoWorker(), set(), set()
    worker_side.bind(meta)
    _sending, recving, failed = worker_side.transfer_results()
    assert "r1" in recving and "r1" in failed

    # vLLM's own handling of failed_recving (kv_load_failure_policy=recompute)
    req.status, req.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, 96
    vllm_sched = SimpleNamespace(
        requests={"r1": req}, recompute_kv_load_failures=True, failed_recving_kv_req_ids=set()
    )
    assert Scheduler._handle_failed_recving(vllm_sched, failed) == set()  # type: ignore[arg-type]
    assert req.num_computed_tokens == 0 and "r1" in vllm_sched.failed_recving_kv_req_ids


class _Reports:
    """The kvbridge worker behind a VLLMWorkerSide, reporting the given outputs in turn."""

    def __init__(self, *outputs: Any) -> None:
        self._outputs = list(outputs)

    def get_finished(self) -> Any:
        return self._outputs.pop(0)


def test_a_failing_load_is_failed_for_vllm_at_once_and_finished_when_it_ended():
    """``failure_policy: fail``: a load failed at its deadline with a READ still out goes to
    vLLM as failed only (vLLM ends the request with an error and, not finished receiving,
    keeps its blocks); its later failed report finishes it (vLLM frees the blocks)."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from kvbridge.connector.common.metadata import LoadFailure, WorkerOutput
    from kvbridge.connector.vllm.worker_side import VLLMWorkerSide

    lost = LoadFailure(
        request_id="r1", reason="load timed out", invalid_block_ids=((0, 1),), num_valid_tokens=0
    )
    worker_side = object.__new__(VLLMWorkerSide)
    worker_side._freed, worker_side._refused = set(), set()
    worker_side.worker = _Reports(
        WorkerOutput(failing_loads=(lost,)), WorkerOutput(failed_loads=(lost,))
    )
    _sending, recving, failed = worker_side.transfer_results()
    assert failed == {"r1"} and recving == set()
    assert worker_side.worker_meta() is not None  # the scheduler side hears it too

    req = SimpleNamespace(request_id="r1", status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    vllm_sched = SimpleNamespace(
        requests={"r1": req}, recompute_kv_load_failures=False, failed_recving_kv_req_ids=set()
    )
    assert Scheduler._handle_failed_recving(vllm_sched, failed) == {"r1"}  # type: ignore[arg-type]

    _sending, recving, failed = worker_side.transfer_results()
    assert recving == {"r1"}  # vLLM frees the finished request's blocks now


def _loading_under_fail_policy() -> tuple[VLLMSchedulerSide, _Request]:
    """A decode whose load of ``r1`` went out to the workers, ``kv_load_failure_policy:
    fail``."""
    from kvbridge.connector.common.params import KVTransferParams

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=8
    )
    config = KVTransferConfig.from_dict(
        {"kv_role": "kv_consumer", "engine_id": "d", "failure_policy": "fail"}
    )
    side = VLLMSchedulerSide(config, kv)
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_block_ids=[[3, 4, 5, 6]],
        remote_block_size=32,
        num_tokens=100,
        resume_tokens=99,
        remote_request_id="p-r1",
    )
    req = _Request("r1", params.to_dict(), status=_Status("WAITING_FOR_REMOTE_KVS"))
    assert side.get_num_new_matched_tokens(req, 0) == (99, True)
    side.update_state_after_alloc(req, _Blocks([[3, 1, 2, 7]]), 99)
    assert side.build_connector_meta().meta.reqs_to_load
    return side, req


def _failed_report(reason: str) -> Any:
    from kvbridge.connector.common.metadata import LoadFailure, WorkerOutput
    from kvbridge.connector.vllm.step_metadata import KVBridgeWorkerMetadata

    failure = LoadFailure(
        request_id="r1", reason=reason, invalid_block_ids=((3, 1, 2, 7),), num_valid_tokens=0
    )
    return KVBridgeWorkerMetadata(WorkerOutput(failed_loads=(failure,)))


def test_a_load_vllm_failed_the_request_on_counts_failed_not_aborted():
    """``kv_load_failure_policy: fail``, an unreachable prefill: vLLM's
    ``update_from_output`` reads ``failed_recving`` first and finishes the request
    (FINISHED_ERROR: ``request_finished``, an abort to kvbridge), then hands the same
    report to ``update_connector_output``. The load failed: ``loads_failed``."""
    side, req = _loading_under_fail_policy()
    req.status = _Status("FINISHED_ERROR")
    assert side.request_finished(req, [[3, 1, 2, 7]]) == (True, None)  # blocks kept
    side.update_connector_output(_failed_report("handshake with 127.0.0.1:5600 timed out"))
    stats = side.stats().data
    assert (stats.get("loads_failed"), stats.get("loads_aborted")) == (1, None)
    assert stats["loading_requests"] == 0


def test_a_client_abort_mid_load_counts_aborted_not_failed():
    """The client hung up while the load ran: vLLM aborts the request, the abort goes
    out with the next step's metadata, and the worker reports the load it cancelled as
    failed ("aborted by the engine"). The load was aborted: ``loads_aborted``."""
    side, req = _loading_under_fail_policy()
    req.status = _Status("FINISHED_ABORTED")
    assert side.request_finished(req, [[3, 1, 2, 7]]) == (True, None)
    assert [rid for rid, _ in side.build_connector_meta().meta.reqs_to_abort] == ["r1"]
    side.update_connector_output(_failed_report("aborted by the engine"))
    stats = side.stats().data
    assert (stats.get("loads_failed"), stats.get("loads_aborted")) == (None, 1)
    assert stats["loading_requests"] == 0
