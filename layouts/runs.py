"""Adjacent runs: paired descriptor rows that can move as one descriptor.

A transfer pairs local row ``lrows[k]`` with remote row ``rrows[k]``. Positions ``k`` and
``k + 1`` belong to one run when, on both sides, position ``k + 1`` picks the next row of
the table and that row starts exactly where row ``k`` ends::

    position            0     1     2     3     4
    local rows          7     8     9     3     4
    remote rows        40    41    50    51    52
    k -> k+1 joins         yes   no    no    yes
    runs              [ 0     1 ] [2] [ 3     4 ]      5 rows -> 3 descriptors

Whether row ``r + 1`` starts where row ``r`` ends comes from the table itself
(:func:`next_adjacent`, once per prepared table), never from the row numbers: in a table
of pieces (per-layer K/V parts, split chunks) row ``r + 1`` is the next piece of the same
block, adjacent only when the pieces tile it, and a block's last piece is followed by the
next block's first only when the blocks are packed without gaps.

Pure numpy, no per-row Python loops.
"""

from __future__ import annotations

import numpy as np

from kvbridge.layouts.errors import LayoutError


def next_adjacent(table: np.ndarray, segments: np.ndarray | None = None) -> np.ndarray:
    """``out[r]``: row ``r + 1`` of an Nx3 ``(addr, len, device_id)`` table starts where
    row ``r`` ends, on the same device and, when ``segments`` is given, in the same segment
    (e.g. the same registration: memory that merely touches is not one allocation).
    ``out[N - 1]`` is False. Read-only bool array of length N."""
    t = np.asarray(table, dtype=np.int64)
    if t.ndim != 2 or t.shape[1] != 3:
        raise LayoutError(f"need an Nx3 (addr, len, device_id) table, got shape {t.shape}")
    out = np.zeros(len(t), dtype=bool)
    if len(t) > 1:
        joins = (t[:-1, 0] + t[:-1, 1] == t[1:, 0]) & (t[:-1, 2] == t[1:, 2])
        if segments is not None:
            seg = np.asarray(segments)
            if seg.shape != (len(t),):
                raise LayoutError(f"{len(t)} table rows but segments of shape {seg.shape}")
            joins &= seg[:-1] == seg[1:]
        out[:-1] = joins
    out.flags.writeable = False
    return out


def run_starts(
    lrows: np.ndarray,
    local_next: np.ndarray,
    rrows: np.ndarray,
    remote_next: np.ndarray,
) -> np.ndarray:
    """Positions (int64, ascending, the first 0) where the maximal runs of the pairing
    ``lrows[k] <-> rrows[k]`` begin; ``*_next`` are the tables' :func:`next_adjacent`.
    Empty for no rows; ``len(result) == len(lrows)`` when nothing joins."""
    lo = np.asarray(lrows, dtype=np.int64)
    ro = np.asarray(rrows, dtype=np.int64)
    if lo.shape != ro.shape or lo.ndim != 1:
        raise LayoutError(f"paired rows need equal 1-D shapes, got {lo.shape} and {ro.shape}")
    if lo.size == 0:
        return np.zeros(0, dtype=np.int64)
    joins = (
        (lo[1:] == lo[:-1] + 1)
        & (ro[1:] == ro[:-1] + 1)
        & np.asarray(local_next)[lo[:-1]]
        & np.asarray(remote_next)[ro[:-1]]
    )
    return np.flatnonzero(np.concatenate(([True], ~joins)))


def merge_rows(
    table: np.ndarray,
    rows: np.ndarray,
    starts: np.ndarray,
    run_lens: np.ndarray | None = None,
) -> np.ndarray:
    """One descriptor per run: the address and device of the run's first row, the total
    length of its rows. ``starts`` from :func:`run_starts` (Nx3 int64, N = len(starts)).
    ``run_lens`` (:func:`run_lengths`) when already known: both sides of a pairing share
    them, their rows being pairwise of equal length."""
    t = np.asarray(table, dtype=np.int64)
    picked = np.asarray(rows, dtype=np.int64)
    first = np.asarray(starts, dtype=np.int64)
    if first.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    out = t[picked[first]]  # fancy indexing: a copy
    out[:, 1] = run_lengths(t[picked, 1], first) if run_lens is None else run_lens
    return out


def run_lengths(row_lens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Bytes of each run: ``row_lens[k]`` is the length of position ``k``'s row."""
    if len(starts) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(np.asarray(row_lens, dtype=np.int64), starts)
