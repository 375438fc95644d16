"""Which descriptor rows move one load of one group: a pure function of the plan.

Decode uses it to READ (pull); prefill uses the very same function, on decode's plan and
decode's group spec, to WRITE into decode's blocks (push), and both sides digest a
verified load by it. ``reader_*`` is always decode's side of the plan (its blocks and
rows), ``writer_*`` prefill's::

    tokens [lo, end) of the load   (a sliding window: lo >= end - window + 1, what
                                    token end, the first decode computes, attends to)
      -> wire chunks of the plan   (g.chunks_for_tokens)
      -> per piece stream: reader rows and writer rows, pairwise equal lengths

A state group moves one block: prefill's resume state after ``end`` tokens, into decode's
block of token ``end - 1``. Engine-packed prefill pages larger than decode's (or not
dividing them) are not rows of decode's blocks: they go whole through decode's staging
slots (``Staged``), round by round, and :func:`staged_rows` gives the rows of one round
(slot ids on decode's side, prefill's page ids on the writer's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.connector.worker.staging.staged_reads import Staged
from kvbridge.handshake.plan_model import GroupPlan
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.specs import KVCacheKind, KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True)
class GroupRows:
    """The rows of one group: ``rows[k] = (stream index, reader rows, writer rows)``."""

    rows: tuple[tuple[int, np.ndarray, np.ndarray], ...] = ()
    touched: np.ndarray | None = None  # reader block ids that receive data
    staged: Staged | None = None  # pages that go through staging slots instead

    @property
    def num_descs(self) -> int:
        return sum(int(r.size) for _, r, _ in self.rows)


def group_rows(
    g: GroupPlan,
    reader_spec: KVCacheSpec,
    reader_ids: np.ndarray,
    writer_ids: np.ndarray,
    writer_first: int,
    start: int,
    end: int,
) -> GroupRows:
    """The rows that move tokens ``[start, end)`` of group ``g``; ``reader_ids`` are the
    reader's block ids by logical block, ``writer_ids[i]`` the writer's id of logical block
    ``writer_first + i``. Raises :class:`KVBridgeError` when the ids do not cover the load."""
    lids = np.asarray(reader_ids, dtype=np.int64)
    rids = np.asarray(writer_ids, dtype=np.int64)
    if g.kind is KVCacheKind.STATE:
        if end <= start:
            return GroupRows()
        lblock = (end - 1) // reader_spec.block_size
        if rids.size != 1 or not 0 <= lblock < lids.size:
            raise KVBridgeError(
                f"state for token {end} needs one remote block (got {rids.size}) and "
                f"local block {lblock} (have {lids.size})"
            )
        rows = []
        for i, stream in enumerate(g.streams):
            m = stream.num_pieces
            rows.append((i, lids[lblock] * m + np.arange(m), rids[0] * m + np.arange(m)))
        return GroupRows(rows=tuple(rows), touched=lids[lblock : lblock + 1])
    lo = start
    if isinstance(reader_spec, SlidingWindowSpec):
        lo = max(start, reader_spec.window_start(end))
    _check_covered(g, lids.size, rids.size, writer_first, start, end)
    if g.split_from:
        blocks = g.chunks_for_tokens(lo, end)  # one chunk per remote block
        if blocks.size and (blocks[0] < writer_first or blocks[-1] - writer_first >= rids.size):
            raise KVBridgeError(
                f"group {g.group_id}: tokens [{lo}, {end}) need remote blocks "
                f"{blocks[0]}..{blocks[-1]} but prefill sent "
                f"{writer_first}..{writer_first + rids.size - 1}"
            )
        if not blocks.size:
            return GroupRows()
        return GroupRows(staged=Staged(g, blocks, lo, end, lids, rids, writer_first))
    chunks = g.chunks_for_tokens(lo, end)
    if chunks.size == 0:
        return GroupRows()
    rows = []
    for i, stream in enumerate(g.streams):
        lrows, rrows = g.indices(stream, chunks, lids, rids, remote_first_block=writer_first)
        rows.append((i, lrows, rrows))
    return GroupRows(rows=tuple(rows), touched=lids[chunks // g.local_chunks_per_block])


def _check_covered(
    g: GroupPlan, num_reader: int, num_writer: int, writer_first: int, start: int, end: int
) -> None:
    """Before any array is sized by the token range (a peer names it): the tokens must lie
    within the blocks both sides named. Raises :class:`KVBridgeError` naming the numbers."""
    if not 0 <= start <= end:
        raise KVBridgeError(f"group {g.group_id}: the load names tokens [{start}, {end})")
    if end == start:
        return
    per_block = g.wire_tokens * g.remote_chunks_per_block  # tokens of one writer block
    # a group another pipeline stage holds moves nothing: its plan is decode's shape only
    # (the writer's blocks are not counted in it), so only the reader's bound applies
    if g.streams and end > (writer_first + num_writer) * per_block:
        raise KVBridgeError(
            f"group {g.group_id}: tokens up to {end} need remote logical blocks up to "
            f"{-(-end // per_block) - 1} but only {writer_first}..{writer_first + num_writer - 1} "
            f"were given"
        )
    per_block = g.wire_tokens * g.local_chunks_per_block
    if not g.split_from and end > num_reader * per_block:
        raise KVBridgeError(
            f"group {g.group_id}: tokens up to {end} need local logical blocks up to "
            f"{-(-end // per_block) - 1} but only 0..{num_reader - 1} were given"
        )


def staged_rows(
    g: GroupPlan,
    blocks: np.ndarray,
    slots: np.ndarray,
    writer_ids: np.ndarray,
    writer_first: int,
    num_slots: int,
) -> tuple[tuple[int, np.ndarray, np.ndarray], ...]:
    """The rows that move the writer's whole pages of logical blocks ``blocks`` into the
    reader's staging ``slots`` (``num_slots`` of the group's slot size): per stream, slot
    ids (reader) and the writer's block ids. Raises :class:`KVBridgeError` naming what
    does not fit."""
    blocks = np.asarray(blocks, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    wids = np.asarray(writer_ids, dtype=np.int64)
    if not g.split_from:
        raise KVBridgeError(f"group {g.group_id} is not staged by the plan")
    if blocks.size != slots.size or blocks.size == 0:
        raise KVBridgeError(
            f"group {g.group_id}: {blocks.size} pages for {slots.size} staging slots"
        )
    pos = blocks - writer_first
    if pos.min() < 0 or pos.max() >= wids.size:
        raise KVBridgeError(
            f"group {g.group_id}: pages {blocks.min()}..{blocks.max()} asked, the request "
            f"keeps {writer_first}..{writer_first + wids.size - 1}"
        )
    if slots.min() < 0 or slots.max() >= num_slots or np.unique(slots).size != slots.size:
        raise KVBridgeError(
            f"group {g.group_id}: staging slots {slots.tolist()[:8]} are not distinct slots "
            f"of the reader's {num_slots}"
        )
    return tuple((i, slots, wids[pos]) for i in range(len(g.streams)))
