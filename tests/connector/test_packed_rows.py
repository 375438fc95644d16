"""Packed rows: gather and scatter agree with a row-by-row copy, piece by piece."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.connector.worker.packed_rows import PackedRows, Segment, gather, scatter
from kvbridge.layouts.errors import KVBridgeError


def _units(rng: np.random.Generator, blocks: int, block_bytes: int, stride: int) -> torch.Tensor:
    """``[blocks, block_bytes]`` uint8 rows ``stride`` bytes apart (a strided region)."""
    flat = torch.from_numpy(rng.integers(0, 256, blocks * stride, dtype=np.uint8))
    return flat.view(blocks, stride)[:, :block_bytes]


def _by_row(packed: PackedRows, units: list[torch.Tensor]) -> np.ndarray:
    out = np.zeros(packed.num_bytes, dtype=np.uint8)
    for seg in packed.segments:
        m = seg.offsets.size
        for k, row in enumerate(seg.rows.tolist()):
            b, j = divmod(row, m)
            off = int(seg.offsets[j])
            at = seg.start + k * seg.length
            out[at : at + seg.length] = units[seg.region][b, off : off + seg.length].numpy()
    return out


def _case(seed: int) -> tuple[PackedRows, list[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    units = [_units(rng, 12, 256, 320), _units(rng, 9, 128, 128)]
    segs, at = [], 0
    # one piece a block (rows are block ids), two interleaved pieces, a piece of a split
    for region, offsets, length, rows in (
        (0, [0], 256, rng.permutation(12)[:7]),
        (1, [0, 64], 64, rng.permutation(18)[:11]),
        (0, [32, 160], 96, np.array([5, 0, 23, 2, 17])),
    ):
        seg = Segment(region, np.array(offsets), length, np.asarray(rows, np.int64), at)
        segs.append(seg)
        at += seg.num_bytes
    return PackedRows(tuple(segs), at), units


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_lays_rows_out_as_a_row_by_row_copy(seed: int) -> None:
    packed, units = _case(seed)
    out = torch.full((packed.num_bytes + 5,), 7, dtype=torch.uint8)
    gather(packed, units, out)
    assert np.array_equal(out[: packed.num_bytes].numpy(), _by_row(packed, units))
    assert (out[packed.num_bytes :] == 7).all()  # nothing past the range


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scatter_puts_every_row_back_and_touches_nothing_else(seed: int) -> None:
    packed, units = _case(seed)
    flat = torch.empty(packed.num_bytes, dtype=torch.uint8)
    gather(packed, units, flat)
    blank = [torch.zeros_like(u) for u in units]
    scatter(packed, blank, flat)
    assert np.array_equal(_by_row(packed, blank), flat.numpy())
    moved = sum(seg.num_bytes for seg in packed.segments)
    assert sum(int((b != 0).sum()) for b in blank) <= moved
    for seg in packed.segments:  # bytes outside the named rows stay zero
        mask = torch.zeros_like(blank[seg.region], dtype=torch.bool)
        m = seg.offsets.size
        for row in seg.rows.tolist():
            b, j = divmod(row, m)
            mask[b, int(seg.offsets[j]) : int(seg.offsets[j]) + seg.length] = True
        others = [s for s in packed.segments if s.region == seg.region and s is not seg]
        if not others:
            assert (blank[seg.region][~mask] == 0).all()


def test_a_range_too_short_or_rows_outside_the_region_are_refused() -> None:
    packed, units = _case(0)
    with pytest.raises(KVBridgeError, match=f"range of {packed.num_bytes} B"):
        gather(packed, units, torch.empty(packed.num_bytes - 1, dtype=torch.uint8))
    seg = packed.segments[0]
    bad = PackedRows((Segment(0, seg.offsets, seg.length, np.array([12]), 0),), seg.length)
    with pytest.raises(KVBridgeError, match="outside the 12 rows of region 0"):
        scatter(bad, units, torch.empty(seg.length, dtype=torch.uint8))
