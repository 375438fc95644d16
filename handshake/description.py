"""A worker's self-description: built from its buffers, parsed back into layout objects.

``describe`` turns a side's :class:`~kvbridge.layouts.allocation.KVCacheBuffers` (plus identity
and NIXL metadata) into the :class:`WorkerDescription` the listener publishes;
``parse_description`` turns any description, local or remote, into a :class:`PeerLayout`
that negotiation reads. Both sides therefore go through the same parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.handshake.errors import ProtocolError
from kvbridge.handshake.messages import (
    PROTOCOL_VERSION,
    WireGroup,
    WireRegion,
    WireSpec,
    WireStateSharding,
    WorkerDescription,
)
from kvbridge.handshake.modes import TransferMode
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.arrangement import HeadOrder
from kvbridge.layouts.digest import DIGEST_VERSION
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.region import KVRegion, MemoryKind
from kvbridge.layouts.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheKind,
    KVCacheSpec,
    MLASpec,
    SlidingWindowSpec,
    StateSharding,
    StateSpec,
    dtype_name,
    parse_dtype,
)


@dataclass(frozen=True, kw_only=True)
class WorkerIdentity:
    """Who a worker is and which model it serves.

    The model is what decides its KV cache (``architecture``, ``dtype``, layers, KV heads,
    head size, and the groups beside it) and, where weights may differ under the same
    shapes, ``model_fingerprint``: :func:`kvbridge.handshake.compat.check_compatible`
    compares those, never ``model_name``, so that two copies of a model in two directories
    pair."""

    engine_id: str
    agent_name: str
    model_name: str  # names the model in logs (vLLM: the --model path); never compared
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0  # pipeline stage; its groups list only the layers it holds
    pp_size: int = 1
    architecture: str = ""  # the model's class (vLLM: LlamaForCausalLM); "": unknown
    model_fingerprint: str = ""  # which weights (extra.model_fingerprint); "": unknown

    @property
    def engine_rank(self) -> int:
        """This worker among all of its engine's: stage-major, TP rank inside the stage
        (its side channel listens on ``kv_port + engine_rank``)."""
        return self.pp_rank * self.tp_size + self.rank


@dataclass(frozen=True, kw_only=True)
class RegionInfo:
    """A region plus where it belongs (group, first layer in the group, kv part or -1)."""

    region: KVRegion
    group_id: int
    layer_index: int  # index inside the group; -1: every layer of the group (cross-layer)
    kv_part: int  # -1: every part
    head: int = -1  # -1: every head; else the one head a heads-outer (LHBNC) region holds


@dataclass(frozen=True, kw_only=True)
class PeerLayout:
    """Everything negotiation needs about one side, in layout objects."""

    identity: WorkerIdentity
    config: KVCacheConfig
    format: CacheFormat
    block_size: int
    regions: tuple[RegionInfo, ...]
    rewrites_in_place: bool = True  # the sender may rewrite its blocks after save
    transfer_mode: TransferMode = TransferMode.PULL
    can_repack: bool = False  # rebuilds its packed pages from remote ones after a load
    rewrites_on_save: bool = False  # readers that need no rewrite must claim first
    staging: KVRegion | None = None  # push: the arena a writer stages whole pages into
    gather: KVRegion | None = None  # pull: the pages a sender packs claimed rows into
    digest_version: int = 1  # what its verified loads' digests mean (1: an older peer)

    def group_regions(self, group_id: int) -> list[RegionInfo]:
        return [r for r in self.regions if r.group_id == group_id]


def spec_to_wire(spec: KVCacheSpec) -> WireSpec:
    if isinstance(spec, StateSpec):
        return WireSpec(
            kind=spec.kind.value,
            block_size=spec.block_size,
            state_shapes=[list(s) for s in spec.shapes],
            state_dtypes=[dtype_name(d) for d in spec.dtypes],
            page_size_bytes=spec.page_size_bytes,
            state_sharding=[
                WireStateSharding(
                    dim=-1 if how.dim is None else how.dim, sections=list(how.sections)
                )
                for how in spec.sharding or ()
            ],
        )
    return WireSpec(
        kind=spec.kind.value,
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=dtype_name(spec.dtype),
        sliding_window=getattr(spec, "sliding_window", 0),
        page_size_bytes=spec.page_size_bytes,
        kv_interleaved=spec.kv_interleaved,
    )


def spec_from_wire(wire: WireSpec) -> KVCacheSpec:
    kind = KVCacheKind(wire.kind)
    if kind is KVCacheKind.STATE:
        return StateSpec(
            block_size=wire.block_size,
            shapes=tuple(tuple(s) for s in wire.state_shapes),
            dtypes=tuple(parse_dtype(d) for d in wire.state_dtypes),
            page_size_padded=wire.page_size_bytes or None,
            sharding=tuple(
                StateSharding(dim=None if w.dim == -1 else w.dim, sections=tuple(w.sections))
                for w in wire.state_sharding
            )
            or None,
        )
    common = {
        "block_size": wire.block_size,
        "head_size": wire.head_size,
        "dtype": parse_dtype(wire.dtype),
    }
    if kind is KVCacheKind.MLA:
        return MLASpec(**common)
    if kind is KVCacheKind.SLIDING_WINDOW:
        return SlidingWindowSpec(
            num_kv_heads=wire.num_kv_heads,
            sliding_window=wire.sliding_window,
            kv_interleaved=wire.kv_interleaved,
            **common,
        )
    return FullAttentionSpec(
        num_kv_heads=wire.num_kv_heads, kv_interleaved=wire.kv_interleaved, **common
    )


def describe(
    identity: WorkerIdentity,
    buffers: KVCacheBuffers,
    *,
    nixl_metadata: bytes,
    compat_hash: str,
    side_channel_host: str = "",
    side_channel_port: int = 0,
    rewrites_in_place: bool = True,
    transfer_mode: TransferMode = TransferMode.PULL,
    can_repack: bool = False,
    rewrites_on_save: bool = False,
    staging: KVRegion | None = None,
    gather: KVRegion | None = None,
    kv_role: str = "",
) -> WorkerDescription:
    """The description a worker publishes for its buffers (``staging``: its registered
    staging arena, advertised for a pushing writer; ``gather``: the pages it packs
    claimed rows into, advertised for a pulling reader; ``kv_role``: its config's
    ``kv_role`` value)."""
    config, fmt = buffers.config, buffers.format
    block_size = _side_block_size(config)
    regions = []
    for g in config.groups:
        slots = buffers.unit_slots(g.group_id)
        first = config.group_layer_offset(g.group_id)
        for s in slots:
            regions.append(
                _region_to_wire(
                    s.region,
                    group_id=g.group_id,
                    layer_index=-1 if s.layer_index < 0 else s.layer_index - first,
                    kv_part=s.kv_part,
                    head=s.head,
                )
            )
    return WorkerDescription(
        protocol_version=PROTOCOL_VERSION,
        engine_id=identity.engine_id,
        agent_name=identity.agent_name,
        rank=identity.rank,
        tp_size=identity.tp_size,
        pp_rank=identity.pp_rank,
        pp_size=identity.pp_size,
        model_name=identity.model_name,
        dtype=identity.dtype,
        num_layers=identity.num_layers,
        num_kv_heads=identity.num_kv_heads,
        head_size=identity.head_size,
        compat_hash=compat_hash,
        block_size=block_size,
        kernel_block_size=fmt.kernel_block_size_for(block_size) if block_size else 0,
        kv_layout=fmt.layout.value,
        kv_packing=fmt.packing.value,
        cross_layer=fmt.cross_layer,
        groups=[
            WireGroup(
                group_id=g.group_id, layer_names=list(g.layer_names), spec=spec_to_wire(g.spec)
            )
            for g in config.groups
        ],
        regions=regions,
        nixl_metadata=nixl_metadata,
        side_channel_host=side_channel_host,
        side_channel_port=side_channel_port,
        rewrites_in_place=rewrites_in_place,
        block_packing=fmt.block_packing,
        packed_heads_major=fmt.packed_heads_major,
        transfer_mode=transfer_mode.value,
        can_repack=can_repack,
        rewrites_on_save=rewrites_on_save,
        staging=_region_to_wire(staging) if staging is not None else None,
        kv_heads=fmt.heads.value,
        numbered_claims=True,
        gather=_region_to_wire(gather) if gather is not None else None,
        kv_role=kv_role,
        architecture=identity.architecture,
        model_fingerprint=identity.model_fingerprint,
        digest_version=DIGEST_VERSION,
        push_status=True,
    )


def _region_to_wire(
    r: KVRegion,
    *,
    group_id: int = -1,
    layer_index: int = -1,
    kv_part: int = -1,
    head: int = -1,
) -> WireRegion:
    return WireRegion(
        name=r.name,
        base_addr=r.base_addr,
        block_bytes=r.block_bytes,
        block_stride_bytes=r.block_stride_bytes,
        num_blocks=r.num_blocks,
        memory_kind=r.memory_kind.value,
        device_id=r.device_id,
        group_id=group_id,
        layer_index=layer_index,
        kv_part=kv_part,
        head=head,
    )


def _region_from_wire(r: WireRegion) -> KVRegion:
    return KVRegion(
        name=r.name,
        base_addr=r.base_addr,
        block_bytes=r.block_bytes,
        block_stride_bytes=r.block_stride_bytes,
        num_blocks=r.num_blocks,
        memory_kind=MemoryKind(r.memory_kind),
        device_id=r.device_id,
    )


def parse_description(desc: WorkerDescription) -> PeerLayout:
    """Layout objects for a description; any invalid value raises :class:`ProtocolError`
    naming the field (a peer that sends nonsense is a protocol problem, not a crash)."""
    try:
        groups = tuple(
            KVCacheGroup(
                group_id=g.group_id, layer_names=tuple(g.layer_names), spec=spec_from_wire(g.spec)
            )
            for g in desc.groups
        )
        if not desc.regions:
            raise LayoutError("no regions")
        num_blocks = desc.regions[0].num_blocks
        config = KVCacheConfig(groups=groups, num_blocks=num_blocks)
        fmt = CacheFormat(
            layout=KVLayout.parse(desc.kv_layout),
            kernel_block_size=desc.kernel_block_size or None,
            cross_layer=desc.cross_layer,
            packing=KVPacking.parse(desc.kv_packing),
            block_packing=desc.block_packing,
            packed_heads_major=desc.packed_heads_major,
            heads=HeadOrder.parse(desc.kv_heads),
        )
        regions = tuple(
            RegionInfo(
                region=_region_from_wire(r),
                group_id=r.group_id,
                layer_index=r.layer_index,
                kv_part=r.kv_part,
                head=r.head,
            )
            for r in desc.regions
        )
        for g in groups:
            if isinstance(g.spec, AttentionSpec):
                fmt.kernel_block_size_for(g.spec.block_size)
        mode = TransferMode.parse(desc.transfer_mode)
        staging = _region_from_wire(desc.staging) if desc.staging is not None else None
        gather = _region_from_wire(desc.gather) if desc.gather is not None else None
    except (LayoutError, ValueError, TypeError) as exc:
        raise ProtocolError(
            f"description from engine {desc.engine_id!r} (rank {desc.rank}) is invalid: {exc}"
        ) from None
    identity = WorkerIdentity(
        engine_id=desc.engine_id,
        agent_name=desc.agent_name,
        model_name=desc.model_name,
        dtype=desc.dtype,
        num_layers=desc.num_layers,
        num_kv_heads=desc.num_kv_heads,
        head_size=desc.head_size,
        rank=desc.rank,
        tp_size=desc.tp_size,
        pp_rank=desc.pp_rank,
        pp_size=desc.pp_size,
        architecture=desc.architecture,
        model_fingerprint=desc.model_fingerprint,
    )
    return PeerLayout(
        identity=identity,
        config=config,
        format=fmt,
        block_size=desc.block_size,
        regions=regions,
        rewrites_in_place=desc.rewrites_in_place,
        transfer_mode=mode,
        can_repack=desc.can_repack,
        rewrites_on_save=desc.rewrites_on_save,
        staging=staging,
        gather=gather,
        digest_version=desc.digest_version,
    )


def _side_block_size(config: KVCacheConfig) -> int:
    sizes = {g.spec.block_size for g in config.groups if isinstance(g.spec, AttentionSpec)}
    if len(sizes) > 1:
        raise LayoutError(f"attention groups use different block sizes {sorted(sizes)}")
    return sizes.pop() if sizes else config.groups[0].spec.block_size
