"""Adjacent runs (kvbridge.layouts.runs): which paired rows move as one descriptor.

Every case is checked against a per-position reference (a plain loop, here only) and the
merged descriptors against the bytes they cover.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.layouts.descriptors import block_descriptors, descriptor_table, piece_offsets
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.region import KVRegion, MemoryKind
from kvbridge.layouts.runs import merge_rows, next_adjacent, run_starts


def _table(addrs, length: int = 64, device: int = 0) -> np.ndarray:
    addrs = np.asarray(addrs, dtype=np.int64)
    return np.stack(
        [addrs, np.full(addrs.size, length, np.int64), np.full(addrs.size, device, np.int64)],
        axis=1,
    )


def _packed(num_rows: int, base: int = 1 << 20, length: int = 64) -> np.ndarray:
    """Rows packed end to start: every row r + 1 is adjacent to row r."""
    return _table(base + np.arange(num_rows) * length, length)


def _region(num_blocks: int, block_bytes: int, stride: int) -> KVRegion:
    return KVRegion(
        name="layer.0",
        base_addr=1 << 24,
        block_bytes=block_bytes,
        block_stride_bytes=stride,
        num_blocks=num_blocks,
        memory_kind=MemoryKind.DRAM,
    )


def _reference(lt, lrows, rt, rrows) -> list[int]:
    """Run starts by the definition, one position at a time."""
    starts = []
    for k in range(len(lrows)):
        joins = k > 0 and all(
            rows[k] == rows[k - 1] + 1
            and t[rows[k - 1], 0] + t[rows[k - 1], 1] == t[rows[k], 0]
            and t[rows[k - 1], 2] == t[rows[k], 2]
            for t, rows in ((lt, lrows), (rt, rrows))
        )
        if not joins:
            starts.append(k)
    return starts


def _runs(lt, lrows, rt, rrows) -> np.ndarray:
    starts = run_starts(lrows, next_adjacent(lt), rrows, next_adjacent(rt))
    assert starts.tolist() == _reference(lt, lrows, rt, rrows)
    return starts


def _covered(table: np.ndarray, rows) -> list[tuple[int, int]]:
    """The byte ranges rows cover, adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for addr, length, _ in table[np.asarray(rows, dtype=np.int64)].tolist():
        if out and out[-1][1] == addr:
            out[-1] = (out[-1][0], addr + length)
        else:
            out.append((addr, addr + length))
    return out


def test_empty_rows_have_no_runs() -> None:
    t = _packed(4)
    starts = _runs(t, np.zeros(0, np.int64), t, np.zeros(0, np.int64))
    assert starts.size == 0 and starts.dtype == np.int64
    assert merge_rows(t, np.zeros(0, np.int64), starts).shape == (0, 3)


def test_single_row_is_one_run() -> None:
    lt, rt = _packed(8), _packed(8, base=1 << 30)
    starts = _runs(lt, np.array([5]), rt, np.array([2]))
    assert starts.tolist() == [0]
    assert merge_rows(lt, np.array([5]), starts).tolist() == lt[[5]].tolist()


def test_all_consecutive_is_one_run_covering_every_byte() -> None:
    lt, rt = _packed(100), _packed(100, base=1 << 30)
    lrows, rrows = np.arange(10, 60), np.arange(40, 90)
    starts = _runs(lt, lrows, rt, rrows)
    assert starts.tolist() == [0]
    local, remote = merge_rows(lt, lrows, starts), merge_rows(rt, rrows, starts)
    assert local.tolist() == [[lt[10, 0], 50 * 64, 0]]
    assert remote.tolist() == [[rt[40, 0], 50 * 64, 0]]


def test_gap_on_one_side_only_splits_the_run() -> None:
    lt, rt = _packed(100), _packed(100, base=1 << 30)
    lrows = np.array([0, 1, 2, 3, 4, 5])
    rrows = np.array([10, 11, 12, 20, 21, 22])  # remote jumps after position 2
    assert _runs(lt, lrows, rt, rrows).tolist() == [0, 3]
    assert _runs(rt, rrows, lt, lrows).tolist() == [0, 3]  # and the other way round
    assert _runs(lt, np.array([7, 8, 9, 8, 9]), rt, np.arange(5)).tolist() == [0, 3]


def test_consecutive_rows_in_memory_that_does_not_touch_stay_apart() -> None:
    # row numbers advance by one, but every row sits 16 bytes after the previous one ends
    gappy = _table(np.arange(10) * 80, length=64)
    packed = _packed(10)
    rows = np.arange(10)
    assert _runs(gappy, rows, packed, rows).tolist() == list(range(10))
    assert _runs(packed, rows, gappy, rows).tolist() == list(range(10))


