"""A rewrite in one pass: each (row, segment) is read whole into registers and written back
permuted, by one Triton kernel launch for all rows (``RewriteStrategy.FUSED``).

The batched path (``staging.py``) stages rows in scratch and puts every run back: the bytes
are read twice and written twice, <= 0.5x a device copy. A rewrite only ever moves a run
inside its own row, and usually inside a much smaller *segment*: NHD <-> HND, splits and
merges reorder the runs of one layer's K (or V) of a block, never across them::

    row (one block, all layers of a cross-layer cache)   | L0 K | L0 V | L1 K | ... |
    segment: the fewest whole runs the permutation maps onto themselves   ^^^^^^

One program per (row, segment) loads the segment's runs, waits until every thread of the
program has loaded (``debug_barrier``), and stores each run at its destination: every
byte is read once and written once, as in a copy. Segments larger than
``MAX_SEGMENT_BYTES`` (what a program holds in registers) are not fused: the caller takes
the batched path for them.

Triton is imported on first use. With ``TRITON_INTERPRET=1`` set before that import, the
same kernel runs on CPU tensors (Triton's interpreter, numpy underneath): how the tests
check it without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

MAX_SEGMENT_BYTES = 64 << 10  # one program's tile (padded to powers of two), in registers
_INT_TYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def segment_runs(runs: np.ndarray) -> int:
    """The fewest runs ``k`` (a divisor of ``len(runs)``) such that run ``j`` moves within
    its own block of ``k`` runs (``runs[j] // k == j // k`` for every ``j``)."""
    n = len(runs)
    j = np.arange(n)
    for k in range(1, n + 1):
        if n % k == 0 and np.array_equal(runs // k, j // k):
            return k
    raise AssertionError("unreachable: k = len(runs) always qualifies")


def _int_type(*sizes: int) -> torch.dtype:
    """The widest integer element whose size divides every size (and offset) given."""
    for dtype in _INT_TYPES:
        if all(size % dtype.itemsize == 0 for size in sizes):
            return dtype
    raise AssertionError("unreachable: int8 divides everything")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fused_plan(
    units: torch.Tensor, runs: np.ndarray, run_bytes: int
) -> tuple[torch.dtype, int, int] | None:
    """(element type, runs per segment, elements per run) of a fused rewrite of ``units``
    by ``runs``; None when a segment's padded tile exceeds ``MAX_SEGMENT_BYTES``."""
    dtype = _int_type(run_bytes, units.stride(0), units.storage_offset())
    k = segment_runs(runs)
    run_elems = run_bytes // dtype.itemsize
    if _pow2(k) * _pow2(run_elems) * dtype.itemsize > MAX_SEGMENT_BYTES:
        return None
    return dtype, k, run_elems


def fused_rewrite(
    units: torch.Tensor,
    ids: torch.Tensor,
    runs: np.ndarray,
    runs_t: torch.Tensor,
    plan: tuple[torch.dtype, int, int],
) -> None:
    """In ``units`` (rows of bytes), move run ``j`` of each row ``ids`` to run ``runs[j]``
    by ``plan`` (:func:`fused_plan`), one kernel launch on the current stream. ``ids`` and
    ``runs_t`` (``runs`` as int64) are on the device already: uploaded once, before any
    kernel is queued (a copy from pageable memory waits for the stream)."""
    if ids.numel() == 0:
        return
    dtype, k, run_elems = plan
    elems = units.view(dtype)
    tile_bytes = _pow2(k) * _pow2(run_elems) * dtype.itemsize
    grid = (ids.numel(), len(runs) // k)
    _kernel()[grid](
        elems,
        ids,
        runs_t,
        elems.stride(0),
        K=k,
        RUN=run_elems,
        K_PAD=_pow2(k),
        RUN_PAD=_pow2(run_elems),
        num_warps=8 if tile_bytes > (16 << 10) else 4,
    )


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, built on first use (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def permute_segments(
        units,  # rows of elements, row stride ``row_stride``
        ids,  # int64 row ids: program axis 0
        runs,  # int64: run j of a row moves to run runs[j]
        row_stride,
        K: tl.constexpr,  # runs per segment: program axis 1 is the segment
        RUN: tl.constexpr,  # elements per run
        K_PAD: tl.constexpr,
        RUN_PAD: tl.constexpr,
    ):
        row = tl.load(ids + tl.program_id(0))
        seg = tl.program_id(1)
        r = tl.arange(0, K_PAD)
        e = tl.arange(0, RUN_PAD)
        run_ok = r < K
        ok = run_ok[:, None] & (e[None, :] < RUN)
        base = units + row * row_stride + seg * (K * RUN)
        values = tl.load(base + r[:, None] * RUN + e[None, :], mask=ok)
        dst = tl.load(runs + seg * K + r, mask=run_ok, other=0) - seg * K
        tl.debug_barrier()  # every thread has read the segment before any writes into it
        tl.store(base + dst[:, None] * RUN + e[None, :], values, mask=ok)

    return permute_segments
