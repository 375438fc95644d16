"""Plans between ranks of different tensor-parallel sizes: a slice of the KV heads.

Under tensor parallelism a rank's cache holds only some of the model's KV heads
(:mod:`kvbridge.handshake.tp`). A decode rank reads from a prefill rank exactly the heads they
share, and nothing else. To make that slice cheap to address, the wire chunk is
*head-major*: the sender rewrites its blocks after save so that inside every piece the
heads are outermost, and the shared heads are one contiguous byte range::

    both sides cross-layer   chunk = [head][layer][K|V][t, D]  -> 1 descriptor per
                                                                  (chunk, source rank)
    per-layer on a side      layer = [head][K|V][t, D]         -> 1 per (layer, chunk)
    kv-split on a side       part  = [head][t, D]              -> 1 per (layer, part, chunk)
    heads-outer on a side    (``pieces.head_wire``)            -> 1 per (layer, part, head,
                             (vLLM's LHBNC)                         chunk): the shared heads

The receiver rewrites its blocks back to its native arrangement once every source rank's
heads have arrived. Block-size, layout, kernel-block and granularity differences combine
with the head slice as in the plans for equal TP sizes.

State (Mamba-like) groups: an engine shards each state tensor over its ranks along its
own dimensions (vLLM's Mamba2 conv state even concatenates three differently sharded
parts). Where both sides describe that sharding (``StateSpec.sharding``), a decode rank
reads exactly its shard of every state tensor from the prefill ranks holding it
(:mod:`kvbridge.handshake.tp_state`); where either side does not, a state spec carries only a
rank's shapes, no byte range of one rank's state is known to be another's, and
:func:`check_groups_across_tp` refuses different TP sizes by name.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvbridge.handshake import tp
from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.native_read import unless_rewritten
from kvbridge.handshake.pieces import (
    PieceMap,
    granularity,
    group_streams,
    head_wire,
    pieces,
    rewrites,
    wire_chunk,
)
from kvbridge.handshake.plan_model import Granularity, GroupPlan
from kvbridge.layouts.arrangement import BlockArrangement, HeadOrder
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.groups import KVCacheGroup
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import AttentionSpec, KVCacheKind, StateSpec


def reads_from(local: PeerLayout, remote: PeerLayout) -> bool:
    """Whether ``local`` reads any KV heads from ``remote`` (else it only tells it
    ``Done``: an unread replica under GQA replication)."""
    li, ri = local.identity, remote.identity
    try:
        slices = tp.sources(li.rank, li.tp_size, ri.tp_size, li.num_kv_heads)
    except LayoutError:
        return True  # negotiate names the problem
    return any(s.remote_rank == ri.rank for s in slices)


def check_groups_across_tp(
    kinds: Sequence[KVCacheKind],
    local_tp: int,
    remote_tp: int,
    peer: str,
    *,
    described: Collection[int] = (),
) -> None:
    """Raise :class:`IncompatiblePeerError` naming both TP sizes when groups of ``kinds``
    (in group-id order) cannot move between ``local_tp`` and ``remote_tp`` ranks: a state
    group can only when the sizes are equal (rank ``r`` reads rank ``r``) or when it is in
    ``described``, the groups whose state sharding both sides describe
    (:mod:`kvbridge.handshake.tp_state` maps those)."""
    if local_tp == remote_tp:
        return
    state = [g for g, kind in enumerate(kinds) if kind is KVCacheKind.STATE and g not in described]
    if state:
        raise IncompatiblePeerError(
            [("tp_size", local_tp, remote_tp)],
            peer=peer,
            hint=f"groups {state} hold recurrent (Mamba-like) state, which each rank keeps "
            f"only its shard of, split along dimensions the handshake does not describe, so "
            f"kvbridge moves this state only between equal tensor-parallel sizes: run prefill "
            f"and decode at the same TP size (both {local_tp} or both {remote_tp}), or have "
            f"both engines describe how they shard each state tensor (StateSpec.sharding)",
        )


def described_state_groups(local: PeerLayout, remote: PeerLayout) -> list[int]:
    """The state groups whose sharding both sides describe."""
    return [
        lg.group_id
        for lg, rg in zip(local.config.groups, remote.config.groups, strict=False)
        if isinstance(lg.spec, StateSpec)
        and isinstance(rg.spec, StateSpec)
        and lg.spec.sharding is not None
        and rg.spec.sharding is not None
    ]


def head_slice(local: PeerLayout, remote: PeerLayout, peer: str) -> tp.HeadSlice | None:
    """The heads ``local`` reads from ``remote``; None when they hold the same heads.

    Raises :class:`IncompatiblePeerError` when the two TP sizes cannot be bridged: the
    heads do not shard, ``remote`` holds none of ``local``'s heads, or a group cannot
    move between different TP sizes (:func:`check_groups_across_tp`).
    """
    li, ri = local.identity, remote.identity
    total = li.num_kv_heads
    kinds = [g.kind for g in local.config.groups]
    check_groups_across_tp(
        kinds, li.tp_size, ri.tp_size, peer, described=described_state_groups(local, remote)
    )
    try:
        mine = [
            s
            for s in tp.sources(li.rank, li.tp_size, ri.tp_size, total)
            if s.remote_rank == ri.rank
        ]
        local_count = tp.rank_heads(li.rank, li.tp_size, total).count
        remote_count = tp.rank_heads(ri.rank, ri.tp_size, total).count
    except LayoutError as exc:
        raise IncompatiblePeerError(
            [("tp_size", li.tp_size, ri.tp_size)],
            peer=peer,
            hint=f"the KV heads cannot be sharded this way: {exc}",
        ) from None
    if not mine:
        raise IncompatiblePeerError(
            [("rank", li.rank, ri.rank)],
            peer=peer,
            hint=f"prefill rank {ri.rank} of {ri.tp_size} holds none of the KV heads decode "
            f"rank {li.rank} of {li.tp_size} reads ({total} KV heads); read the ranks "
            f"kvbridge.connector.worker.routing names",
        )
    (s,) = mine
    if s.num_heads == local_count == remote_count:
        return None
    return s


def tp_attention_plan(
    local: PeerLayout,
    remote: PeerLayout,
    lg: KVCacheGroup,
    rg: KVCacheGroup,
    hs: tp.HeadSlice,
    min_native_piece_bytes: int,
) -> GroupPlan:
    """Heads ``hs`` of every token chunk, head-major on the wire. A sender that may not
    rewrite its blocks is read in its native arrangement instead, in runs of at least
    ``min_native_piece_bytes`` (else :class:`LayoutError` naming the piece size)."""
    lspec, rspec = lg.spec, rg.spec
    if not isinstance(lspec, AttentionSpec) or not isinstance(rspec, AttentionSpec):
        raise LayoutError(
            f"group {lg.group_id} ({lg.kind.value}): only attention groups move between "
            f"different tensor-parallel sizes so far"
        )
    lh = tp.rank_heads(local.identity.rank, local.identity.tp_size, local.identity.num_kv_heads)
    rh = tp.rank_heads(remote.identity.rank, remote.identity.tp_size, local.identity.num_kv_heads)
    if (lspec.num_kv_heads, rspec.num_kv_heads) != (lh.count, rh.count):
        raise LayoutError(
            f"group {lg.group_id}: caches hold {lspec.num_kv_heads} (local) and "
            f"{rspec.num_kv_heads} (remote) heads per rank, but {local.identity.num_kv_heads} "
            f"KV heads at TP {local.identity.tp_size} / {remote.identity.tp_size} give "
            f"{lh.count} and {rh.count}"
        )
    u, r_local, r_remote = wire_chunk(lspec, rspec)
    grain = min(granularity(local, lspec), granularity(remote, rspec))
    if not remote.rewrites_in_place and remote.format.heads is not HeadOrder.IN_CHUNK:
        # Read where the sender keeps its heads: inside each (layer, K|V) part, so that an
        # HND sender's head slice is one run per part and no rewrite is needed. A
        # head-outer sender (vLLM's BHLNC) keeps a head slice of a whole block in one run.
        grain = min(grain, Granularity.PART)
    if grain is Granularity.HEAD:
        wire = head_wire(local, remote)
    else:
        wire = BlockArrangement(
            layout=KVLayout.HND,
            parts_outer=grain is Granularity.PART,
            heads={
                Granularity.GROUP: HeadOrder.IN_CHUNK,
                Granularity.LAYER: HeadOrder.IN_LAYER,
                Granularity.PART: HeadOrder.INNER,  # HND with K and V apart: [part][head][t, D]
            }[grain],
        )
    sender, receiver = rewrites(local, remote, lg, rg, wire, r_local, r_remote)
    heads_first = grain is Granularity.HEAD and wire.heads is HeadOrder.IN_CHUNK
    lp = pieces(local, lg, lspec, grain, r_local, heads_first=heads_first)
    rp = pieces(remote, rg, rspec, grain, r_remote, heads_first=heads_first)
    if grain is Granularity.HEAD:  # the shared heads' pieces, renumbered from 0
        lp = _heads(lp, hs.local_head, hs.num_heads)
        rp = _heads(rp, hs.remote_head, hs.num_heads)
    if set(lp) != set(rp):
        raise LayoutError(f"pieces do not correspond: local {sorted(lp)} vs remote {sorted(rp)}")
    layers = lg.num_layers
    if grain is Granularity.HEAD:  # each piece is one head, already one of the shared ones
        l_heads, r_heads, (l_first, r_first, count) = 1, 1, (0, 0, 1)
        l_piece = lspec.page_size_bytes // (lspec.num_kv_parts * lh.count * r_local)
        r_piece = rspec.page_size_bytes // (rspec.num_kv_parts * rh.count * r_remote)
    else:
        l_heads, r_heads = lh.count, rh.count
        l_first, r_first, count = hs.local_head, hs.remote_head, hs.num_heads
        l_piece = lspec.page_size_bytes * layers // r_local // len(lp)
        r_piece = rspec.page_size_bytes * layers // r_remote // len(rp)
    per_head = l_piece // l_heads
    if per_head * l_heads != l_piece or r_piece != per_head * r_heads:
        raise LayoutError(
            f"group {lg.group_id}: pieces of {l_piece} B (local, {lh.count} heads) and "
            f"{r_piece} B (remote, {rh.count} heads) do not hold whole heads of equal size"
        )
    streams = group_streams(
        _shifted(lp, l_first * per_head), _shifted(rp, r_first * per_head), count * per_head
    )
    # A sender whose engine may read these blocks meanwhile: its head slice read where it
    # lies (HND: one run per head slice of a (layer, K|V) block part).
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
        head_slice=(hs.local_head, hs.remote_head, hs.num_heads),
        native_read=native_read,
    )


def _heads(side: PieceMap, first: int, count: int) -> PieceMap:
    """The pieces of heads ``first .. first + count - 1``, keyed by head - ``first``."""
    return {
        (*key[:2], key[2] - first): where
        for key, where in side.items()
        if first <= key[2] < first + count
    }


def _shifted(side: PieceMap, by: int) -> PieceMap:
    return {key: (idx, offset + by, chunk) for key, (idx, offset, chunk) in side.items()}
