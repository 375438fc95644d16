"""Host staging with vLLM's own copy operation (``set_host_xfer_buffer_ops``), block by
block, for every cache vLLM's allocation code builds that kvbridge adopts.

vLLM's ``copy_kv_blocks`` runs here with the CUDA platform's block copies on CPU tensors
(vLLM's CPU platform has none: :func:`test_vllm_cpu_build_has_no_block_copies`). For
each layout the mirror must receive exactly the blocks asked for, as kvbridge describes
them to NIXL (its unit slots), and nothing else; and back. The transfer between two
processes is ``test_host_buffer_pair.py``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.platforms.cpu import CpuPlatform

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.vllm import translate
from kvbridge.connector.vllm.connector import KVBridgeConnector
from kvbridge.connector.worker.staging.engine_copies import EngineCopies, engine_copies_for
from kvbridge.connector.worker.staging.host_stage import HostStage
from kvbridge.examples.vllm.allocation import KVCacheLayout, Model, allocate
from kvbridge.examples.vllm.layout_peer import NUM_BLOCKS, SideSpec, fill
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.external import adopt_kv_caches
from tests.connector.vllm.staged_peer import StagedSpec, staged_cache, staged_side
from tests.connector.vllm.vllm_copy_ops import (
    COPY_FUNCTIONS,
    RecordingCopyOp,
    cuda_platform_copies,
    vllm_copy_kv_blocks,
)

pytestmark = pytest.mark.vllm

FA = "FLASH_ATTN"
SPECS = [
    *(SideSpec(FA, layout, 16) for layout in ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC")),
    SideSpec("TRITON_ATTN", "LBNHC", 32),
    SideSpec("ROCM_AITER_FA", "LBHNC", 64),  # kernel blocks of 32 in blocks of 64
    SideSpec("FLASHMLA", "LBHNC", 128, mla=True),  # latent cache, kernel blocks of 64
    SideSpec(FA, "BLHNC", 32, dtype="float8_e4m3fn"),
]


def test_vllm_cpu_build_has_no_block_copies():
    """Why these tests run the CUDA platform's copies: the CPU platform has none (when a
    vLLM upgrade adds them, use them instead)."""
    for name in COPY_FUNCTIONS:
        assert not hasattr(CpuPlatform, name)
    platform = cuda_platform_copies()
    src = torch.arange(24).reshape(6, 4)
    dst = torch.zeros(6, 4, dtype=src.dtype)
    platform.swap_out_blocks_to_host(src, dst, torch.tensor([4, 1]), torch.tensor([0, 5]))
    assert dst[0].equal(src[4]) and dst[5].equal(src[1]) and int(dst[1:5].count_nonzero()) == 0


def _adopted(spec: StagedSpec, seed: int) -> tuple[dict[str, torch.Tensor], KVCacheBuffers]:
    """vLLM's tensors and kvbridge's buffers over them, as the adapter adopts them."""
    cache = staged_cache(spec, seed)
    layout, _ = translate.kv_layout(cache.allocation.kv_cache_config)
    config = translate.kv_cache_config(cache.allocation.kv_cache_config)
    hint = None if spec.split else layout
    return cache.kv_caches, adopt_kv_caches(config, cache.kv_caches, layout_hint=hint)


def _rows(buffers: KVCacheBuffers, ids: np.ndarray) -> list[torch.Tensor]:
    """What NIXL moves of blocks ``ids``: every unit slot's rows."""
    picked = torch.as_tensor(ids)
    return [
        slot.units.index_select(0, picked).clone()
        for g in buffers.config.groups
        for slot in buffers.unit_slots(g.group_id)
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("side", SPECS, ids=lambda s: f"{s.label()}-{s.dtype[:5]}")
def test_vllm_op_copies_exactly_the_blocks_asked_for(side: SideSpec):
    caches, buffers = _adopted(StagedSpec(side), seed=1)
    copies = engine_copies_for(caches, buffers)
    assert isinstance(copies, EngineCopies), copies
    metrics = ConnectorMetrics()
    stage = HostStage(buffers, metrics, engine_copies=copies)
    assert stage.copy_path == "kvbridge"  # until vLLM hands its operation over
    op = RecordingCopyOp(vllm_copy_kv_blocks())
    assert stage.use_engine_op(op) == "vllm"
    r = next(iter(caches.values())).shape[0] // NUM_BLOCKS
    per_block = buffers.group_block_bytes(0)

    out = np.array([9, 1, 4, 3, 4])  # unsorted, repeated: each block once
    mirror_others = _rows(stage.host_buffers, np.setdiff1d(np.arange(NUM_BLOCKS), out))
    assert stage.to_host(0, out) == metrics.staged_to_host_bytes == 4 * per_block
    kernel_ids = [b * r + k for b in (1, 3, 4, 9) for k in range(r)]
    assert [(c.direction, list(c.src_block_ids), list(c.dst_block_ids)) for c in op.calls] == [
        ("d2h", kernel_ids, kernel_ids)
    ]
    assert set(op.calls[0].layers) == set(buffers.config.layer_names)
    assert _same(_rows(stage.host_buffers, out), _rows(buffers, out))
    assert _same(mirror_others, _rows(stage.host_buffers, np.setdiff1d(np.arange(12), out)))

    gen = torch.Generator().manual_seed(2)
    for t in stage.host_buffers.tensors:  # what NIXL would have written into the mirror
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    back = np.array([2, 3, 11])
    cache_others = _rows(buffers, np.setdiff1d(np.arange(NUM_BLOCKS), back))
    assert stage.to_device(0, back) == metrics.staged_to_device_bytes == 3 * per_block
    assert op.calls[1].direction == "h2d"
    assert list(op.calls[1].src_block_ids) == [b * r + k for b in (2, 3, 11) for k in range(r)]
    assert _same(_rows(buffers, back), _rows(stage.host_buffers, back))
    assert _same(cache_others, _rows(buffers, np.setdiff1d(np.arange(NUM_BLOCKS), back)))
    assert len(op.calls) == 2


def test_hybrid_groups_that_share_tensors_copy_only_their_own_blocks():
    """vLLM's hybrid allocator gives layer i of every group (full, sliding window) the same
    tensor; a group's blocks are copied through its own layers' views only."""
    a = allocate(
        Model(num_layers=4, sliding_window=32),
        block_size=16,
        layout=KVCacheLayout.LBHNC,
        backend_name=FA,
    )
    fill(a, 1)
    layout, _ = translate.kv_layout(a.kv_cache_config)
    config = translate.kv_cache_config(a.kv_cache_config)
    buffers = adopt_kv_caches(config, a.kv_caches, layout_hint=layout)
    copies = engine_copies_for(a.kv_caches, buffers)
    assert isinstance(copies, EngineCopies), copies
    stage = HostStage(buffers, ConnectorMetrics(), engine_copies=copies)
    op = RecordingCopyOp(vllm_copy_kv_blocks())
    stage.use_engine_op(op)
    picked = {0: np.array([1, 5]), 1: np.array([2, 7])}
    for gid, ids in picked.items():
        stage.to_host(gid, ids)
    assert [(c.layers, list(c.src_block_ids)) for c in op.calls] == [
        (tuple(g.layer_names), picked[g.group_id].tolist()) for g in config.groups
    ]
    for g in config.groups:
        ids = torch.as_tensor(picked[g.group_id])
        host = stage.host_buffers.unit_slots(g.group_id)
        cache = buffers.unit_slots(g.group_id)
        assert _same([s.units[ids] for s in host], [s.units[ids] for s in cache])
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), [1, 2, 5, 7])
    assert all(int(t.count_nonzero()) == 0 for t in _rows(stage.host_buffers, untouched))


