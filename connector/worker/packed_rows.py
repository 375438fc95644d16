"""One load's rows as one contiguous range of bytes: gathered by prefill, scattered by decode.

A load of a per-layer cache moves thousands of small rows (blocks-first: one per block and
layer; kv-split: two), and each row a transfer posts costs the transport a fixed amount
(~2.5 us on CPU through UCX's cma, ~10 us on a GPU through CUDA IPC), more than its bytes.
Packed, the rows travel as one range: prefill copies them, in the plan's order, into a
registered arena (``kvbridge.connector.worker.prefill.gather_arena``), decode READs that
range into its own arena and copies the rows out into its blocks::

    plan group g --group_rows--> per stream i: (reader rows, writer rows), pairwise
    packed range  [ g0 stream 0 rows | g0 stream 1 rows | ... | g1 stream 0 rows | ... ]
    prefill:  writer rows of its memory --gather--> its arena range   (one copy)
    decode:   READ of that range (one descriptor) --> its arena range --scatter--> reader rows

Both sides name the rows with the same function (:func:`kvbridge.connector.worker.rows
.group_rows`, on decode's plan) and lay them out here the same way, so the range has the
same bytes at the same places on both: row ``k`` of segment ``s`` lies at
``segments[s].start + k * segments[s].length``. Groups whose pages go through staging
slots (``GroupPlan.split_from``) do not pack.

Host memory is copied with numpy on the calling thread (no torch parallel region to wait
for beside NIXL's threads, as ``kvbridge.layouts.digest`` found); GPU memory with torch on
the current stream, which the caller orders (``kvbridge.connector.worker.device_order``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.connector.worker.digests import PlanSide
from kvbridge.connector.worker.rows import GroupRows
from kvbridge.handshake.plan_model import GroupPlan, TransferPlan
from kvbridge.layouts.errors import KVBridgeError


@dataclass(frozen=True, eq=False)
class Segment:
    """The rows of one (group, stream) on one side, and where they lie in the range."""

    region: int  # index into that side's region units
    offsets: np.ndarray  # the piece offsets of a block (row b * m + j: piece j of block b)
    length: int  # bytes per row
    rows: np.ndarray
    start: int  # byte offset of the first row in the packed range

    @property
    def num_bytes(self) -> int:
        return int(self.rows.size) * self.length


@dataclass(frozen=True, eq=False)
class PackedRows:
    """One load's rows on one side of the plan, laid out back to back."""

    segments: tuple[Segment, ...]
    num_bytes: int

    @property
    def num_rows(self) -> int:
        return sum(int(s.rows.size) for s in self.segments)


def packed_rows(
    plan: TransferPlan, side: PlanSide, rows_of: Callable[[GroupPlan], GroupRows]
) -> PackedRows | None:
    """The rows ``rows_of(g)`` names for every group of ``plan`` on ``side``, packed in
    the plan's order; None when a group goes through staging slots (it cannot pack)."""
    segments: list[Segment] = []
    at = 0
    for g in plan.groups:
        found = rows_of(g)
        if found.staged is not None:
            return None
        for i, reader_rows, writer_rows in found.rows:
            stream = g.streams[i]
            if side is PlanSide.READER:
                region, offsets, rows = stream.local_region, g.local_offsets(stream), reader_rows
            else:
                region, offsets, rows = stream.remote_region, g.remote_offsets(stream), writer_rows
            rows = np.asarray(rows, dtype=np.int64).reshape(-1)
            if not rows.size:
                continue
            seg = Segment(region, np.asarray(offsets, np.int64), stream.length, rows, at)
            segments.append(seg)
            at += seg.num_bytes
    return PackedRows(tuple(segments), at)


def gather(packed: PackedRows, units: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy every row of ``packed`` from ``units`` (a side's region memory, ``[blocks,
    bytes]`` uint8 each) into ``out`` (1-D uint8, at least ``num_bytes`` long)."""
    _check(packed, units, out)
    for seg in packed.segments:
        dst = out[seg.start : seg.start + seg.num_bytes].view(-1, seg.length)
        for piece, at, blocks in _pieces(seg, units[seg.region]):
            if units[seg.region].is_cuda:
                if at is None:
                    torch.index_select(piece, 0, _on(blocks, piece), out=dst)
                else:
                    dst.index_copy_(0, _on(at, piece), piece.index_select(0, _on(blocks, piece)))
            elif at is None:
                np.take(piece.numpy(), blocks, axis=0, out=dst.numpy())
            else:
                dst.numpy()[at] = piece.numpy()[blocks]


def scatter(packed: PackedRows, units: Sequence[torch.Tensor], src: torch.Tensor) -> None:
    """Copy every row of ``packed`` from ``src`` (1-D uint8, laid out as :func:`gather`
    writes it) into its place in ``units``."""
    _check(packed, units, src)
    for seg in packed.segments:
        rows = src[seg.start : seg.start + seg.num_bytes].view(-1, seg.length)
        for piece, at, blocks in _pieces(seg, units[seg.region]):
            if units[seg.region].is_cuda:
                part = rows if at is None else rows.index_select(0, _on(at, rows))
                piece.index_copy_(0, _on(blocks, piece), part)
            else:
                part = rows.numpy() if at is None else rows.numpy()[at]
                piece.numpy()[blocks] = part


def _pieces(
    seg: Segment, units: torch.Tensor
) -> list[tuple[torch.Tensor, np.ndarray | None, np.ndarray]]:
    """Per piece ``j`` the segment names: ``units``' bytes of piece ``j`` of every block
    (``[blocks, length]``), the positions of its rows in the segment (None: every row,
    in order) and their block ids."""
    m = seg.offsets.size
    blocks, pieces = np.divmod(seg.rows, m)
    kinds = np.unique(pieces)
    out = []
    for j in kinds.tolist():
        off = int(seg.offsets[j])
        piece = units[:, off : off + seg.length]
        if kinds.size == 1:
            out.append((piece, None, blocks))
        else:
            at = np.flatnonzero(pieces == j)
            out.append((piece, at, blocks[at]))
    return out


def _on(ids: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Indices on ``like``'s GPU, copied from pinned memory without a host wait (torch's
    pinned allocator keeps the source until the copy ran)."""
    host = torch.from_numpy(np.ascontiguousarray(ids))
    return host.pin_memory().to(like.device, non_blocking=True)


def _check(packed: PackedRows, units: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    if flat.dim() != 1 or flat.dtype != torch.uint8 or flat.numel() < packed.num_bytes:
        raise KVBridgeError(
            f"packed rows: need a 1-D uint8 range of {packed.num_bytes} B, got "
            f"{tuple(flat.shape)} {flat.dtype}"
        )
    for seg in packed.segments:
        u = units[seg.region]
        m = seg.offsets.size
        if u.dim() != 2 or u.dtype != torch.uint8 or u.device != flat.device:
            raise KVBridgeError(
                f"packed rows: region {seg.region} is {tuple(u.shape)} {u.dtype} on "
                f"{u.device}, the range on {flat.device}"
            )
        if seg.rows.min() < 0 or seg.rows.max() >= u.shape[0] * m:
            raise KVBridgeError(
                f"packed rows: rows {int(seg.rows.min())}..{int(seg.rows.max())} outside the "
                f"{u.shape[0] * m} rows of region {seg.region}"
            )
        if int(seg.offsets.max()) + seg.length > u.shape[1]:
            raise KVBridgeError(
                f"packed rows: pieces of {seg.length} B at offsets up to "
                f"{int(seg.offsets.max())} overrun region {seg.region}'s {u.shape[1]} B blocks"
            )
