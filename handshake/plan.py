"""Negotiation: (local description, remote description) -> TransferPlan.

The local side is the reader (decode), the remote side the sender (prefill). Per KV-cache
group the plan fixes:

* the *wire chunk*: ``u = min(remote block, local block)`` tokens, laid out like the
  reader wants (its layout, its kernel sub-blocks where they fit in ``u``);
* the sender transform (after save): rewrite each of its blocks as ``B_remote / u``
  wire chunks, unless its native bytes already are that;
* the receiver transform (after load): when a local block holds several wire chunks
  whose bytes differ from the local native arrangement (cross-layer merge, kernel
  sub-blocks larger than ``u``, K/V order), rewrite it;
* the *pieces* a chunk is cut into so that every piece is contiguous on both sides: one
  per chunk when both sides are cross-layer, one per layer against a per-layer peer, one
  per (layer, K/V) against a kv-split peer; state groups move ``state_bytes`` per layer.

A sender that may not rewrite its blocks (``rewrites_in_place`` false: an engine whose
prefix cache lets running requests read a block while a reader holds it) is read in its
native arrangement instead: every piece is cut where its bytes stop being contiguous there
(e.g. one piece per head when an HND 128-token block feeds 32-token chunks). That costs
descriptors, so pieces smaller than ``MIN_NATIVE_PIECE_BYTES`` are refused by name.

Token chunk ``q`` (tokens ``q*u .. q*u+u-1``) lives in local block ``q // r_local`` at
chunk ``q % r_local`` and in remote block ``q // r_remote`` at chunk ``q % r_remote``.
Descriptor tables list ``block x chunk x piece`` rows; :meth:`GroupPlan.indices` picks
rows for given chunks with numpy, no per-block loops.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

import numpy as np

from handshake.description import PeerLayout
from handshake.errors import IncompatiblePeerError
from layouts.arrangement import BlockArrangement, UnitGeometry, element_offsets, same_bytes
from layouts.errors import LayoutError
from layouts.groups import KVCacheGroup
from layouts.layout import KVPacking
from layouts.specs import AttentionSpec, KVCacheKind, StateSpec

MIN_NATIVE_PIECE_BYTES = 512  # smallest piece worth a descriptor when reading natively


class Granularity(enum.IntEnum):
    """How much of a block one region row holds; lower is finer."""

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
            + (f" [engine repacks {self.repack_from}-token pages]" if self.repack_from else "")
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

    def sender_rewrites(self) -> dict[int, Rewrite]:
        return {g.group_id: g.sender for g in self.groups if g.sender}

    def __str__(self) -> str:
        lines = [
            f"TransferPlan {self.remote_engine_id} -> {self.local_engine_id} "
            f"({self.transform_side.value})"
        ]
        lines += [f"  {g}" for g in self.groups]
        return "\n".join(lines)


def negotiate(
    local: PeerLayout,
    remote: PeerLayout,
    *,
    min_native_piece_bytes: int | None = None,
    can_repack: bool = False,
) -> TransferPlan:
    """The plan for reading ``remote``'s blocks into ``local``'s, or
    :class:`IncompatiblePeerError` naming what cannot be bridged. ``can_repack``: the
    local engine can repack its packed pages from smaller ones after load."""
    if min_native_piece_bytes is None:
        min_native_piece_bytes = MIN_NATIVE_PIECE_BYTES
    peer = f"{remote.identity.engine_id}/rank{remote.identity.rank}"
    if local.identity.tp_size != remote.identity.tp_size:
        raise IncompatiblePeerError(
            [("tp_size", local.identity.tp_size, remote.identity.tp_size)],
            peer=peer,
            hint="different tensor-parallel sizes are not supported yet; run both sides "
            "with the same TP size",
        )
    packed = _check_block_packing(local, remote, peer, can_repack)
    if len(local.config.groups) != len(remote.config.groups):
        raise IncompatiblePeerError(
            [("num_groups", len(local.config.groups), len(remote.config.groups))], peer=peer
        )
    plans = []
    for lg, rg in zip(local.config.groups, remote.config.groups, strict=True):
        if lg.kind != rg.kind or lg.layer_names != rg.layer_names:
            raise IncompatiblePeerError(
                [
                    (
                        f"groups[{lg.group_id}]",
                        (lg.kind.value, lg.layer_names),
                        (rg.kind.value, rg.layer_names),
                    )
                ],
                peer=peer,
            )
        try:
            if packed:
                plans.append(_packed_plan(local, remote, lg, rg))
            elif isinstance(lg.spec, StateSpec):
                plans.append(_state_plan(local, remote, lg, rg))
            else:
                plans.append(_attention_plan(local, remote, lg, rg, min_native_piece_bytes))
        except LayoutError as exc:
            raise IncompatiblePeerError(
                [(f"groups[{lg.group_id}]", str(local.format), str(remote.format))],
                peer=peer,
                hint=f"cannot bridge the block formats: {exc}",
            ) from None
    return TransferPlan(
        local_engine_id=local.identity.engine_id,
        remote_engine_id=remote.identity.engine_id,
        remote_agent_name=remote.identity.agent_name,
        groups=tuple(plans),
    )


def _check_block_packing(
    local: PeerLayout, remote: PeerLayout, peer: str, can_repack: bool
) -> bool:
    """Pages in an engine's private element order: same order on both sides, and the
    reader's blocks a multiple of the sender's when its engine repacks (else equal).
    True when the sides are packed."""
    lp, rp = local.format.block_packing, remote.format.block_packing
    if not lp and not rp:
        return False
    if lp != rp:
        raise IncompatiblePeerError(
            [("block_packing", lp or "(kvbridge layout)", rp or "(kvbridge layout)")],
            peer=peer,
            hint="the two engines order the elements of a block differently",
        )
    pairs = list(zip(local.config.groups, remote.config.groups, strict=False))
    larger_sender = [
        (f"groups[{lg.group_id}].block_size", lg.spec.block_size, rg.spec.block_size)
        for lg, rg in pairs
        if rg.spec.block_size > lg.spec.block_size
        or (not can_repack and rg.spec.block_size != lg.spec.block_size)
        or lg.spec.block_size % rg.spec.block_size
    ]
    if larger_sender:
        how = (
            "a reader repacks whole smaller pages into its blocks after load, so the "
            "sender's blocks must not be larger than the reader's"
            if can_repack
            else "this reader cannot repack them, so both sides need the same block size"
        )
        raise IncompatiblePeerError(
            larger_sender,
            peer=peer,
            hint=f"{lp!r} blocks keep their elements in the engine's own order (vLLM's CPU "
            f"attention stores K transposed per block), so a block cannot be cut into "
            f"token chunks by byte ranges; kvbridge moves such blocks whole and {how}",
        )
    return True


def _packed_plan(
    local: PeerLayout, remote: PeerLayout, lg: KVCacheGroup, rg: KVCacheGroup
) -> GroupPlan:
    """Whole remote pages, one per layer and remote block, side by side in local pages."""
    b_local, b_remote = lg.spec.block_size, rg.spec.block_size
    r_local = b_local // b_remote

    def layer_regions(side: PeerLayout, group_id: int) -> dict[int, tuple[int, int]]:
        out = {}
        for idx, info in enumerate(side.regions):
            if info.group_id != group_id:
                continue
            if info.layer_index < 0 or info.kv_part >= 0:
                raise LayoutError("engine-packed pages must be per-layer, K and V together")
            out[info.layer_index] = (idx, info.region.block_bytes)
        return out

    lr, rr = layer_regions(local, lg.group_id), layer_regions(remote, rg.group_id)
    if set(lr) != set(rr):
        raise LayoutError(f"layers do not correspond: local {sorted(lr)} vs remote {sorted(rr)}")
    streams = []
    for layer in sorted(lr):
        (li, lbytes), (ri, rbytes) = lr[layer], rr[layer]
        if lbytes != rbytes * r_local:
            raise LayoutError(
                f"layer {layer}: local pages of {lbytes} B do not hold {r_local} remote "
                f"pages of {rbytes} B"
            )
        streams.append(
            PieceStream(
                local_region=li,
                remote_region=ri,
                local_offsets=(0,),
                remote_offsets=(0,),
                length=rbytes,
                local_chunk_bytes=rbytes,
                remote_chunk_bytes=rbytes,
            )
        )
    return GroupPlan(
        group_id=lg.group_id,
        kind=lg.kind,
        wire_tokens=b_remote,
        local_chunks_per_block=r_local,
        remote_chunks_per_block=1,
        sender=None,
        receiver=None,
        streams=tuple(streams),
        repack_from=b_remote if r_local > 1 else 0,
    )


# -- attention groups ------------------------------------------------------------------


def _granularity(side: PeerLayout, spec: AttentionSpec) -> Granularity:
    if side.format.cross_layer:
        return Granularity.GROUP
    if side.format.packing is KVPacking.KV_SPLIT and spec.num_kv_parts == 2:
        return Granularity.PART
    return Granularity.LAYER


def _attention_plan(
    local: PeerLayout,
    remote: PeerLayout,
    lg: KVCacheGroup,
    rg: KVCacheGroup,
    min_native_piece_bytes: int,
) -> GroupPlan:
    lspec, rspec = lg.spec, rg.spec
    assert isinstance(lspec, AttentionSpec) and isinstance(rspec, AttentionSpec)
    b_local, b_remote = lspec.block_size, rspec.block_size
    if max(b_local, b_remote) % min(b_local, b_remote):
        raise LayoutError(
            f"block sizes {b_remote} (remote) and {b_local} (local) are not multiples of each other"
        )
    u = min(b_local, b_remote)
    kb_local = local.format.kernel_block_size_for(b_local)
    grain = min(_granularity(local, lspec), _granularity(remote, rspec))
    parts_outer = grain is Granularity.PART
    wire = BlockArrangement(
        layout=local.format.layout,
        sub_blocks_per_chunk=u // kb_local if u % kb_local == 0 else 1,
        parts_outer=parts_outer,
    )
    r_local, r_remote = b_local // u, b_remote // u

    def on_side(c: int) -> BlockArrangement:
        return BlockArrangement(
            layout=wire.layout,
            num_chunks=c,
            sub_blocks_per_chunk=wire.sub_blocks_per_chunk,
            parts_outer=wire.parts_outer,
        )

    sender_dst, receiver_src = on_side(r_remote), on_side(r_local)
    r_native = remote.format.native_arrangement(b_remote)
    l_native = local.format.native_arrangement(b_local)
    sender = None
    if not all(
        same_bytes(geo, r_native, sender_dst) for geo in _geometries(remote, rg.group_id, rspec)
    ):
        sender = Rewrite(src=r_native, dst=sender_dst)
    receiver = None
    if not all(
        same_bytes(geo, receiver_src, l_native) for geo in _geometries(local, lg.group_id, lspec)
    ):
        receiver = Rewrite(src=receiver_src, dst=l_native)
    streams = _attention_streams(local, remote, lg, lspec, rspec, grain, r_local, r_remote)
    native_read = sender is not None and not remote.rewrites_in_place
    if native_read:
        assert sender is not None
        geometry = _geometries(remote, rg.group_id, rspec)[0]
        streams = tuple(
            _native_stream(s, geometry, sender, r_remote, rg.group_id, min_native_piece_bytes)
            for s in streams
        )
        sender = None
    return GroupPlan(
        group_id=lg.group_id,
        kind=lg.kind,
        wire_tokens=u,
        local_chunks_per_block=r_local,
        remote_chunks_per_block=r_remote,
        sender=sender,
        receiver=receiver,
        streams=streams,
        native_read=native_read,
    )


def _native_stream(
    stream: PieceStream,
    geometry: UnitGeometry,
    rewrite: Rewrite,
    chunks: int,
    group_id: int,
    min_piece_bytes: int,
) -> PieceStream:
    """``stream`` re-cut to read the sender's ``rewrite.src`` bytes where the plan wanted
    its ``rewrite.dst`` bytes: each piece splits into runs contiguous in ``src``."""
    # Elements of one head row (head_size x itemsize bytes) never split: probe with them.
    elem = geometry.head_size * geometry.itemsize
    probe = replace(geometry, head_size=1, itemsize=8)
    dst, src = element_offsets(probe, rewrite.dst), element_offsets(probe, rewrite.src)
    src_at = np.empty_like(dst)
    src_at[dst] = src  # element at dst position p lies at src position src_at[p]
    chunk = probe.unit_elems // chunks
    if stream.remote_chunk_bytes != chunk * elem or stream.length % elem:
        raise LayoutError(f"group {group_id}: pieces do not cover whole head rows")
    n = stream.length // elem
    per_chunk = np.stack(
        [
            np.concatenate(
                [src_at[q * chunk + off // elem + np.arange(n)] for off in stream.remote_offsets]
            )
            for q in range(chunks)
        ]
    )
    stride = int(per_chunk[1, 0] - per_chunk[0, 0]) if chunks > 1 else 0
    if not np.array_equal(per_chunk, per_chunk[:1] + stride * np.arange(chunks)[:, None]):
        raise LayoutError(
            f"group {group_id}: the sender's {rewrite.src} blocks cannot be read as "
            f"{rewrite.dst} chunks without a rewrite (chunks are not evenly spaced)"
        )
    first = per_chunk[0]
    breaks = np.flatnonzero(np.diff(first) != 1) + 1
    starts = np.concatenate([breaks, np.arange(0, first.size, n)])
    run = int(np.gcd.reduce(np.concatenate([[n], starts])))
    length = run * elem
    if length < min_piece_bytes:
        raise LayoutError(
            f"group {group_id}: reading the sender's {rewrite.src} blocks as {rewrite.dst} "
            f"chunks without a rewrite needs {length}-byte pieces (fewer than "
            f"{min_piece_bytes}); the sender does not rewrite blocks in place"
        )
    local_offsets = []
    remote_offsets = []
    for k, off in enumerate(stream.local_offsets):
        for j in range(0, n, run):
            local_offsets.append(off + j * elem)
            remote_offsets.append(int(first[k * n + j]) * elem)
    return PieceStream(
        local_region=stream.local_region,
        remote_region=stream.remote_region,
        local_offsets=tuple(local_offsets),
        remote_offsets=tuple(remote_offsets),
        length=length,
        local_chunk_bytes=stream.local_chunk_bytes,
        remote_chunk_bytes=stride * elem if chunks > 1 else stream.remote_chunk_bytes,
    )


def _geometries(side: PeerLayout, group_id: int, spec: AttentionSpec) -> list[UnitGeometry]:
    """Unit geometries of a side's regions for a group (what its rows hold)."""
    out = []
    grain = _granularity(side, spec)
    num_layers = len(side.config.groups[group_id].layer_names) if grain is Granularity.GROUP else 1
    parts = 1 if grain is Granularity.PART else spec.num_kv_parts
    out.append(
        UnitGeometry(
            num_layers=num_layers,
            num_kv_parts=parts,
            block_size=spec.block_size,
            num_heads=spec.num_kv_heads,
            head_size=spec.part_head_size,
            itemsize=spec.itemsize,
        )
    )
    return out


