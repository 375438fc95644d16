"""State (Mamba-like) groups across tensor-parallel sizes: which bytes of a prefill rank's
state a decode rank needs, and where they land in its own.

An engine shards each state tensor over its TP ranks along one dimension (or keeps it
whole on every rank), as its :class:`~kvbridge.layouts.specs.StateSharding` says; a dimension
may concatenate sections that are each split on their own (vLLM's Mamba2 conv state:
x, B and C). Rank ``r`` of ``tp`` holds the ``r``-th ``tp``-th of every section, so a
decode rank and a prefill rank share the overlap of their fractions of each section.
A slice ``[i, i + n)`` along dimension ``d`` of a C-contiguous tensor is one run of
``n * prod(shape[d + 1:])`` elements, repeated ``prod(shape[:d])`` times::

    ssm  [heads/tp, P, N], dim 0    decode TP 1 <- prefill rank 1 of 2:
         local  [ h0 h1 | h2 h3 ]   one run: heads 2..3 (remote 0..1)
    conv [K, (I + 2GN)/tp], dim 1, sections (I, GN, GN)/tp:
         local row k  [ x0 x1 | B0 B1 | C0 C1 ]   per row k and section: one run,
         remote row k [ x1 | B1 | C1 ]            K x 3 pieces from prefill rank 1

A replicated tensor is read whole, once per decode rank, from the first prefill rank
it reads KV heads from (:func:`kvbridge.handshake.tp.sources`), so reads spread over prefill
ranks as head replicas do. Sharded state is read only from prefill ranks the decode
rank reads heads from anyway: the ranks it talks to, and the ``Done`` bookkeeping that
frees prefill blocks (every prefill rank hears from its head readers, or the one decode
rank that releases an unread replica: :mod:`kvbridge.connector.worker.routing`), stay exactly those
of the KV heads. Where a decode rank's state shards lie on a prefill rank it reads no
heads from (prefill KV heads replicated: prefill TP above the KV head count), the plan
is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbridge.handshake import tp
from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.plan_model import GroupPlan, PieceStream
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.groups import KVCacheGroup
from kvbridge.layouts.specs import StateSharding, StateSpec


@dataclass(frozen=True)
class StatePiece:
    """``length`` bytes at ``remote_offset`` of the prefill rank's state page land at
    ``local_offset`` of the decode rank's (offsets inside one layer's state page)."""

    local_offset: int
    remote_offset: int
    length: int


def shard_sources(local_rank: int, local_tp: int, remote_tp: int) -> tuple[int, ...]:
    """The remote ranks whose share of a split dimension overlaps local rank
    ``local_rank``'s: rank ``r`` of ``tp`` holds the fraction ``[r/tp, (r+1)/tp)``."""
    first = local_rank * remote_tp // local_tp
    end = -(-(local_rank + 1) * remote_tp // local_tp)
    return tuple(range(first, end))


def replica_source(local_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int) -> int:
    """The remote rank local rank ``local_rank`` reads replicated state tensors from: the
    first it reads KV heads from."""
    return tp.sources(local_rank, local_tp, remote_tp, total_kv_heads)[0].remote_rank


def state_pieces(
    lspec: StateSpec,
    rspec: StateSpec,
    local_rank: int,
    remote_rank: int,
    *,
    read_replicated: bool,
) -> tuple[StatePiece, ...]:
    """The pieces of remote rank ``remote_rank``'s state page that local rank
    ``local_rank`` needs (each side's TP size is implied by its per-rank section sizes),
    in local order, runs contiguous on both sides merged; replicated tensors only when
    ``read_replicated``. The specs must have passed :func:`check_state_specs`."""
    assert lspec.sharding is not None and rspec.sharding is not None
    lr, rr = local_rank, remote_rank
    out: list[StatePiece] = []
    for i, how in enumerate(lspec.sharding):
        lshape, rshape = lspec.shapes[i], rspec.shapes[i]
        lbase, rbase = lspec.state_offsets[i], rspec.state_offsets[i]
        itemsize = lspec.dtypes[i].itemsize
        if how.dim is None:
            if read_replicated:
                out.append(StatePiece(lbase, rbase, lspec.state_nbytes[i]))
            continue
        d = how.dim
        outer, inner = math.prod(lshape[:d]), math.prod(lshape[d + 1 :]) * itemsize
        lsec, rsec = how.section_sizes(lshape), rspec.sharding[i].section_sizes(rshape)
        for o in range(outer):
            lstart = rstart = 0  # where the section starts along dim d, per rank
            for sl, sr in zip(lsec, rsec, strict=True):
                lo, hi = max(lr * sl, rr * sr), min((lr + 1) * sl, (rr + 1) * sr)
                if lo < hi:
                    li, ri = lstart + lo - lr * sl, rstart + lo - rr * sr
                    out.append(
                        StatePiece(
                            lbase + (o * lshape[d] + li) * inner,
                            rbase + (o * rshape[d] + ri) * inner,
                            (hi - lo) * inner,
                        )
                    )
                lstart, rstart = lstart + sl, rstart + sr
    return _merged(out)


def _merged(pieces: list[StatePiece]) -> tuple[StatePiece, ...]:
    out: list[StatePiece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (
            last is not None
            and last.local_offset + last.length == p.local_offset
            and last.remote_offset + last.length == p.remote_offset
        ):
            out[-1] = StatePiece(last.local_offset, last.remote_offset, last.length + p.length)
        else:
            out.append(p)
    return tuple(out)


def check_state_specs(
    group_id: int, lspec: StateSpec, rspec: StateSpec, ltp: int, rtp: int, peer: str
) -> None:
    """Raise :class:`IncompatiblePeerError` unless the two ranks' state tensors are shards
    of the same model state: the same dtypes and sharding, equal dimensions where not
    sharded, and every sharded section the same size once multiplied by its TP size."""
    name = f"groups[{group_id}]"
    if lspec.sharding is None or rspec.sharding is None:
        raise IncompatiblePeerError(
            [(f"{name}.state_sharding", _described(lspec), _described(rspec))],
            peer=peer,
            hint="a state moves between different TP sizes only when both engines "
            "describe how they shard it (StateSpec.sharding)",
        )
    if lspec.dtypes != rspec.dtypes or len(lspec.shapes) != len(rspec.shapes):
        raise IncompatiblePeerError(
            [(f"{name}.state_dtypes", _dtypes(lspec), _dtypes(rspec))],
            peer=peer,
            hint="both sides must keep the same state tensors",
        )
    for i, (lhow, rhow) in enumerate(zip(lspec.sharding, rspec.sharding, strict=True)):
        lshape, rshape = lspec.shapes[i], rspec.shapes[i]
        field = f"{name}.state[{i}]"
        if (lhow.dim, len(lhow.sections) or 1) != (rhow.dim, len(rhow.sections) or 1):
            raise IncompatiblePeerError(
                [(f"{field}.sharding", _how(lhow), _how(rhow))],
                peer=peer,
                hint="the two engines shard this state tensor differently; serve both with "
                "the same model implementation",
            )
        if lhow.dim is None:
            same = lshape == rshape
        else:
            d = lhow.dim
            same = len(lshape) == len(rshape) and all(
                a == b for k, (a, b) in enumerate(zip(lshape, rshape, strict=True)) if k != d
            )
        if not same:
            raise IncompatiblePeerError(
                [(f"{field}.shape", lshape, rshape)],
                peer=peer,
                hint="only the sharded dimension of a state tensor may differ between TP sizes",
            )
        if lhow.dim is None:
            continue
        lsec, rsec = lhow.section_sizes(lshape), rhow.section_sizes(rshape)
        if [s * ltp for s in lsec] != [s * rtp for s in rsec]:
            raise IncompatiblePeerError(
                [(f"{field}.sections", lsec, rsec), ("tp_size", ltp, rtp)],
                peer=peer,
                hint=f"per rank these are shards of {[s * ltp for s in lsec]} (local, "
                f"x TP {ltp}) and {[s * rtp for s in rsec]} (remote, x TP {rtp}) along dim "
                f"{lhow.dim}: not the same model state, or its sizes do not shard evenly over "
                f"these TP sizes; pick TP sizes that divide every section",
            )


def tp_state_plan(
    local: PeerLayout, remote: PeerLayout, lg: KVCacheGroup, rg: KVCacheGroup, peer: str
) -> GroupPlan:
    """The pieces of ``remote``'s state blocks that ``local`` reads, across TP sizes.

    Raises :class:`IncompatiblePeerError` when the states do not correspond
    (:func:`check_state_specs`) or a shard lies on a prefill rank this decode rank
    reads no KV heads from."""
    lspec, rspec = lg.spec, rg.spec
    assert isinstance(lspec, StateSpec) and isinstance(rspec, StateSpec)
    li, ri = local.identity, remote.identity
    check_state_specs(lg.group_id, lspec, rspec, li.tp_size, ri.tp_size, peer)
    assert lspec.sharding is not None
    heads = {s.remote_rank for s in tp.sources(li.rank, li.tp_size, ri.tp_size, li.num_kv_heads)}
    if not all(how.replicated for how in lspec.sharding):
        needed = shard_sources(li.rank, li.tp_size, ri.tp_size)
        if not set(needed) <= heads:
            raise IncompatiblePeerError(
                [("tp_size", li.tp_size, ri.tp_size)],
                peer=peer,
                hint=f"decode rank {li.rank} of {li.tp_size} needs state group "
                f"{lg.group_id}'s shards from prefill ranks {list(needed)} but reads its "
                f"KV heads only from {sorted(heads)} (prefill replicates its "
                f"{li.num_kv_heads} KV heads over {ri.tp_size} ranks); run prefill at a TP "
                f"size of at most {li.num_kv_heads}, or at decode's TP size",
            )
    replica = replica_source(li.rank, li.tp_size, ri.tp_size, li.num_kv_heads)
    found = state_pieces(lspec, rspec, li.rank, ri.rank, read_replicated=replica == ri.rank)
    lp, rp = state_layers(local, lg, lspec), state_layers(remote, rg, rspec)
    if set(lp) != set(rp):
        raise LayoutError(f"state layers do not correspond: {sorted(lp)} vs {sorted(rp)}")
    return GroupPlan(
        group_id=lg.group_id,
        kind=lg.kind,
        wire_tokens=math.lcm(lspec.block_size, rspec.block_size),
        local_chunks_per_block=1,
        remote_chunks_per_block=1,
        sender=None,
        receiver=None,
        streams=_streams(lp, rp, found),
    )


LayerMap = dict[int, tuple[int, int, int]]  # layer -> (region, page offset, block bytes)


def state_layers(side: PeerLayout, group: KVCacheGroup, spec: StateSpec) -> LayerMap:
    """Where each layer's state page of a block sits: (region index, offset inside the
    region's block, the region's block bytes)."""
    out: LayerMap = {}
    for idx, info in enumerate(side.regions):
        if info.group_id != group.group_id:
            continue
        layers = range(group.num_layers) if info.layer_index < 0 else [info.layer_index]
        for i, layer in enumerate(layers):
            out[layer] = (idx, i * spec.page_size_bytes, info.region.block_bytes)
    return out


def _streams(lp: LayerMap, rp: LayerMap, found: tuple[StatePiece, ...]) -> tuple[PieceStream, ...]:
    """One stream per (local region, remote region, piece length): a stream's pieces all
    have one length."""
    rows: dict[tuple[int, int, int], list[tuple[int, int, int, int]]] = {}
    for layer in sorted(lp):
        (li, lbase, lblock), (ri, rbase, rblock) = lp[layer], rp[layer]
        for p in found:
            rows.setdefault((li, ri, p.length), []).append(
                (lbase + p.local_offset, rbase + p.remote_offset, lblock, rblock)
            )
    return tuple(
        PieceStream(
            local_region=li,
            remote_region=ri,
            local_offsets=tuple(r[0] for r in pieces),
            remote_offsets=tuple(r[1] for r in pieces),
            length=length,
            local_chunk_bytes=pieces[0][2],
            remote_chunk_bytes=pieces[0][3],
        )
        for (li, ri, length), pieces in rows.items()
    )


def _described(spec: StateSpec) -> str:
    return "not described" if spec.sharding is None else "described"


def _dtypes(spec: StateSpec) -> list[str]:
    return [str(d).removeprefix("torch.") for d in spec.dtypes]


def _how(how: StateSharding) -> str:
    if how.dim is None:
        return "replicated"
    return f"dim {how.dim}" + (f" sections {list(how.sections)}" if how.sections else "")
