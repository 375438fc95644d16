"""vLLM's parallel layouts: data-parallel ranks (of any TP x PP size) start from one kv_port
without colliding and hand out their own ports; pipeline stages hold vLLM's layer split;
context parallel is refused by name. Driven
with vLLM's own ParallelConfig, as vLLM builds it for each rank."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import ParallelConfig
from vllm.config.kv_transfer import KVTransferConfig as VLLMTransferConfig

from kvbridge.connector.common.config import ConfigError
from kvbridge.connector.scheduler.advertised import AdvertisedPorts
from kvbridge.connector.vllm import parallelism, translate

pytestmark = pytest.mark.vllm


def _config(kv_port: int, parallel: ParallelConfig):
    vllm_kv = VLLMTransferConfig(
        kv_connector="KVBridgeConnector", kv_role="kv_producer", engine_id="p", kv_port=kv_port
    )
    return parallelism.for_this_rank(translate.transfer_config(vllm_kv), parallel)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_data_parallel_ranks_on_one_host_bind_disjoint_ports(tp):
    """DP 3 x TP ``tp`` from kv_port 5600: every (DP, TP) rank has a port of its own, and
    the params each DP rank hands out name its own rank 0 port."""
    bound: dict[int, tuple[int, int]] = {}
    for dp in range(3):
        parallel = ParallelConfig(
            data_parallel_size=3, data_parallel_rank=dp, tensor_parallel_size=tp
        )
        # a dense model's DP ranks run as independent engines: vLLM then sets their
        # data_parallel_rank to 0 and keeps data_parallel_index (engine/core.py)
        object.__setattr__(parallel, "data_parallel_rank", 0)
        cfg = _config(5600, parallel)
        ports = AdvertisedPorts(cfg.kv_port, tp)
        port, every = ports.advertise("r")
        assert port == 5600 + dp * tp and every == []  # decode adds the TP rank
        for rank in range(tp):
            assert cfg.kv_port + rank not in bound, (dp, rank, bound)
            bound[cfg.kv_port + rank] = (dp, rank)
    assert sorted(bound) == list(range(5600, 5600 + 3 * tp))


def test_ephemeral_ports_stay_ephemeral_under_data_parallel():
    parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=1, tensor_parallel_size=2)
    assert _config(0, parallel).kv_port == 0


def test_a_data_parallel_rank_past_the_last_port_is_refused_by_name():
    parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=1, tensor_parallel_size=4)
    with pytest.raises(ConfigError, match=r"past 65535.*kv_port 0"):
        _config(65530, parallel)


def test_data_parallel_ranks_of_pipeline_stages_bind_disjoint_ports():
    """DP 2 x PP 2 x TP 2 from kv_port 5600: each DP rank's workers (engine rank
    ``pp * tp + r``) listen on a run of its own, past the DP ranks before it."""
    bound: dict[int, tuple[int, int, int]] = {}
    for dp in range(2):
        parallel = ParallelConfig(
            data_parallel_size=2,
            data_parallel_rank=dp,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
        )
        object.__setattr__(parallel, "data_parallel_rank", 0)
        cfg = _config(5600, parallel)
        assert cfg.kv_port == 5600 + dp * 4
        for pp in range(2):
            for r in range(2):
                port = cfg.kv_port + pp * 2 + r
                assert port not in bound, (dp, pp, r, bound)
                bound[port] = (dp, pp, r)
    assert sorted(bound) == list(range(5600, 5608))


class _Model:
    def get_total_num_hidden_layers(self) -> int:
        return 7


class _VLLMConfig:
    def __init__(self, pp: int) -> None:
        self.parallel_config = ParallelConfig(pipeline_parallel_size=pp)
        self.model_config = _Model()


def test_stage_layers_are_vllms_split_and_follow_its_partition_override(monkeypatch):
    assert parallelism.stage_layers(_VLLMConfig(1)) == []
    # vLLM's own rule for 7 layers over 3 stages: the remainder on the middle stage
    assert parallelism.stage_layers(_VLLMConfig(3)) == [(0, 2), (2, 5), (5, 7)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,6")
    assert parallelism.stage_layers(_VLLMConfig(2)) == [(0, 1), (1, 7)]


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
    ],
)
def test_context_parallel_is_refused_naming_the_flag(field, flag):
    # vLLM's own validation ties these sizes to others; the check reads only the field
    parallel = ParallelConfig(tensor_parallel_size=2)
    object.__setattr__(parallel, field, 2)
    with pytest.raises(ConfigError, match=f"{field}=2 \\({flag}\\).*{flag} 1"):
        _config(5600, parallel)
