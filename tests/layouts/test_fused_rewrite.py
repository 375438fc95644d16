"""The fused rewrite (``RewriteStrategy.FUSED``): one Triton kernel, each row segment read
once and written once. Here it runs on CPU tensors through Triton's interpreter and must
give the CPU strategy's bytes for every rewrite of the layout matrix; the gpu tier runs the
compiled kernel on CUDA tensors against the same reference."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from layout_reference import build_side, rewrite_case

from kvbridge.layouts import fused_rewrite
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.arrangement import BlockArrangement, UnitGeometry, run_permutation
from kvbridge.layouts.fused_rewrite import MAX_SEGMENT_BYTES, fused_plan, segment_runs
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.staging import RewriteStrategy
from kvbridge.layouts.transforms import merge_blocks, permute_layout, rewrite_units, split_blocks

SMALL, FUSED = RewriteStrategy.SMALL_SCRATCH, RewriteStrategy.FUSED
ON_CUDA = torch.cuda.is_available()
interpreted = pytest.mark.skipif(ON_CUDA, reason="a CUDA host runs the compiled kernel (gpu)")


@pytest.fixture(autouse=True, scope="module")
def triton_mode() -> Iterator[None]:
    """Without CUDA, the kernel is built for Triton's interpreter (read when it is first
    built: CPU tensors, numpy inside), for this module only."""
    before = os.environ.get("TRITON_INTERPRET")
    if not ON_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    fused_rewrite._kernel.cache_clear()
    try:
        yield
    finally:
        fused_rewrite._kernel.cache_clear()
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.mark.parametrize(
    ("runs", "k"),
    [
        ([0, 1, 2, 3], 1),
        ([1, 0, 3, 2], 2),
        ([3, 2, 1, 0], 4),
        ([0, 2, 1, 3, 4, 6, 5, 7], 4),
        ([0, 1, 2, 4, 3, 5], 3),
        ([5, 1, 2, 3, 4, 0], 6),
    ],
)
def test_a_segment_is_the_fewest_runs_the_permutation_keeps_together(runs, k):
    assert segment_runs(np.asarray(runs)) == k


def test_nhd_to_hnd_of_a_cross_layer_unit_is_fused_per_layer_and_part():
    """A cross-layer block of 32 layers is 2 MiB: no program holds it, but each run moves
    within its own layer's K or V, 16 tokens x 8 heads x 128 fp16 (32 KiB)."""
    geo = UnitGeometry(
        num_layers=32, num_kv_parts=2, block_size=16, num_heads=8, head_size=128, itemsize=2
    )
    run, runs = run_permutation(geo, NHD, HND)
    units = torch.empty((1, geo.unit_bytes), dtype=torch.uint8)
    plan = fused_plan(units, runs, run * geo.itemsize)
    assert plan is not None
    dtype, k, run_elems = plan
    assert dtype is torch.int64 and k * run * geo.itemsize == 32 << 10
    assert run_elems == 128 * 2 // 8


NHD = BlockArrangement(layout=KVLayout.NHD)
HND = BlockArrangement(layout=KVLayout.HND)


def _matrix_equals_the_cpu_strategy(
    cross, packing, block_size, kernel, sub, device, heads: int = 4, head: int = 64
) -> None:
    """Permute, split, merge: FUSED gives the CPU strategy's bytes, fused where the rows'
    segments fit a program."""
    case = rewrite_case(
        cross, block_size, kernel, packing, heads=heads, head_size=head, num_blocks=24
    )
    want = build_side(case, seed=7)
    got = KVCacheBuffers(want.config, want.format, device=device)
    for dst, src in zip(got.tensors, want.tensors, strict=True):
        dst.copy_(src)
    ids = np.random.default_rng(1).permutation(24)[:17]
    steps = [
        lambda b, **kw: permute_layout(b, 0, ids, KVLayout.HND, **kw),
        lambda b, **kw: split_blocks(b, 0, ids, sub_block_size=sub, to_layout=KVLayout.HND, **kw),
        lambda b, **kw: merge_blocks(b, 0, ids, sub_block_size=sub, from_layout=KVLayout.HND, **kw),
    ]
    for i, step in enumerate(steps):
        expected = step(want, strategy=SMALL)
        stats = step(got, strategy=FUSED)
        assert stats.strategy is FUSED and stats.num_blocks == expected.num_blocks
        # a cross-layer block's split or merge moves runs across its layers: the whole row
        # is one segment, fused only when a program holds it (else the batched path)
        if not cross or i == 0:
            assert stats.scratch_bytes == 0, f"step {i}: {stats}"
        for a, b in zip(want.tensors, got.tensors, strict=True):
            assert torch.equal(a, b.cpu()), f"step {i}"  # .cpu() waits for the stream