def test_the_mirror_is_vllms_layout_again_in_host_memory():
    """Per layer a host tensor with the device tensor's shape and strides, at the same
    offset: what the op indexes on one side is what it writes on the other."""
    caches, buffers = _adopted(StagedSpec(SideSpec(FA, "BHLNC", 16)), seed=1)
    copies = engine_copies_for(caches, buffers)
    assert isinstance(copies, EngineCopies)
    assert copies.host_buffers.format == buffers.format
    assert [t.nbytes for t in copies.host_buffers.tensors] == [t.nbytes for t in buffers.tensors]
    assert not {t.data_ptr() for t in copies.host_buffers.tensors} & {
        t.data_ptr() for t in buffers.tensors
    }


def test_a_layout_vllms_op_cannot_index_is_copied_by_kvbridge():
    """K|V split per layer (``[2, blocks, ...]``): dim 0 is K or V, so the op would copy
    the wrong bytes; kvbridge's copies serve and the op is never called."""
    spec = StagedSpec(SideSpec(FA, "LBHNC", 16), split=True)
    caches, buffers = _adopted(spec, seed=1)
    why = engine_copies_for(caches, buffers)
    assert isinstance(why, str) and "dim 0 is not the 12 kernel blocks" in why, why
    side, op = staged_side(staged_cache(spec, 3), "kv_producer", "p-split", "pull")
    try:
        assert side.host_copy_path == "kvbridge"
        assert op.calls == []
    finally:
        side.shutdown()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: [t], "a list, not one tensor"),  # e.g. a state layer's tensors
        (lambda t: t.flatten(), "dim 0 is not the 12 kernel blocks"),  # a raw byte buffer
        (lambda t: t[:, :, :8], "not one kernel block"),
    ],
)
def test_layers_the_op_cannot_copy_are_named(change, reason):
    caches, buffers = _adopted(StagedSpec(SideSpec(FA, "LBHNC", 16)), seed=1)
    name = buffers.config.layer_names[1]
    why = engine_copies_for({**caches, name: change(caches[name])}, buffers)
    assert isinstance(why, str) and why.startswith(f"layer {name!r}") and reason in why, why


