"""Plans for engine-packed pages (``CacheFormat.block_packing``, e.g. vLLM's CPU attention).

Such pages keep their elements in the engine's own order, so they move whole: between
equal block sizes one page per (block, layer); into a reader whose blocks are ``r`` times
larger, ``r`` sender pages side by side, which the reader's engine repacks after load; from
a sender whose blocks are larger, or of any size that does not divide the reader's (96 ->
64, 64 -> 96), each sender page lands in a staging slot of the reader and the reader's
engine writes the tokens it loads into its own blocks, token by token.
"""

from __future__ import annotations

from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.plan_model import GroupPlan, PieceStream
from kvbridge.handshake.tp import HeadSlice
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.groups import KVCacheGroup
from kvbridge.layouts.specs import AttentionSpec


def check_block_packing(local: PeerLayout, remote: PeerLayout, peer: str, can_repack: bool) -> bool:
    """Pages in an engine's private element order: same order on both sides, and equal
    block sizes unless the reader's engine repacks (then any sizes). True when the sides
    are packed."""
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

    mismatched = [
        (f"groups[{lg.group_id}].block_size", lg.spec.block_size, rg.spec.block_size)
        for lg, rg in pairs
        if lg.spec.block_size != rg.spec.block_size and not can_repack
    ]
    if mismatched:
        how = "this reader cannot repack them, so both sides need the same block size"
        raise IncompatiblePeerError(
            mismatched,
            peer=peer,
            hint=f"{lp!r} blocks keep their elements in the engine's own order (vLLM's CPU "
            f"attention stores K transposed per block), so a block cannot be cut into "
            f"token chunks by byte ranges; kvbridge moves such blocks whole and {how}",
        )
    return True


def packed_plan(
    local: PeerLayout,
    remote: PeerLayout,
    lg: KVCacheGroup,
    rg: KVCacheGroup,
    heads: HeadSlice | None = None,
) -> GroupPlan:
    """Whole remote pages, one per layer and remote block: side by side in local pages
    (remote blocks divide local ones), or into staging slots (any other sizes). ``heads``
    (tensor parallelism, heads-major pages only): just that slice of every page."""
    b_local, b_remote = lg.spec.block_size, rg.spec.block_size
    if b_local % b_remote:
        return _staged_plan(local, remote, lg, rg, heads)
    r_local = b_local // b_remote
    h_local, h_remote = _heads(lg), _heads(rg)
    la, ra, n = (
        (heads.local_head, heads.remote_head, heads.num_heads) if heads else (0, 0, h_remote)
    )

    lr, rr = _paired_layers(local, remote, lg.group_id, rg.group_id)
    streams = []
    for layer in sorted(lr):
        (li, lbytes), (ri, rbytes) = lr[layer], rr[layer]
        per_head = rbytes // h_remote  # one head of a b_remote-token page
        if lbytes != per_head * h_local * r_local or rbytes != per_head * h_remote:
            raise LayoutError(
                f"layer {layer}: local pages of {lbytes} B ({h_local} heads) do not hold "
                f"{r_local} remote pages of {rbytes} B ({h_remote} heads)"
            )
        streams.append(
            PieceStream(
                local_region=li,
                remote_region=ri,
                local_offsets=(la * per_head,),
                remote_offsets=(ra * per_head,),
                length=n * per_head,
                local_chunk_bytes=lbytes // r_local,
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
        head_slice=(la, ra, n) if heads else (),
    )


def _staged_plan(
    local: PeerLayout,
    remote: PeerLayout,
    lg: KVCacheGroup,
    rg: KVCacheGroup,
    heads: HeadSlice | None,
) -> GroupPlan:
    """Remote pages that do not fit whole into local ones: one page per layer and remote
    block (its slice of the heads) into a staging slot, the group's layers back to back.
    A slot page holds the ``n`` heads this remote rank gives (all local heads, or, when
    the local heads come from several remote ranks, local heads ``la .. la + n - 1``: the
    engine's split then writes only those, ``GroupPlan.head_slice``)."""
    b_local, b_remote = lg.spec.block_size, rg.spec.block_size
    h_local, h_remote = _heads(lg), _heads(rg)
    la, ra, n = (
        (heads.local_head, heads.remote_head, heads.num_heads) if heads else (0, 0, h_remote)
    )
    lr, rr = _paired_layers(local, remote, lg.group_id, rg.group_id)
    streams = []
    for layer in sorted(lr):
        (li, lbytes), (ri, rbytes) = lr[layer], rr[layer]
        per_head = rbytes // h_remote
        if rbytes != per_head * h_remote or per_head * h_local * b_local != lbytes * b_remote:
            raise LayoutError(
                f"layer {layer}: remote {b_remote}-token pages of {rbytes} B ({h_remote} "
                f"heads) and local {b_local}-token pages of {lbytes} B ({h_local} heads) "
                f"differ in bytes per token and head"
            )
        streams.append(
            PieceStream(
                local_region=li,  # the layer the engine splits into (reads go to staging)
                remote_region=ri,
                local_offsets=(0,),
                remote_offsets=(ra * per_head,),
                length=n * per_head,
                local_chunk_bytes=n * per_head,  # one slot page: b_remote tokens, n heads
                remote_chunk_bytes=rbytes,
            )
        )
    return GroupPlan(
        group_id=lg.group_id,
        kind=lg.kind,
        wire_tokens=b_remote,
        local_chunks_per_block=1,
        remote_chunks_per_block=1,
        sender=None,
        receiver=None,
        streams=tuple(streams),
        split_from=b_remote,
        head_slice=(la, ra, n) if heads else (),
    )


def _heads(group: KVCacheGroup) -> int:
    spec = group.spec
    if not isinstance(spec, AttentionSpec):
        raise LayoutError(f"group {group.group_id}: engine-packed pages must be attention")
    return spec.num_kv_heads


def _paired_layers(
    local: PeerLayout, remote: PeerLayout, local_group: int, remote_group: int
) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    lr, rr = _layer_regions(local, local_group), _layer_regions(remote, remote_group)
    if set(lr) != set(rr):
        raise LayoutError(f"layers do not correspond: local {sorted(lr)} vs remote {sorted(rr)}")
    return lr, rr


def _layer_regions(side: PeerLayout, group_id: int) -> dict[int, tuple[int, int]]:
    """Layer index inside the group -> (region index, page bytes); layers 0..L-1."""
    out = {}
    for idx, info in enumerate(side.regions):
        if info.group_id != group_id:
            continue
        if info.layer_index < 0 or info.kv_part >= 0:
            raise LayoutError("engine-packed pages must be per-layer, K and V together")
        out[info.layer_index] = (idx, info.region.block_bytes)
    if sorted(out) != list(range(len(out))):
        raise LayoutError(f"group {group_id}: layer indices {sorted(out)} are not 0..L-1")
    return out
