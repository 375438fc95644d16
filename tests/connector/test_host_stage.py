"""Host staging: what ``kv_buffer_device`` means for a cache, and the mirror's copies.

The copies run here between two host buffers (the path a CUDA cache takes, minus the
device); the GPU tier runs them against CUDA caches (``test_worker_matrix``,
``test_connector_pair``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.connector.common.config import ConfigError, KVTransferConfig
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.worker.staging import host_stage
from kvbridge.connector.worker.staging.host_stage import HostStage, stages_through_host
from kvbridge.connector.worker.worker import KVBridgeWorker
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.layout import KVLayout, KVPacking
from tests.connector.conftest import MODEL, SideFormat, fill_buffers, make_buffers

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")


@pytest.mark.parametrize(
    ("value", "cache", "staged"),
    [
        ("auto", CPU, False),
        ("auto", CUDA0, False),
        ("cpu", CPU, False),
        ("cpu", CUDA0, True),  # a CUDA cache moved through host memory
        ("cuda", CUDA0, False),
        ("cuda:0", CUDA0, False),
        ("cuda:1", CUDA1, False),
    ],
)
def test_what_kv_buffer_device_means(value, cache, staged):
    assert stages_through_host(value, cache) is staged


@pytest.mark.parametrize(
    ("value", "cache", "message"),
    [
        ("cuda", CPU, "the KV cache lives in cpu memory"),
        ("cuda:1", CUDA0, "the KV cache lives on cuda:0"),
        ("xpu", CPU, "is not one of 'auto', 'cpu', 'cuda'"),
    ],
)
def test_a_buffer_device_that_cannot_hold_the_cache_is_refused(value, cache, message):
    with pytest.raises(ConfigError, match=message):
        stages_through_host(value, cache)


@pytest.mark.parametrize("value", ["gpu", "", "cuda:x", "npu:0"])
def test_the_config_refuses_a_malformed_buffer_device(value):
    with pytest.raises(ConfigError, match="kv_buffer_device="):
        KVTransferConfig.from_dict(
            {"kv_role": "kv_producer", "engine_id": "p", "kv_buffer_device": value}
        )


FORMATS = [
    SideFormat(16, KVLayout.NHD, cross_layer=True),
    SideFormat(16, KVLayout.HND, packing=KVPacking.KV_SPLIT),
    SideFormat(32, KVLayout.NHD, packing=KVPacking.BLOCKS_FIRST, kernel_block_size=8),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(np.array([3, 4, 5, 9, 10]), id="runs"),
        pytest.param(np.arange(0, 64, 2), id="scattered"),  # past MAX_RUN_COPIES runs
    ],
)
def test_copies_move_exactly_the_blocks_asked_for(fmt, ids):
    buffers = make_buffers(fmt, "FSM")
    fill_buffers(buffers, seed=1)
    metrics = ConnectorMetrics()
    stage = HostStage(buffers, metrics)
    fill_buffers(stage.host_buffers, seed=2)
    cache_before = [t.clone() for t in buffers.tensors]
    mirror_others = _others(stage.host_buffers, ids)

    moved = sum(stage.to_host(g.group_id, ids) for g in buffers.config.groups)

    per_block = sum(buffers.group_block_bytes(g.group_id) for g in buffers.config.groups)
    assert moved == metrics.staged_to_host_bytes == ids.size * per_block
    _assert_rows(stage.host_buffers, buffers, ids, equal=True)
    _assert_kept(mirror_others, _others(stage.host_buffers, ids))
    for t, before in zip(buffers.tensors, cache_before, strict=True):
        assert torch.equal(t, before), "copying out changed the cache"

    fill_buffers(stage.host_buffers, seed=3)
    cache_others = _others(buffers, ids[::2])
    back = sum(stage.to_device(g.group_id, ids[::2]) for g in buffers.config.groups)
    assert back == metrics.staged_to_device_bytes == ids[::2].size * per_block
    _assert_rows(buffers, stage.host_buffers, ids[::2], equal=True)
    _assert_kept(cache_others, _others(buffers, ids[::2]))


@pytest.mark.parametrize("budget_rows", [1, 3, 1000])
@pytest.mark.parametrize("direction", ["to_host", "to_device"])
def test_gpu_side_gather_and_scatter_move_exactly_the_rows(direction, budget_rows, monkeypatch):
    """The GPU <-> host path for many small runs, run here between two host tensors:
    strided rows (a cross-layer group's slice of wider rows), batches of any size."""
    monkeypatch.setattr(host_stage, "COPY_BUDGET_BYTES", budget_rows * 48)
    gen = torch.Generator().manual_seed(budget_rows)
    wide_src = torch.randint(0, 256, (40, 80), dtype=torch.uint8, generator=gen)
    wide_dst = torch.randint(0, 256, (40, 80), dtype=torch.uint8, generator=gen)
    src, dst = wide_src[:, 16:64], wide_dst[:, 16:64]  # 48-byte rows, 80 bytes apart
    before = wide_dst.clone()
    ids = np.array([0, 2, 3, 7, 11, 12, 13, 39])
    copy = host_stage._gather_to_host if direction == "to_host" else host_stage._scatter_to_device
    copy(src, dst, ids)
    assert torch.equal(dst[ids], src[ids])
    others = np.setdiff1d(np.arange(40), ids)
    assert torch.equal(wide_dst[others], before[others])
    assert torch.equal(wide_dst[:, :16], before[:, :16]) and torch.equal(
        wide_dst[:, 64:], before[:, 64:]
    )


@pytest.mark.parametrize(
    ("devices", "runs", "nbytes", "gathers"),
    [
        ((CPU, CPU), 1000, 1000 * 1024, False),  # host to host: memcpy per run
        ((CUDA0, CPU), 32, 32 * 1024, False),  # few runs: one copy each
        ((CUDA0, CPU), 33, 33 * 1024, True),  # many small runs: gather on the GPU
        ((CPU, CUDA0), 100, 100 << 20, False),  # many large runs: one copy each
    ],
)
def test_when_the_copies_gather(devices, runs, nbytes, gathers):
    assert host_stage._gathers(*devices, runs, nbytes) is gathers


def _rows(buffers: KVCacheBuffers, ids: np.ndarray) -> list[torch.Tensor]:
    picked = torch.as_tensor(ids)
    return [
        slot.units.index_select(0, picked)
        for g in buffers.config.groups
        for slot in buffers.unit_slots(g.group_id)
    ]


def _assert_rows(a: KVCacheBuffers, b: KVCacheBuffers, ids: np.ndarray, *, equal: bool) -> None:
    for x, y in zip(_rows(a, ids), _rows(b, ids), strict=True):
        assert torch.equal(x, y) is equal


def _others(buffers: KVCacheBuffers, ids: np.ndarray) -> list[torch.Tensor]:
    """Every slot's rows outside ``ids`` (copies: compare them before and after)."""
    return _rows(buffers, np.setdiff1d(np.arange(buffers.config.num_blocks), ids))


def _assert_kept(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y), "a block outside the copy changed"


def test_a_cuda_buffer_for_a_host_cache_is_refused_at_registration():
    config = KVTransferConfig.from_dict(
        {"kv_role": "kv_consumer", "engine_id": "d", "kv_port": 0, "kv_buffer_device": "cuda"}
    )
    worker = KVBridgeWorker(config, MODEL)
    try:
        with pytest.raises(ConfigError, match="kv_buffer_device='cuda' but the KV cache lives"):
            worker.register_kv_caches(make_buffers(SideFormat(16), "F"))
    finally:
        worker.shutdown()


def test_a_staged_worker_registers_and_describes_its_mirror():
    """NIXL sees the mirror (other addresses, host memory); the cache is left alone."""
    config = KVTransferConfig.from_dict({"kv_role": "kv_producer", "engine_id": "p", "kv_port": 0})
    buffers = make_buffers(SideFormat(16, cross_layer=True), "F")
    with KVBridgeWorker(config, MODEL, host_staging=True) as worker:
        worker.register_kv_caches(buffers)
        described = {r.base_addr for r in worker.description.regions}
        cache = {r.base_addr for r in buffers.regions()}
        assert described and not described & cache
        assert {r.memory_kind for r in worker.description.regions} == {"DRAM"}


def test_engine_packed_pages_cannot_be_staged():
    buffers = make_buffers(SideFormat(16), "F")
    with pytest.raises(ConfigError, match="engine-packed pages"):
        host_stage.host_stage_for("cpu", buffers, ConnectorMetrics(), forced=True, repacks=True)
    assert host_stage.host_stage_for("auto", buffers, ConnectorMetrics(), repacks=True) is None