@interpreted
@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize(("block_size", "kernel", "sub"), [(16, 16, 8), (64, 16, 16)])
def test_fused_rewrites_equal_the_cpu_ones(cross, packing, block_size, kernel, sub):
    _matrix_equals_the_cpu_strategy(cross, packing, block_size, kernel, sub, "cpu")


@interpreted
@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize(("heads", "head"), [(3, 80), (5, 96)])
def test_fused_rewrites_of_odd_shapes_equal_the_cpu_ones(cross, heads, head):
    """Runs and segments that are no power of two: the kernel's masked lanes."""
    packing = KVPacking.BLOCKS_FIRST
    _matrix_equals_the_cpu_strategy(cross, packing, 16, 16, 8, "cpu", heads, head)


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize(("block_size", "kernel", "sub"), [(16, 16, 8), (64, 16, 16), (64, 64, 32)])
def test_fused_cuda_rewrites_equal_the_cpu_ones(cross, packing, block_size, kernel, sub):
    pytest.importorskip("triton", reason="the fused kernel needs triton (CUDA torch ships it)")
    _matrix_equals_the_cpu_strategy(cross, packing, block_size, kernel, sub, "cuda")


@interpreted
def test_segments_too_large_to_fuse_take_the_batched_path(monkeypatch):
    """Same bytes, through the scratch: a segment over MAX_SEGMENT_BYTES is not fused."""
    geo = UnitGeometry(
        num_layers=1, num_kv_parts=2, block_size=16, num_heads=4, head_size=64, itemsize=2
    )
    gen = torch.Generator().manual_seed(3)
    units = torch.randint(0, 256, (12, geo.unit_bytes), dtype=torch.uint8, generator=gen)
    want = units.clone()
    ids = np.array([7, 2, 9, 0])
    rewrite_units(want, geo, ids, NHD, HND, strategy=SMALL)

    assert geo.unit_bytes // 2 <= MAX_SEGMENT_BYTES  # fused at the real limit ...
    monkeypatch.setattr(fused_rewrite, "MAX_SEGMENT_BYTES", 1024)  # ... not under this one
    stats = rewrite_units(units, geo, ids, NHD, HND, strategy=FUSED)
    assert stats.strategy is FUSED and stats.scratch_bytes > 0
    assert torch.equal(units, want)


@interpreted
def test_rows_not_named_are_left_alone():
    geo = UnitGeometry(
        num_layers=2, num_kv_parts=2, block_size=16, num_heads=2, head_size=32, itemsize=2
    )
    gen = torch.Generator().manual_seed(4)
    units = torch.randint(0, 256, (8, geo.unit_bytes), dtype=torch.uint8, generator=gen)
    before = units.clone()
    ids = np.array([5, 1])
    stats = rewrite_units(units, geo, ids, NHD, HND, strategy=FUSED)
    assert stats.scratch_bytes == 0
    others = [r for r in range(8) if r not in ids]
    assert torch.equal(units[others], before[others])
    assert not torch.equal(units[ids], before[ids])
    rewrite_units(units, geo, ids, HND, NHD, strategy=FUSED)  # and back
    assert torch.equal(units, before)
