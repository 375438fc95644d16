"""How an in-place rewrite moves bytes: the scratch budget and the two strategies.

A rewrite (``transforms.py``) reorders the bytes inside chosen rows of a ``units`` tensor
(one row per block, see ``arrangement.py``) as contiguous runs (``run_permutation``).
Rows are staged in scratch, a batch of whole units at a time, then every run is put back
at its destination inside its own row::

    rows --index_select--> scratch (B units) --put back, run by run--> same rows

The bytes are read twice and written twice (a plain copy: once), so a rewrite whose
scratch does not stay in a cache runs at <= 0.5x a copy of the same bytes.

Scratch budget. The scratch holds ``B = max(1, min(num_ids, budget // unit_bytes))`` whole
units: never more than ``max(budget, one unit)``, and any budget (0 included) works. Not
counted: the id tensor (8 bytes per block) and the run table (8 bytes per run of a unit),
and on the small-scratch path the piece table of a batch (8 bytes per piece).

Strategies. :meth:`RewriteStrategy.for_device` picks one from the device type of the
units, here and nowhere else; every rewrite takes ``strategy=`` to force one (tests run
the GPU path on CPU tensors; ``scripts/bench_layouts.py --strategy`` measures both).

``SMALL_SCRATCH`` (device type ``cpu``). Default budget: one block of the group
(``rewrite_group``) or one unit (``rewrite_units``), so the scratch stays in cache and its
second read is nearly free (0.6-1.0x a copy on one core). Units >= 256 KiB are put back
by one gather per row (sequential writes into the row); smaller ones by one scatter of
every piece of a batch. A torch call costs microseconds on a CPU, little next to the
bytes of a row.

``FUSED`` (asked for by name; ``fused_rewrite.py``). One Triton kernel per rewrite reads
each segment of a row whole and writes it back permuted: every byte read once and written
once, no scratch. Segments too large for one program take the batched path. Not chosen by
any device yet: it becomes CUDA's default once the GPU tier has passed it and measured it
(``tests/layouts/test_fused_rewrite.py``, ``kvbridge bench layouts --strategy fused``).

``BATCHED`` (any other device type: CUDA first of all). Default budget 64 MiB
(:data:`BATCHED_SCRATCH_BUDGET_BYTES`). Two kernels per batch whatever the unit size:
``index_select`` of the batch's rows into scratch, then one ``index_put_`` of every run
of every row, indexed by broadcast ``(row, run)`` ids (no per-batch index table). Never a
Python loop per row or run: a kernel launch costs more than a small row's bytes. The
block ids and the run table go to the device in one copy at the start of a call (from
pageable memory, so it waits for work already queued on the stream); nothing after it
waits. The scratch comes from torch's caching allocator (which keeps it reserved for the
next call). Like any torch op the rewrite is queued on the current stream and returns
before it is done: synchronize before another agent (NIXL) reads the rows.

Rows and runs move as the widest element type their sizes and alignment allow: torch's
gather/scatter kernels cost per element, not per byte.
"""

from __future__ import annotations

import math
from enum import Enum

import numpy as np
import torch

from kvbridge.layouts.errors import LayoutError

BATCHED_SCRATCH_BUDGET_BYTES = 64 << 20
_ROW_GATHER_MIN_BYTES = 256 << 10  # small-scratch path: units this large are gathered per row


class RewriteStrategy(Enum):
    """How a rewrite stages rows and puts runs back (see the module docstring)."""

    SMALL_SCRATCH = "small"  # CPU: cache-sized scratch, per-row gather for big units
    BATCHED = "batched"  # GPU: budget-sized batches, two kernels per batch
    FUSED = "fused"  # one Triton kernel, each row segment read and written once

    @classmethod
    def for_device(cls, device: torch.device) -> RewriteStrategy:
        """The one place a strategy is chosen: CPUs stage little, accelerators batch."""
        return cls.SMALL_SCRATCH if torch.device(device).type == "cpu" else cls.BATCHED

    @classmethod
    def parse(cls, value: str | RewriteStrategy) -> RewriteStrategy:
        if isinstance(value, RewriteStrategy):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise LayoutError(
                f"unknown rewrite strategy {value!r}; expected 'small', 'batched' or 'fused'"
            ) from None

    def default_budget_bytes(self, block_bytes: int) -> int:
        """The scratch budget when the caller names none; ``block_bytes`` is one block of
        what is rewritten (a group block, or a unit for bare unit rows)."""
        if self is not RewriteStrategy.SMALL_SCRATCH:  # fused: for segments it cannot fuse
            return BATCHED_SCRATCH_BUDGET_BYTES
        return block_bytes


