"""Plans for engine-packed pages (``CacheFormat.block_packing``, e.g. vLLM's CPU attention).

Such pages keep their elements in the engine's own order, so they move whole: between
equal block sizes one page per (block, layer); into a reader whose blocks are ``r`` times
larger, ``r`` sender pages side by side, which the reader's engine repacks after load.
"""

from __future__ import annotations

from handshake.description import PeerLayout
from handshake.errors import IncompatiblePeerError
from handshake.plan_model import GroupPlan, PieceStream
from layouts.errors import LayoutError
from layouts.groups import KVCacheGroup


def check_block_packing(local: PeerLayout, remote: PeerLayout, peer: str, can_repack: bool) -> bool:
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


def packed_plan(
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
