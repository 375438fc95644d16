"""``kvbridge.connector.worker.rows.staged_rows``: the rows of one push round through decode's
staging slots, and what a prefill refuses in a Push before it writes anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.connector.worker.rows import group_rows, staged_rows
from kvbridge.handshake.plan_model import GroupPlan, PieceStream
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.specs import AttentionSpec, KVCacheKind


def _plan(split_from: int = 128, num_layers: int = 2) -> GroupPlan:
    stream = PieceStream(
        local_region=0,
        remote_region=0,
        local_offsets=(0,),
        remote_offsets=(0,),
        length=4096,
        local_chunk_bytes=4096,
        remote_chunk_bytes=4096,
    )
    return GroupPlan(
        group_id=0,
        kind=KVCacheKind.FULL_ATTENTION,
        wire_tokens=split_from or 32,
        local_chunks_per_block=1,
        remote_chunks_per_block=1,
        sender=None,
        receiver=None,
        streams=(stream,) * num_layers,
        split_from=split_from,
    )


def test_pages_map_to_the_writers_blocks_and_the_readers_slots():
    # the request keeps logical blocks 2..5 as prefill blocks 40, 7, 19, 3
    rows = staged_rows(_plan(), np.array([3, 5]), np.array([1, 0]), np.array([40, 7, 19, 3]), 2, 4)
    assert len(rows) == 2  # one per layer stream
    for i, (stream, slots, writer) in enumerate(rows):
        assert stream == i
        assert slots.tolist() == [1, 0] and writer.tolist() == [7, 3]


@pytest.mark.parametrize(
    ("plan", "blocks", "slots", "match"),
    [
        (_plan(split_from=0), [2], [0], "not staged by the plan"),
        (_plan(), [2, 3], [0], "2 pages for 1 staging slots"),
        (_plan(), [], [], "0 pages for 0 staging slots"),
        (_plan(), [1, 2], [0, 1], r"pages 1\.\.2 asked, the request keeps 2\.\.5"),
        (_plan(), [5, 6], [0, 1], r"pages 5\.\.6 asked, the request keeps 2\.\.5"),
        (_plan(), [2, 3], [3, 4], r"staging slots \[3, 4\] are not distinct slots of the .* 4"),
        (_plan(), [2, 3], [1, 1], r"staging slots \[1, 1\] are not distinct"),
        (_plan(), [2], [-1], r"staging slots \[-1\]"),
    ],
)
def test_a_push_that_does_not_fit_is_refused_by_name(plan, blocks, slots, match):
    with pytest.raises(KVBridgeError, match=match):
        staged_rows(plan, np.array(blocks), np.array(slots), np.array([40, 7, 19, 3]), 2, 4)


def _skipped(block_size: int) -> GroupPlan:
    """A group another pipeline stage holds, as ``handshake.plan`` plans it: decode's
    block size, no streams (nothing moves)."""
    return GroupPlan(
        group_id=0,
        kind=KVCacheKind.FULL_ATTENTION,
        wire_tokens=block_size,
        local_chunks_per_block=1,
        remote_chunks_per_block=1,
        sender=None,
        receiver=None,
        streams=(),
        skipped=True,
    )


def test_a_group_another_stage_holds_is_bounded_by_the_readers_blocks_only():
    """Prefill's 64-token blocks are not counted in such a plan (decode's 16-token shape):
    its 16 blocks hold 1,000 tokens; only decode's own blocks bound the range."""
    spec = AttentionSpec(block_size=16, num_kv_heads=1, head_size=4, dtype=torch.float16)
    found = group_rows(_skipped(16), spec, np.arange(63), np.arange(16), 0, 0, 1000)
    assert found.rows == ()
    with pytest.raises(KVBridgeError, match="need local logical blocks"):
        group_rows(_skipped(16), spec, np.arange(63), np.arange(16), 0, 0, 2**31 - 1)
