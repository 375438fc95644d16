"""Rewrite strategies: chosen by device type in one place, default budgets, the batched
path's constant number of kernels per batch, and (gpu tier) the CUDA path against the
CPU one byte for byte."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import numpy as np
import pytest
import torch
from layout_reference import build_side, rewrite_case
from torch.profiler import ProfilerActivity, profile

from kvbridge.layouts import staging
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.arrangement import BlockArrangement, UnitGeometry
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.staging import BATCHED_SCRATCH_BUDGET_BYTES, RewriteStrategy
from kvbridge.layouts.transforms import merge_blocks, permute_layout, rewrite_units, split_blocks

SMALL, BATCHED = RewriteStrategy.SMALL_SCRATCH, RewriteStrategy.BATCHED


@pytest.mark.parametrize(
    ("device", "strategy"),
    [("cpu", SMALL), ("cuda", BATCHED), ("cuda:1", BATCHED), ("xpu", BATCHED)],
)
def test_strategy_follows_the_device_type(device, strategy):
    assert RewriteStrategy.for_device(torch.device(device)) is strategy
    assert RewriteStrategy.for_device(device) is strategy


def test_default_budgets_and_parsing():
    assert BATCHED_SCRATCH_BUDGET_BYTES == 64 << 20
    assert BATCHED.default_budget_bytes(12345) == 64 << 20
    assert SMALL.default_budget_bytes(12345) == 12345
    assert RewriteStrategy.parse("Batched") is BATCHED
    assert RewriteStrategy.parse(SMALL) is SMALL
    with pytest.raises(LayoutError, match="unknown rewrite strategy 'gpu'"):
        RewriteStrategy.parse("gpu")


def _units(num_rows: int, heads: int) -> tuple[torch.Tensor, UnitGeometry]:
    geo = UnitGeometry(
        num_layers=2, num_kv_parts=2, block_size=16, num_heads=heads, head_size=64, itemsize=2
    )
    gen = torch.Generator().manual_seed(heads)
    units = torch.randint(0, 256, (num_rows, geo.unit_bytes), dtype=torch.uint8, generator=gen)
    return units, geo


NHD = BlockArrangement(layout=KVLayout.NHD)
HND_SPLIT = BlockArrangement(layout=KVLayout.HND, num_chunks=4)


def test_batched_default_budget_is_used_when_none_is_named():
    units, geo = _units(10, heads=2)
    ids = np.arange(10)[::-1].copy()
    with mock.patch.object(staging, "BATCHED_SCRATCH_BUDGET_BYTES", 3 * geo.unit_bytes):
        stats = rewrite_units(units, geo, ids, NHD, HND_SPLIT, strategy=BATCHED)
    assert stats.strategy is BATCHED
    assert stats.scratch_bytes == 3 * geo.unit_bytes
    stats = rewrite_units(units, geo, ids, HND_SPLIT, NHD)  # CPU tensors: small scratch
    assert stats.strategy is SMALL and stats.scratch_bytes == geo.unit_bytes


def test_negative_budget_is_refused():
    units, geo = _units(2, heads=2)
    with pytest.raises(LayoutError, match="scratch_budget_bytes=-1 must be >= 0"):
        rewrite_units(units, geo, np.array([0]), NHD, HND_SPLIT, scratch_budget_bytes=-1)


def _data_ops(fn) -> Counter:
    """How many times each data-moving aten op ran inside ``fn``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    moving = ("index", "gather", "scatter", "copy")
    return Counter({e.key: e.count for e in prof.key_averages() if any(m in e.key for m in moving)})


@pytest.mark.parametrize("heads", [1, 8])  # units of 8 KiB and 64 KiB
def test_batched_path_runs_two_kernels_per_batch_whatever_the_unit_size(heads):
    """12 rows through a 5-unit budget: 3 batches, each one index_select and one
    index_put_, for small and large units alike; never an op per row or per run."""
    units, geo = _units(12, heads=heads)
    ids = np.random.default_rng(0).permutation(12)
    budget = 5 * geo.unit_bytes

    def rewrite():
        rewrite_units(
            units, geo, ids, NHD, HND_SPLIT, scratch_budget_bytes=budget, strategy=BATCHED
        )

    with mock.patch.object(staging, "_ROW_GATHER_MIN_BYTES", 0):  # the CPU path would loop
        ops = _data_ops(rewrite)
    assert ops["aten::index_select"] == 3
    assert ops["aten::index_put_"] == 3
    assert not {k for k in ops if "gather" in k or "scatter" in k or "index_copy" in k}


def test_small_scratch_path_gathers_big_units_row_by_row():
    """The contrast that shows the counter above can see a per-row loop."""
    units, geo = _units(12, heads=8)
    ids = np.random.default_rng(0).permutation(12)
    with mock.patch.object(staging, "_ROW_GATHER_MIN_BYTES", 0):
        ops = _data_ops(lambda: rewrite_units(units, geo, ids, NHD, HND_SPLIT, strategy=SMALL))
    assert ops["aten::index_select"] == 12 + 12  # one stage and one gather per row


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize(("block_size", "kernel", "sub"), [(16, 16, 8), (64, 16, 16), (64, 64, 32)])
@pytest.mark.parametrize("budget", [None, 1, 100_000])
def test_cuda_rewrites_equal_the_cpu_ones(cross, packing, block_size, kernel, sub, budget):
    """On a GPU the default (batched) strategy gives the CPU strategy's bytes."""
    case = rewrite_case(cross, block_size, kernel, packing)
    cpu = build_side(case, seed=7)
    gpu = KVCacheBuffers(cpu.config, cpu.format, device="cuda")
    for dst, src in zip(gpu.tensors, cpu.tensors, strict=True):
        dst.copy_(src)
    ids = np.random.default_rng(1).permutation(40)[:29]
    steps = [
        lambda b, **kw: permute_layout(b, 0, ids, KVLayout.HND, **kw),
        lambda b, **kw: split_blocks(b, 0, ids, sub_block_size=sub, to_layout=KVLayout.HND, **kw),
        lambda b, **kw: merge_blocks(b, 0, ids, sub_block_size=sub, from_layout=KVLayout.HND, **kw),
    ]
    for step in steps:
        want = step(cpu)
        got = step(gpu, scratch_budget_bytes=budget)
        assert got.strategy is BATCHED and got.num_blocks == want.num_blocks
        for a, b in zip(cpu.tensors, gpu.tensors, strict=True):
            assert torch.equal(a, b.cpu())  # .cpu() waits for the stream
