"""Negotiation: (local description, remote description) -> TransferPlan.

The local side is the reader (decode), the remote side the sender (prefill). Per KV-cache
group the plan fixes:

* the *wire chunk*: ``u = gcd(remote block, local block)`` tokens (the smaller block
  when one divides the other; 16 for 80 and 32), laid out like the reader wants (its
  layout, its kernel sub-blocks where they fit in ``u``);
* the sender transform (after save): rewrite each of its blocks as ``B_remote / u``
  wire chunks, unless its native bytes already are that;
* the receiver transform (after load): when a local block holds several wire chunks
  whose bytes differ from the local native arrangement (cross-layer merge, kernel
  sub-blocks larger than ``u``, K/V order), rewrite it;
* the *pieces* a chunk is cut into so that every piece is contiguous on both sides: one
  per chunk when both sides are cross-layer, one per layer against a per-layer peer, one
  per (layer, K/V) against a kv-split peer, one per (layer, K/V, head) against a
  heads-outer peer (vLLM's LHBNC, whose every (layer, head) is a region of its own);
  state groups move ``state_bytes`` per layer.

A sender that may not rewrite its blocks (``rewrites_in_place`` false: an engine whose
prefix cache lets running requests read a block while a reader holds it) is read in its
native arrangement instead: every piece is cut where its bytes stop being contiguous there
(e.g. one piece per head when an HND 128-token block feeds 32-token chunks). That costs
descriptors, so pieces smaller than ``MIN_NATIVE_PIECE_BYTES`` are refused by name
(``kvbridge.handshake.native_read``). Engine-packed pages move whole
(``kvbridge.handshake.packed_plan``); those the reader must stage go, in push mode, into the staging
arena it advertises, which must hold a slot of each such group. The plan objects live in
``kvbridge.handshake.plan_model``.

Token chunk ``q`` (tokens ``q*u .. q*u+u-1``) lives in local block ``q // r_local`` at
chunk ``q % r_local`` and in remote block ``q // r_remote`` at chunk ``q % r_remote``.
Descriptor tables list ``block x chunk x piece`` rows; :meth:`GroupPlan.indices` picks
rows for given chunks with numpy, no per-block loops.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.layer_window import layer_window
from kvbridge.handshake.modes import TransferMode
from kvbridge.handshake.native_read import unless_rewritten
from kvbridge.handshake.packed_plan import check_block_packing, packed_plan
from kvbridge.handshake.pieces import (
    granularity,
    group_streams,
    head_wire,
    pieces,
    rewrites,
    wire_chunk,
)
from kvbridge.handshake.plan_model import (
    Granularity,
    GroupPlan,
    PieceStream,
    TransferPlan,
)
from kvbridge.handshake.tp_plan import head_slice, tp_attention_plan
from kvbridge.handshake.tp_state import state_layers, tp_state_plan
from kvbridge.layouts.arrangement import BlockArrangement, HeadOrder
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.groups import KVCacheGroup
from kvbridge.layouts.specs import AttentionSpec, StateSpec

MIN_NATIVE_PIECE_BYTES = 512  # smallest piece worth a descriptor when reading natively


def negotiate(
    local: PeerLayout,
    remote: PeerLayout,
    *,
    min_native_piece_bytes: int | None = None,
    can_repack: bool = False,
) -> TransferPlan:
    """The plan for reading ``remote``'s blocks into ``local``'s, or
    :class:`IncompatiblePeerError` naming what cannot be bridged. ``can_repack``: the
    local engine can rebuild its packed pages from the remote ones after load (merge
    smaller pages, split larger ones)."""
    if min_native_piece_bytes is None:
        min_native_piece_bytes = MIN_NATIVE_PIECE_BYTES
    stage = f"pp{remote.identity.pp_rank}/" if remote.identity.pp_size > 1 else ""
    peer = f"{remote.identity.engine_id}/{stage}rank{remote.identity.rank}"
    if local.transfer_mode is not remote.transfer_mode:
        raise IncompatiblePeerError(
            [("transfer_mode", local.transfer_mode.value, remote.transfer_mode.value)],
            peer=peer,
            hint="set extra.transfer_mode to the same value ('pull' or 'push') on prefill "
            "and decode",
        )
    window = layer_window(local, remote, peer)
    local, remote = window.local, window.remote
    heads = head_slice(local, remote, peer)
    across_tp = local.identity.tp_size != remote.identity.tp_size
    packed = check_block_packing(local, remote, peer, can_repack)
    if heads is not None and packed:
        if not (local.format.packed_heads_major and remote.format.packed_heads_major):
            raise IncompatiblePeerError(
                [("tp_size", local.identity.tp_size, remote.identity.tp_size)],
                peer=peer,
                hint=f"{local.format.block_packing!r} pages are moved whole and their heads "
                f"are not contiguous runs, so a slice of the heads cannot be read",
            )
    if len(local.config.groups) != len(remote.config.groups):
        raise IncompatiblePeerError(
            [("num_groups", len(local.config.groups), len(remote.config.groups))], peer=peer
        )
    plans: list[GroupPlan] = []
    for lg, rg in zip(local.config.groups, remote.config.groups, strict=True):
        if window.moves_nothing(lg.group_id):  # another pipeline stage holds its layers
            plans.append(_nothing(lg))
            continue
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
            if isinstance(lg.spec, StateSpec) and across_tp:
                plans.append(tp_state_plan(local, remote, lg, rg, peer))
            elif isinstance(lg.spec, StateSpec):  # kvbridge's own page layout, packed or not
                plans.append(_state_plan(local, remote, lg, rg))
            elif packed:
                plans.append(packed_plan(local, remote, lg, rg, heads))
            elif heads is not None:
                plans.append(
                    tp_attention_plan(local, remote, lg, rg, heads, min_native_piece_bytes)
                )
            else:
                plans.append(_attention_plan(local, remote, lg, rg, min_native_piece_bytes))
        except LayoutError as exc:
            raise IncompatiblePeerError(
                [(f"groups[{lg.group_id}]", str(local.format), str(remote.format))],
                peer=peer,
                hint=f"cannot bridge the block formats: {exc}",
            ) from None
    plans = [  # the layers a cut plan moves (none for a plan without streams)
        replace(p, layers=cut) if (cut := window.layers[p.group_id]) and p.streams else p
        for p in plans
    ]
    if local.transfer_mode is TransferMode.PUSH:
        _check_push_staging(local, [p for p in plans if p.split_from], peer)
    return TransferPlan(
        local_engine_id=local.identity.engine_id,
        remote_engine_id=remote.identity.engine_id,
        remote_agent_name=remote.identity.agent_name,
        groups=tuple(plans),
    )


def _nothing(group: KVCacheGroup) -> GroupPlan:
    """The plan of a group whose layers another pipeline stage holds: no streams, no
    rewrites (landing takes a group's rewrites from the sources that moved it)."""
    size = group.spec.block_size
    return GroupPlan(
        group_id=group.group_id,
        kind=group.kind,
        wire_tokens=size,
        local_chunks_per_block=1,
        remote_chunks_per_block=1,
        sender=None,
        receiver=None,
        streams=(),
        skipped=True,
    )


def _check_push_staging(local: PeerLayout, staged: list[GroupPlan], peer: str) -> None:
    """A push of pages decode must stage goes into decode's advertised staging arena: it
    must exist and hold one slot (a remote page of every layer) of every staged group."""
    if not staged:
        return
    ids = [g.group_id for g in staged]
    arena = local.staging.block_bytes if local.staging is not None else 0
    if arena == 0:
        raise IncompatiblePeerError(
            [("staging", "none", "needed")],
            peer=peer,
            hint=f"groups {ids}: prefill's engine-packed pages are larger than decode's (or "
            f"do not divide them), so prefill must write them into decode's staging slots, "
            f"and decode advertises none (an older kvbridge, or no engine repacker): "
            f"upgrade decode or use transfer_mode 'pull' for this pair",
        )
    need = max(g.staging_bytes for g in staged)
    if arena < need:
        raise IncompatiblePeerError(
            [("staging_bytes", arena, need)],
            peer=peer,
            hint=f"groups {ids}: one staging slot needs {need} B (a prefill page of every "
            f"layer) but decode's staging holds {arena} B; raise extra.staging_mib on decode",
        )


# -- attention groups ------------------------------------------------------------------


def _attention_plan(
    local: PeerLayout,
    remote: PeerLayout,
    lg: KVCacheGroup,
    rg: KVCacheGroup,
    min_native_piece_bytes: int,
) -> GroupPlan:
    lspec, rspec = lg.spec, rg.spec
    assert isinstance(lspec, AttentionSpec) and isinstance(rspec, AttentionSpec)
    u, r_local, r_remote = wire_chunk(lspec, rspec)
    kb_local = local.format.kernel_block_size_for(lspec.block_size)
    grain = min(granularity(local, lspec), granularity(remote, rspec))
    # head-outer cross-layer blocks on both sides (vLLM's BHLNC) travel as they are
    head_outer = grain is Granularity.GROUP and local.format.heads is remote.format.heads
    wire = BlockArrangement(
        layout=local.format.layout,
        sub_blocks_per_chunk=u // kb_local if u % kb_local == 0 else 1,
        parts_outer=grain is Granularity.PART,
        heads=local.format.heads if head_outer else HeadOrder.INNER,
    )
    if grain is Granularity.HEAD:  # a heads-outer side: each (layer, part, head) one run
        wire = head_wire(local, remote)
    sender, receiver = rewrites(local, remote, lg, rg, wire, r_local, r_remote)
    heads_first = grain is Granularity.HEAD and wire.heads is HeadOrder.IN_CHUNK
    streams = _attention_streams(
        local, remote, lg, lspec, rspec, grain, r_local, r_remote, heads_first=heads_first
    )
    streams, sender, native_read = unless_rewritten(
        streams, remote, rg.group_id, rspec, sender, r_remote, min_native_piece_bytes
    )
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


def _attention_streams(
    local: PeerLayout,
    remote: PeerLayout,
    group: KVCacheGroup,
    lspec: AttentionSpec,
    rspec: AttentionSpec,
    grain: Granularity,
    r_local: int,
    r_remote: int,
    *,
    heads_first: bool = False,
) -> tuple[PieceStream, ...]:
    lp = pieces(local, group, lspec, grain, r_local, heads_first=heads_first)
    rp = pieces(remote, group, rspec, grain, r_remote, heads_first=heads_first)
    if set(lp) != set(rp):
        raise LayoutError(f"pieces do not correspond: local {sorted(lp)} vs remote {sorted(rp)}")
    chunk_bytes = lspec.page_size_bytes * group.num_layers // r_local
    pieces_per_chunk = len(lp)
    length = chunk_bytes // pieces_per_chunk
    return group_streams(lp, rp, length)


# -- state groups -----------------------------------------------------------------------


def _state_plan(
    local: PeerLayout, remote: PeerLayout, lg: KVCacheGroup, rg: KVCacheGroup
) -> GroupPlan:
    lspec, rspec = lg.spec, rg.spec
    assert isinstance(lspec, StateSpec) and isinstance(rspec, StateSpec)
    if lspec.state_bytes != rspec.state_bytes:
        raise LayoutError(f"state sizes differ: {lspec.state_bytes} vs {rspec.state_bytes} bytes")

    def pieces(side: PeerLayout, spec: StateSpec) -> dict[tuple[int, int], tuple[int, int, int]]:
        return {(layer, -1): where for layer, where in state_layers(side, lg, spec).items()}

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
        streams=group_streams(lp, rp, lspec.state_bytes),
    )