def allocate_scratch(
    units: torch.Tensor, unit_bytes: int, num_ids: int, budget_bytes: int
) -> torch.Tensor:
    """Whole units of scratch: as many as the budget allows, at least one, no more than ids."""
    if budget_bytes < 0:
        raise LayoutError(f"scratch_budget_bytes={budget_bytes} must be >= 0")
    batch = max(1, min(num_ids, budget_bytes // unit_bytes))
    return torch.empty((batch, unit_bytes), dtype=torch.uint8, device=units.device)


def rewrite_rows(
    unit_tensors: list[torch.Tensor],
    ids: np.ndarray,
    run_bytes: int,
    runs: np.ndarray,
    scratch: torch.Tensor,
    strategy: RewriteStrategy,
) -> None:
    """In every tensor of ``unit_tensors``, move run ``j`` of each row ``ids`` to run
    ``runs[j]`` of the same row, staging ``len(scratch)`` rows at a time. Runs are
    ``run_bytes`` long and tile the row."""
    device = scratch.device
    if strategy is not RewriteStrategy.SMALL_SCRATCH:  # fused: what it could not fuse
        # one host-to-device copy for both index tables, before any kernel is queued: a
        # copy from pageable memory waits for the stream, so none may sit between kernels
        both = torch.as_tensor(np.concatenate([ids, runs]), device=device)
        ids_t, runs_t = both[: ids.size], both[ids.size :]
        for units in unit_tensors:
            _put_back_batched(units, ids_t, runs_t, run_bytes, scratch)
        return
    ids_t = torch.as_tensor(ids, device=device)
    for units in unit_tensors:
        if scratch.shape[1] >= _ROW_GATHER_MIN_BYTES:
            _gather_row_by_row(units, ids_t, runs, run_bytes, scratch)
        else:
            _scatter_batches(units, ids_t, runs, run_bytes, scratch)


def _put_back_batched(
    units: torch.Tensor,
    ids: torch.Tensor,
    runs: torch.Tensor,
    run_bytes: int,
    scratch: torch.Tensor,
) -> None:
    batch, unit_bytes = scratch.shape
    dtype = _widest_dtype(run_bytes, unit_bytes, units.stride(0), units.storage_offset())
    run_elems = run_bytes // dtype.itemsize
    elems = units.view(dtype)
    # the same memory as (row, run, element): row r's run k is runs_of_rows[r, k]
    runs_of_rows = elems.view(units.shape[0], runs.numel(), run_elems)
    dst_runs = runs[None, :]
    for start in range(0, ids.numel(), batch):
        rows = ids[start : start + batch]
        part = scratch[: rows.numel()].view(dtype)
        torch.index_select(elems, 0, rows, out=part)
        staged = part.view(rows.numel(), runs.numel(), run_elems)
        runs_of_rows.index_put_((rows[:, None], dst_runs), staged)


def _gather_row_by_row(
    units: torch.Tensor, ids: torch.Tensor, runs: np.ndarray, run_bytes: int, scratch: torch.Tensor
) -> None:
    batch, unit_bytes = scratch.shape
    dtype = _widest_dtype(run_bytes, unit_bytes, units.stride(0), units.storage_offset())
    run_elems = run_bytes // dtype.itemsize
    src_of = np.empty_like(runs)  # destination run k takes source run src_of[k]
    src_of[runs] = np.arange(runs.size, dtype=runs.dtype)
    src_of_t = torch.as_tensor(src_of, device=units.device)
    elems = units.view(dtype)
    row_ids = ids.tolist()  # one torch call per (large) row: the loop costs nothing on a CPU
    for start in range(0, len(row_ids), batch):
        rows = row_ids[start : start + batch]
        part = scratch[: len(rows)].view(dtype)
        torch.index_select(elems, 0, ids[start : start + batch], out=part)
        for j, row in enumerate(rows):
            out = elems[row].view(-1, run_elems)
            torch.index_select(part[j].view(-1, run_elems), 0, src_of_t, out=out)


def _scatter_batches(
    units: torch.Tensor, ids: torch.Tensor, runs: np.ndarray, run_bytes: int, scratch: torch.Tensor
) -> None:
    batch, unit_bytes = scratch.shape
    row_stride = units.stride(0)
    # runs must tile the rows' address space: cut them at the row stride if needed
    piece = math.gcd(run_bytes, row_stride)
    per_run = run_bytes // piece
    dst_piece = (runs[:, None] * per_run + np.arange(per_run)).reshape(-1)
    dtype = _widest_dtype(piece, unit_bytes, row_stride, units.storage_offset())
    elems = units.view(dtype)
    piece_elems = piece // dtype.itemsize
    num_pieces = ((units.shape[0] - 1) * row_stride + unit_bytes) // piece
    # every piece of every row, as one (num_pieces, piece) table over the same memory
    pieces = elems.as_strided((num_pieces, piece_elems), (piece_elems, 1))
    dst_piece_t = torch.as_tensor(dst_piece, device=units.device)
    for start in range(0, ids.numel(), batch):
        rows = ids[start : start + batch]
        part = scratch[: rows.numel()].view(dtype)
        torch.index_select(elems, 0, rows, out=part)
        where = torch.add(dst_piece_t[None, :], rows[:, None], alpha=row_stride // piece)
        pieces.index_copy_(0, where.view(-1), part.view(-1, piece_elems))


def _widest_dtype(*sizes: int) -> torch.dtype:
    """The widest plain element type whose size divides every size (and offset) given;
    complex128 is used as a 16-byte bit container, never for arithmetic."""
    for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8):
        if all(size % dtype.itemsize == 0 for size in sizes):
            return dtype
    raise AssertionError("unreachable: uint8 divides everything")
