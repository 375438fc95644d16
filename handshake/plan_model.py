"""What a negotiated plan is: per KV-cache group, wire chunks cut into piece streams.

``kvbridge.handshake.plan`` builds these; the receiver turns them into descriptor rows. See
``kvbridge.handshake.plan`` for how the chunk, the transforms and the pieces are chosen.
"""

from __future__ import annotations

import enum
import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np

from kvbridge.layouts.arrangement import BlockArrangement
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.specs import KVCacheKind


class Granularity(enum.IntEnum):
    """How much of a block one region row holds; lower is finer."""

    HEAD = -1  # one layer, one part, one head (a heads-outer cache: vLLM's LHBNC)
    PART = 0  # one layer, one of K/V
    LAYER = 1  # one layer, K and V
    GROUP = 2  # every layer of the group (cross-layer)


class TransformSide(enum.Enum):
    NONE = "none"
    SENDER = "sender after save"
    RECEIVER = "receiver after load"
    BOTH = "sender after save + receiver after load"


@dataclass(frozen=True, kw_only=True)
class Rewrite:
    """An in-place rewrite of a group's blocks from ``src`` to ``dst`` arrangement."""

    src: BlockArrangement
    dst: BlockArrangement

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}"


@dataclass(frozen=True, kw_only=True)
class PieceStream:
    """Pieces that go from one remote region to one local region, per chunk."""

    local_region: int  # index into the local PeerLayout.regions
    remote_region: int
    local_offsets: tuple[int, ...]  # per piece, inside one wire chunk of the local unit
    remote_offsets: tuple[int, ...]
    length: int
    local_chunk_bytes: int  # distance between chunks inside a local unit
    remote_chunk_bytes: int
    # where each remote chunk starts inside the remote unit, when its chunks are not evenly
    # spaced (a sender read natively whose kernel sub-blocks are smaller than its block:
    # HND tokens 0..31 and 32..63 of a 64-token sub-block lie 32 rows apart, the next
    # sub-block a whole sub-block further); () means chunk q starts at q * remote_chunk_bytes
    # (left out of the repr, which the plan digest hashes: plans without it keep the
    # digest builds before it computed, so a push between them still agrees)
    remote_chunk_starts: tuple[int, ...] = field(default=(), repr=False)

    @property
    def num_pieces(self) -> int:
        return len(self.local_offsets)


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """How one KV-cache group moves."""

    group_id: int
    kind: KVCacheKind
    wire_tokens: int  # u; for state groups the state granularity (one chunk per block)
    local_chunks_per_block: int
    remote_chunks_per_block: int
    sender: Rewrite | None
    receiver: Rewrite | None
    streams: tuple[PieceStream, ...]
    native_read: bool = False  # pieces read the sender's native bytes (it may not rewrite)
    # engine-packed pages: each local block receives whole remote pages of this many
    # tokens, which the reader's engine packer repacks after load (0: nothing to repack)
    repack_from: int = 0
    # engine-packed pages larger than the local blocks: each remote page of this many
    # tokens lands whole in a staging slot (the streams' pages back to back), and the
    # reader's engine splits the tokens it needs into its blocks (0: no staging)
    split_from: int = 0
    # tensor parallelism: (local head, remote head, heads) of the slice this plan moves,
    # rank-local indices; () when both sides hold the same heads
    head_slice: tuple[int, int, int] | tuple[()] = ()
    # pipeline stages: the local layers this plan moves, in stream order, when the two
    # ranks share only some of the group's (kvbridge.handshake.layer_window); () when it
    # moves every layer, or (with no streams) none. Left out of the repr (the plan digest)
    layers: tuple[str, ...] = field(default=(), repr=False)
    # pipeline stages: the two ranks hold no layer of this group in common, so this plan
    # moves nothing of it (another stage does); the reader claims none of its blocks
    skipped: bool = field(default=False, repr=False)

    @property
    def staging_bytes(self) -> int:
        """One staging slot: a (local-heads) page of every stream, back to back."""
        return sum(s.local_chunk_bytes for s in self.streams) if self.split_from else 0

    @property
    def descriptors_per_chunk(self) -> int:
        return sum(s.num_pieces for s in self.streams)

    @property
    def bytes_per_chunk(self) -> int:
        return sum(s.num_pieces * s.length for s in self.streams)

    def local_offsets(self, stream: PieceStream) -> np.ndarray:
        """Offsets, inside a local unit, of every (chunk, piece) row of the table."""
        return _offsets(self.local_chunks_per_block, stream.local_chunk_bytes, stream.local_offsets)

    def remote_offsets(self, stream: PieceStream) -> np.ndarray:
        if stream.remote_chunk_starts:
            starts = np.asarray(stream.remote_chunk_starts, dtype=np.int64)[:, None]
            pieces = np.asarray(stream.remote_offsets, dtype=np.int64)[None, :]
            return (starts + pieces).reshape(-1)
        return _offsets(
            self.remote_chunks_per_block, stream.remote_chunk_bytes, stream.remote_offsets
        )

    def chunks_for_tokens(self, start: int, end: int) -> np.ndarray:
        """Wire chunks covering tokens ``[start, end)``."""
        if end <= start:
            return np.zeros(0, dtype=np.int64)
        return np.arange(start // self.wire_tokens, -(-end // self.wire_tokens), dtype=np.int64)

    def indices(
        self,
        stream: PieceStream,
        chunk_ids: np.ndarray,
        local_block_ids: np.ndarray,
        remote_block_ids: np.ndarray,
        *,
        local_first_block: int = 0,
        remote_first_block: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the local and remote descriptor tables (block x chunk x piece) that move
        ``chunk_ids``. ``*_block_ids[i]`` is the id of logical block ``*_first_block + i``."""
        q = np.asarray(chunk_ids, dtype=np.int64)
        lpos = q // self.local_chunks_per_block - local_first_block
        rpos = q // self.remote_chunks_per_block - remote_first_block
        lids = np.asarray(local_block_ids, dtype=np.int64)
        rids = np.asarray(remote_block_ids, dtype=np.int64)
        if q.size and (lpos.min() < 0 or lpos.max() >= lids.size):
            raise LayoutError(
                f"group {self.group_id}: chunks {q.tolist()} need local logical blocks "
                f"{sorted(set((lpos + local_first_block).tolist()))} but only "
                f"{local_first_block}..{local_first_block + lids.size - 1} were given"
            )
        if q.size and (rpos.min() < 0 or rpos.max() >= rids.size):
            raise LayoutError(
                f"group {self.group_id}: chunks {q.tolist()} need remote logical blocks "
                f"{sorted(set((rpos + remote_first_block).tolist()))} but only "
                f"{remote_first_block}..{remote_first_block + rids.size - 1} were given"
            )
        m = stream.num_pieces
        piece = np.arange(m, dtype=np.int64)[None, :]
        lrow = lids[lpos] * self.local_chunks_per_block + q % self.local_chunks_per_block
        rrow = rids[rpos] * self.remote_chunks_per_block + q % self.remote_chunks_per_block
        local_idx = (lrow[:, None] * m + piece).reshape(-1)
        remote_idx = (rrow[:, None] * m + piece).reshape(-1)
        return local_idx, remote_idx

    def __str__(self) -> str:
        side = _side(self.sender, self.receiver)
        piece_bytes = self.bytes_per_chunk // max(1, self.descriptors_per_chunk)
        return (
            f"group {self.group_id} ({self.kind.value}): chunk {self.wire_tokens} tok, "
            f"{self.remote_chunks_per_block}/remote block, {self.local_chunks_per_block}/local "
            f"block, {self.descriptors_per_chunk} desc x {piece_bytes} B "
            f"per chunk; transform: {side.value}"
            + (f" [sender {self.sender}]" if self.sender else "")
            + (" [sender read in its native arrangement]" if self.native_read else "")
            + (
                f" [heads {self.head_slice[0]}..{self.head_slice[0] + self.head_slice[2] - 1}"
                f" <- remote heads {self.head_slice[1]}.."
                f"{self.head_slice[1] + self.head_slice[2] - 1}]"
                if self.head_slice
                else ""
            )
            + (f" [engine repacks {self.repack_from}-token pages]" if self.repack_from else "")
            + (
                f" [whole {self.split_from}-token pages staged, engine splits them]"
                if self.split_from
                else ""
            )
            + (f" [receiver {self.receiver}]" if self.receiver else "")
        )


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """The agreed way to move KV blocks from ``remote`` (sender) to ``local`` (reader)."""

    local_engine_id: str
    remote_engine_id: str
    remote_agent_name: str
    groups: tuple[GroupPlan, ...]

    @property
    def transform_side(self) -> TransformSide:
        sender = any(g.sender for g in self.groups)
        receiver = any(g.receiver for g in self.groups)
        return _side(sender, receiver)

    def skipped_groups(self) -> list[int]:
        """The groups this plan moves nothing of because another pipeline stage holds
        their layers (what a reader's claim leaves out)."""
        return [g.group_id for g in self.groups if g.skipped]

    def sender_rewrites(self) -> dict[int, Rewrite]:
        return {g.group_id: g.sender for g in self.groups if g.sender}

    @functools.cached_property
    def digest(self) -> str:
        """A short fingerprint of the whole plan: a push writer must plan as its reader."""
        starts = [s.remote_chunk_starts for g in self.groups for s in g.streams]
        text = repr(self) + (repr(starts) if any(starts) else "")
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        lines = [
            f"TransferPlan {self.remote_engine_id} -> {self.local_engine_id} "
            f"({self.transform_side.value})"
        ]
        lines += [f"  {g}" for g in self.groups]
        return "\n".join(lines)


def _offsets(chunks: int, chunk_bytes: int, piece_offsets: tuple[int, ...]) -> np.ndarray:
    base = np.arange(chunks, dtype=np.int64)[:, None] * chunk_bytes
    return (base + np.asarray(piece_offsets, dtype=np.int64)[None, :]).reshape(-1)


def _side(sender: object, receiver: object) -> TransformSide:
    if sender and receiver:
        return TransformSide.BOTH
    if sender:
        return TransformSide.SENDER
    if receiver:
        return TransformSide.RECEIVER
    return TransformSide.NONE
