"""Cutting a wire chunk into pieces contiguous on both sides (shared by the plans).

A side's regions hold a group's blocks per layer, per (layer, K/V part), per (layer,
head) (a heads-outer cache, vLLM's LHBNC) or cross-layer; the finer of the two sides'
granularities decides the pieces: one per chunk, per layer, per (layer, part) or per
(layer, part, head). Against a heads-outer side the wire chunk (:func:`head_wire`) keeps
each (layer, part, head) of a chunk in one run ``[t, D]``::

    heads inner (default)       chunk = [layer][part][head][t, D]
    heads first (a BHLNC side)  chunk = [head][layer][part][t, D]
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.plan_model import Granularity, PieceStream, Rewrite
from kvbridge.layouts.arrangement import BlockArrangement, HeadOrder, UnitGeometry, same_bytes
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.groups import KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import AttentionSpec

# (layer, part) or, at HEAD granularity, (layer, part, head) -> (region, offset, chunk)
PieceMap = dict[tuple[int, ...], tuple[int, int, int]]


def granularity(side: PeerLayout, spec: AttentionSpec) -> Granularity:
    if side.format.outer_heads:
        return Granularity.HEAD
    if side.format.cross_layer:
        return Granularity.GROUP
    if side.format.packing is KVPacking.KV_SPLIT and spec.num_kv_parts == 2:
        return Granularity.PART
    return Granularity.LAYER


def geometries(side: PeerLayout, group_id: int, spec: AttentionSpec) -> list[UnitGeometry]:
    """Unit geometries of a side's regions for a group (what its rows hold)."""
    out = []
    grain = granularity(side, spec)
    num_layers = len(side.config.groups[group_id].layer_names) if grain is Granularity.GROUP else 1
    parts = 1 if grain is Granularity.PART else spec.num_kv_parts
    out.append(
        UnitGeometry(
            num_layers=num_layers,
            num_kv_parts=parts,
            block_size=spec.block_size,
            num_heads=1 if grain is Granularity.HEAD else spec.num_kv_heads,
            head_size=spec.part_head_size,
            itemsize=spec.itemsize,
        )
    )
    return out


def head_wire(local: PeerLayout, remote: PeerLayout) -> BlockArrangement:
    """The wire chunk against a heads-outer side: each (layer, part, head) one run; heads
    first where a side keeps them so (BHLNC, which then moves its blocks as they are)."""
    head_outer = HeadOrder.IN_CHUNK in (local.format.heads, remote.format.heads)
    heads = HeadOrder.IN_CHUNK if head_outer else HeadOrder.INNER
    return BlockArrangement(layout=KVLayout.HND, parts_outer=True, heads=heads)


def pieces(
    side: PeerLayout,
    group: KVCacheGroup,
    spec: AttentionSpec,
    grain: Granularity,
    chunks_per_block: int,
    *,
    heads_first: bool = False,
) -> PieceMap:
    """(layer in group, part or -1) -> (region index, offset inside a chunk, chunk bytes);
    at HEAD granularity keyed (layer, part, rank-local head), laid out as
    :func:`head_wire` says (``heads_first``: its head-outer order)."""
    side_grain = granularity(side, spec)
    out: PieceMap = {}
    page = spec.page_size_bytes
    for idx, info in enumerate(side.regions):
        if info.group_id != group.group_id:
            continue
        layers = range(group.num_layers) if info.layer_index < 0 else [info.layer_index]
        num_layers = len(layers)
        parts_here = 1 if side_grain is Granularity.PART else spec.num_kv_parts
        heads_here = 1 if side_grain is Granularity.HEAD else spec.num_kv_heads
        expect = num_layers * page * parts_here * heads_here
        expect //= spec.num_kv_parts * spec.num_kv_heads
        if info.region.block_bytes != expect:
            raise LayoutError(
                f"region {info.region.name!r} holds {info.region.block_bytes} bytes per block, "
                f"expected {expect}"
            )
        chunk = info.region.block_bytes // chunks_per_block
        layer_bytes = chunk // num_layers
        if grain is Granularity.HEAD:
            parts = [info.kv_part] if side_grain is Granularity.PART else range(parts_here)
            heads = [info.head] if side_grain is Granularity.HEAD else range(heads_here)
            run = chunk // (num_layers * len(parts) * len(heads))
            for (i, layer), (j, p), (k, h) in itertools.product(
                enumerate(layers), enumerate(parts), enumerate(heads)
            ):
                if heads_first:
                    at = (k * num_layers + i) * len(parts) + j
                else:
                    at = (i * len(parts) + j) * len(heads) + k
                out[(layer, p, h)] = (idx, at * run, chunk)
            continue
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


def group_streams(
    lp: PieceMap,
    rp: PieceMap,
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


def wire_chunk(lspec: AttentionSpec, rspec: AttentionSpec) -> tuple[int, int, int]:
    """``(u, r_local, r_remote)``: the wire chunk is ``u = gcd`` of the two block sizes
    (the smaller block when one divides the other); each block holds ``r`` chunks, so a
    chunk never straddles a block on either side::

        remote 80:  [ 16 | 16 | 16 | 16 | 16 ][ 16 | 16 | ...        r_remote = 5
        local  32:  [ 16 | 16 ][ 16 | 16 ][ 16 | 16 ][ ...           r_local  = 2
    """
    b_local, b_remote = lspec.block_size, rspec.block_size
    u = math.gcd(b_local, b_remote)
    return u, b_local // u, b_remote // u


def rewrites(
    local: PeerLayout,
    remote: PeerLayout,
    lg: KVCacheGroup,
    rg: KVCacheGroup,
    wire: BlockArrangement,
    r_local: int,
    r_remote: int,
) -> tuple[Rewrite | None, Rewrite | None]:
    """The sender's rewrite after save (native -> ``r_remote`` wire chunks) and the
    receiver's after load (``r_local`` wire chunks -> native), each None where the bytes
    already agree."""
    lspec, rspec = lg.spec, rg.spec
    assert isinstance(lspec, AttentionSpec) and isinstance(rspec, AttentionSpec)
    sender_dst = replace(wire, num_chunks=r_remote)
    receiver_src = replace(wire, num_chunks=r_local)
    r_native = remote.format.native_arrangement(rspec.block_size)
    l_native = local.format.native_arrangement(lspec.block_size)
    sender = None
    if not all(
        same_bytes(geo, r_native, sender_dst) for geo in geometries(remote, rg.group_id, rspec)
    ):
        sender = Rewrite(src=r_native, dst=sender_dst)
    receiver = None
    if not all(
        same_bytes(geo, receiver_src, l_native) for geo in geometries(local, lg.group_id, lspec)
    ):
        receiver = Rewrite(src=receiver_src, dst=l_native)
    return sender, receiver