def test_rows_on_another_device_or_segment_stay_apart() -> None:
    t = _packed(6)
    t[3, 2] = 1  # touches row 2 in address, but on device 1
    assert not next_adjacent(t)[2] and not next_adjacent(t)[3]
    assert next_adjacent(t).tolist() == [True, True, False, False, True, False]
    # two allocations that happen to touch: never one descriptor
    segments = np.array([0, 0, 0, 1, 1, 1])
    assert next_adjacent(_packed(6), segments).tolist() == [True, True, False, True, True, False]
    rows = np.arange(6)
    starts = run_starts(rows, next_adjacent(_packed(6), segments), rows, next_adjacent(_packed(6)))
    assert starts.tolist() == [0, 3]


def test_per_layer_block_table_runs_follow_block_ids() -> None:
    region = _region(32, 4096, 4096)
    table = descriptor_table(region)  # one row per block, packed: every block touches the next
    assert next_adjacent(table)[:-1].all()
    lids = np.array([3, 4, 5, 6, 20, 21, 9])  # a fresh allocation, then two more pieces
    rids = np.array([0, 1, 2, 3, 4, 5, 6])
    starts = _runs(table, lids, table, rids)
    assert starts.tolist() == [0, 4, 6]
    merged = merge_rows(table, lids, starts)
    assert merged[:, 1].tolist() == [4 * 4096, 2 * 4096, 4096]
    assert _covered(merged, np.arange(3)) == _covered(table, lids)


def test_strided_blocks_never_merge_although_ids_are_consecutive() -> None:
    # blocks_first per-layer caches hold K and V of a block apart: a K piece table has
    # a gap of one piece between consecutive blocks
    region = _region(16, 2048, 4096)
    table = descriptor_table(region)
    assert not next_adjacent(table).any()
    ids = np.arange(16)
    assert _runs(table, ids, table, ids).tolist() == list(range(16))


def test_pieces_merge_within_a_block_and_across_blocks_only_when_they_tile() -> None:
    region = _region(8, 4096, 4096)
    # 4 pieces tiling each block: the whole table is one packed run
    tiling = descriptor_table(region, offsets=piece_offsets(region, 4), length=1024)
    assert next_adjacent(tiling)[:-1].all()
    # 2 of 4 pieces (e.g. one layer of a cross-layer block): adjacent within a block only
    halves = block_descriptors(region, np.arange(8), offsets=np.array([0, 1024]), length=1024)
    assert next_adjacent(halves).tolist() == [True, False] * 8
    rows = np.arange(16)
    starts = _runs(halves, rows, tiling, np.arange(16))
    assert starts.tolist() == list(range(0, 16, 2))
    assert merge_rows(halves, rows, starts)[:, 1].tolist() == [2048] * 8


def test_random_pairings_match_the_reference() -> None:
    rng = np.random.default_rng(7)
    lt = _packed(64)
    rt = _table(np.cumsum(rng.choice([64, 64, 64, 128], size=64)), length=64)  # some gaps
    for _ in range(50):
        n = int(rng.integers(1, 40))
        lstart, rstart = int(rng.integers(0, 64 - n)), int(rng.integers(0, 64 - n))
        lrows = np.arange(lstart, lstart + n)
        rrows = np.arange(rstart, rstart + n)
        swap = rng.random(n) < 0.1  # a few positions jump elsewhere
        lrows[swap] = rng.integers(0, 64, int(swap.sum()))
        starts = _runs(lt, lrows, rt, rrows)
        local, remote = merge_rows(lt, lrows, starts), merge_rows(rt, rrows, starts)
        assert int(local[:, 1].sum()) == int(remote[:, 1].sum()) == 64 * n
        assert (local[:, 1] == remote[:, 1]).all()  # each run pairs equal byte counts
        assert _covered(local, np.arange(len(local))) == _covered(lt, lrows)
        assert _covered(remote, np.arange(len(remote))) == _covered(rt, rrows)


def test_bad_shapes_are_refused_by_name() -> None:
    with pytest.raises(LayoutError, match="Nx3"):
        next_adjacent(np.zeros((4, 2), np.int64))
    with pytest.raises(LayoutError, match="segments"):
        next_adjacent(_packed(4), np.zeros(3, np.int64))
    adj = next_adjacent(_packed(4))
    with pytest.raises(LayoutError, match="equal 1-D"):
        run_starts(np.arange(3), adj, np.arange(2), adj)
    with pytest.raises(ValueError):
        adj[0] = False  # read-only: prepared once, shared by every transfer