def _pieces(
    side: PeerLayout,
    group: KVCacheGroup,
    spec: AttentionSpec,
    grain: Granularity,
    chunks_per_block: int,
) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(layer in group, part or -1) -> (region index, offset inside a chunk, chunk bytes)."""
    side_grain = _granularity(side, spec)
    out: dict[tuple[int, int], tuple[int, int, int]] = {}
    page = spec.page_size_bytes
    for idx, info in enumerate(side.regions):
        if info.group_id != group.group_id:
            continue
        layers = range(group.num_layers) if info.layer_index < 0 else [info.layer_index]
        num_layers = len(layers)
        parts_here = 1 if side_grain is Granularity.PART else spec.num_kv_parts
        expect = num_layers * (page if parts_here == spec.num_kv_parts else page // 2)
        if info.region.block_bytes != expect:
            raise LayoutError(
                f"region {info.region.name!r} holds {info.region.block_bytes} bytes per block, "
                f"expected {expect}"
            )
        chunk = info.region.block_bytes // chunks_per_block
        layer_bytes = chunk // num_layers
        for i, layer in enumerate(layers):
            if grain is Granularity.PART:
                if side_grain is Granularity.PART:
                    out[(layer, info.kv_part)] = (idx, i * layer_bytes, chunk)
                else:
                    part_bytes = layer_bytes // spec.num_kv_parts
                    for p in range(spec.num_kv_parts):
                        out[(layer, p)] = (idx, i * layer_bytes + p * part_bytes, chunk)
            elif grain is Granularity.LAYER:
                out[(layer, -1)] = (idx, i * layer_bytes, chunk)
            else:
                out[(-1, -1)] = (idx, 0, chunk)
    return out


def _attention_streams(
    local: PeerLayout,
    remote: PeerLayout,
    group: KVCacheGroup,
    lspec: AttentionSpec,
    rspec: AttentionSpec,
    grain: Granularity,
    r_local: int,
    r_remote: int,
) -> tuple[PieceStream, ...]:
    lp = _pieces(local, group, lspec, grain, r_local)
    rp = _pieces(remote, group, rspec, grain, r_remote)
    if set(lp) != set(rp):
        raise LayoutError(f"pieces do not correspond: local {sorted(lp)} vs remote {sorted(rp)}")
    chunk_bytes = lspec.page_size_bytes * group.num_layers // r_local
    pieces_per_chunk = len(lp)
    length = chunk_bytes // pieces_per_chunk
    return _group_streams(lp, rp, length)


def _group_streams(
    lp: dict[tuple[int, int], tuple[int, int, int]],
    rp: dict[tuple[int, int], tuple[int, int, int]],
    length: int,
) -> tuple[PieceStream, ...]:
    by_pair: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for key in sorted(lp):
        li, loff, lchunk = lp[key]
        ri, roff, rchunk = rp[key]
        by_pair.setdefault((li, ri), []).append((loff, roff, lchunk, rchunk))
    streams = []
    for (li, ri), rows in by_pair.items():
        streams.append(
            PieceStream(
                local_region=li,
                remote_region=ri,
                local_offsets=tuple(r[0] for r in rows),
                remote_offsets=tuple(r[1] for r in rows),
                length=length,
                local_chunk_bytes=rows[0][2],
                remote_chunk_bytes=rows[0][3],
            )
        )
    return tuple(streams)


# -- state groups -----------------------------------------------------------------------


def _state_plan(
    local: PeerLayout, remote: PeerLayout, lg: KVCacheGroup, rg: KVCacheGroup
) -> GroupPlan:
    lspec, rspec = lg.spec, rg.spec
    assert isinstance(lspec, StateSpec) and isinstance(rspec, StateSpec)
    if lspec.state_bytes != rspec.state_bytes:
        raise LayoutError(f"state sizes differ: {lspec.state_bytes} vs {rspec.state_bytes} bytes")

    def pieces(side: PeerLayout, spec: StateSpec) -> dict[tuple[int, int], tuple[int, int, int]]:
        out = {}
        for idx, info in enumerate(side.regions):
            if info.group_id != lg.group_id:
                continue
            layers = range(lg.num_layers) if info.layer_index < 0 else [info.layer_index]
            for i, layer in enumerate(layers):
                out[(layer, -1)] = (idx, i * spec.page_size_bytes, info.region.block_bytes)
        return out

    lp, rp = pieces(local, lspec), pieces(remote, rspec)
    if set(lp) != set(rp):
        raise LayoutError(f"state layers do not correspond: {sorted(lp)} vs {sorted(rp)}")
    # A state block holds the state after its last token; both sides keep one per block.
    granularity = math.lcm(lspec.block_size, rspec.block_size)
    return GroupPlan(
        group_id=lg.group_id,
        kind=lg.kind,
        wire_tokens=granularity,
        local_chunks_per_block=1,
        remote_chunks_per_block=1,
        sender=None,
        receiver=None,
        streams=_group_streams(lp, rp, lspec.state_bytes),
    )


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
