"""Digests of one load's rows, per group, on either side of the plan.

Decode and prefill name the rows of a load with the very same function
(:func:`kvbridge.connector.worker.rows.group_rows`, on decode's plan): decode its own
rows (the *reader* side, where the bytes land), prefill its rows (the *writer* side, what
decode READs or prefill WRITEs). Each side digests its rows in its own memory
(:mod:`kvbridge.layouts.digest`), in the plan's order, so equal digests mean decode holds,
row for row, the bytes prefill had::

    plan group g --group_rows--> per stream i: (reader rows, writer rows), pairwise
    reader: row_sums(decode's units of stream i's local region,  local offsets,  rows)
    writer: row_sums(prefill's units of stream i's remote region, remote offsets, rows)
    digest of g = fold(concatenated row sums, stream by stream)

Both sides must digest by one definition (``DIGEST_VERSION``, in each description): a
peer that digests by another is refused a verified load by name
(:func:`version_refusal`), before anything is compared.

Groups whose pages go through decode's staging slots (``GroupPlan.split_from``) land
whole pages in slots, round by round, and the engine repacks them into its blocks: the
writer digests its whole pages (page ids by remote logical block), the reader the sums it
took of each page as it landed, before the repack (``StagedReads.split``), both stream
by stream in the order of the remote logical blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.connector.common.notifications import GroupDigest
from kvbridge.connector.worker.rows import GroupRows
from kvbridge.connector.worker.staging.staged_reads import Staged, StagedSums
from kvbridge.handshake.plan_model import GroupPlan, TransferPlan
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.digest import DIGEST_VERSION, fold, row_sums


class PlanSide(enum.Enum):
    READER = "reader"  # decode: the plan's local side
    WRITER = "writer"  # prefill: the plan's remote side


@dataclass(frozen=True)
class LoadDigests:
    """The digests of one load's groups, and the groups left out (staged pages)."""

    digests: tuple[GroupDigest, ...]
    unverified: tuple[int, ...] = ()

    def mismatches(self, theirs: Sequence[GroupDigest]) -> list[str]:
        """Why ``theirs`` (the other side's digests) differ from ours, group by group
        ([] when every group agrees)."""
        want = {d.group_id: d for d in theirs}
        out = []
        for mine in self.digests:
            other = want.pop(mine.group_id, None)
            if other is None:
                out.append(f"group {mine.group_id}: no digest from the other side")
            elif (other.digest, other.num_rows) != (mine.digest, mine.num_rows):
                out.append(
                    f"group {mine.group_id}: {mine.num_rows} rows digest {mine.digest:#018x} "
                    f"here, {other.num_rows} rows {other.digest:#018x} there"
                )
        out += [f"group {g}: digested there, not here" for g in sorted(want)]
        return out


def version_refusal(theirs: int, who: str) -> str:
    """'' when ``who`` digests rows as this worker does (``theirs``: its description's
    ``digest_version``), else why a verified load with it is refused: digests of two
    definitions never agree, and would be reported as corruption."""
    if theirs == DIGEST_VERSION:
        return ""
    return (
        f"{who} digests rows by digest_version {theirs}, this worker by {DIGEST_VERSION} "
        f"(kvbridge.layouts.digest): the two cannot be compared; upgrade both sides, or "
        f'set extra.verify to "off" on decode until they are'
    )


def region_units(buffers: KVCacheBuffers) -> list[torch.Tensor]:
    """The ``[blocks, bytes]`` memory of each region, in the order a description lists
    the regions (``kvbridge.handshake.description.describe``)."""
    return [s.units for g in buffers.config.groups for s in buffers.unit_slots(g.group_id)]


def load_digests(
    plan: TransferPlan,
    side: PlanSide,
    units: Sequence[torch.Tensor],
    rows_of: Callable[[GroupPlan], GroupRows],
    staged_sums: StagedSums | None = None,
) -> LoadDigests:
    """Digest the rows ``rows_of(g)`` names for every group of ``plan``, on ``side``;
    ``units``: that side's region memory (:func:`region_units`). Staged groups: the
    writer digests its whole pages; the reader digests the sums it took of the pages as
    they landed in its slots (``staged_sums``; none: the group is left ``unverified``)."""
    digests, unverified = [], []
    for g in plan.groups:
        found = rows_of(g)
        if found.staged is not None:
            flat = _staged(g, found.staged, side, units, staged_sums)
            if flat is None:
                unverified.append(g.group_id)
            else:
                digests.append(GroupDigest(g.group_id, fold(flat), int(flat.size)))
            continue
        sums = []
        for i, reader_rows, writer_rows in found.rows:
            stream = g.streams[i]
            if side is PlanSide.READER:
                region, offsets, rows = stream.local_region, g.local_offsets(stream), reader_rows
            else:
                region, offsets, rows = stream.remote_region, g.remote_offsets(stream), writer_rows
            sums.append(row_sums(units[region], offsets, stream.length, rows))
        flat = np.concatenate(sums) if sums else np.zeros(0, dtype=np.int64)
        digests.append(GroupDigest(g.group_id, fold(flat), int(flat.size)))
    return LoadDigests(tuple(digests), tuple(unverified))


def _staged(
    g: GroupPlan,
    staged: Staged,
    side: PlanSide,
    units: Sequence[torch.Tensor],
    sums: StagedSums | None,
) -> np.ndarray | None:
    """Row sums of a staged group's whole pages, stream by stream, page by page (the
    remote logical blocks in order): the writer's from its memory, the reader's as the
    pages landed (None: not taken, or a page missing)."""
    blocks = staged.remote_blocks
    if side is PlanSide.WRITER:
        rows = staged.remote_ids[blocks - staged.remote_first]
        return np.concatenate(
            [
                row_sums(units[s.remote_region], g.remote_offsets(s), s.length, rows)
                for s in g.streams
            ]
        )
    if sums is None:
        return None
    out = []
    for i in range(len(g.streams)):
        landed = sums.get((g.group_id, i), {})
        if any(b not in landed for b in blocks.tolist()):
            return None
        out.append(np.array([landed[b] for b in blocks.tolist()], dtype=np.int64))
    return np.concatenate(out)