def test_engine_packed_pages_are_never_handed_to_the_op():
    caches, buffers = _adopted(StagedSpec(SideSpec(FA, "LBHNC", 16)), seed=1)
    packed = KVCacheBuffers.adopt(
        buffers.config,
        replace(buffers.format, block_packing="vllm-cpu-attn:x"),
        buffers.tensors,
        {n: buffers.layer_bytes(n) for n in buffers.config.layer_names},
        device=buffers.device,
    )
    assert "engine-packed pages" in str(engine_copies_for(caches, packed))


def test_an_unstaged_cache_takes_no_copies():
    """A cache NIXL moves itself (here: in host memory, kv_buffer_device "cpu") stages
    nothing; vLLM's operation is accepted and never called."""
    cache = staged_cache(StagedSpec(SideSpec(FA, "LBHNC", 16)), 1)
    side, op = staged_side(cache, "kv_producer", "p-unstaged", "pull", host_staging=None)
    try:
        assert side.host_copy_path is None
        assert op.calls == []
    finally:
        side.shutdown()


def test_the_connector_hands_vllms_op_to_its_worker_side():
    assert KVBridgeConnector.set_host_xfer_buffer_ops is not (
        KVConnectorBase_V1.set_host_xfer_buffer_ops
    )
    spec = StagedSpec(SideSpec(FA, "BLNHC", 16))
    side, op = staged_side(staged_cache(spec, 1), "kv_producer", "p-conn", "pull", hand_op=False)
    connector = KVBridgeConnector.__new__(KVBridgeConnector)  # vLLM's config is not needed
    connector._scheduler, connector._worker = None, side
    try:
        assert side.host_copy_path == "kvbridge"
        connector.set_host_xfer_buffer_ops(op)
        assert side.host_copy_path == "vllm"
        assert op.calls == []
    finally:
        side.shutdown()
