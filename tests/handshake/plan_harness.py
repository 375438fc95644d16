"""Builds two sides in one process and executes a plan with memmove (no NIXL).

Used by the negotiation table tests: it proves the *plan* (pieces, offsets, rewrites)
delivers the sender's token-major KV, independently of the transport.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.handshake.compat import compat_hash
from kvbridge.handshake.description import PeerLayout, WorkerIdentity, describe, parse_description
from kvbridge.handshake.plan_model import TransferPlan
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.descriptors import block_descriptors
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MLASpec,
    SlidingWindowSpec,
    StateSharding,
    StateSpec,
)
from kvbridge.layouts.transforms import rewrite_group


def cache_format(
    layout: str, cross: bool, kernel: int | None = None, packing: str = "blocks_first"
) -> CacheFormat:
    """A kvbridge cache format by short names (tests' shorthand)."""
    return CacheFormat(
        layout=KVLayout(layout),
        kernel_block_size=kernel,
        cross_layer=cross,
        packing=KVPacking(packing),
    )


def sharded_state(block_size: int, tp_size: int = 1) -> StateSpec:
    """A Mamba2-like state at TP ``tp_size`` (1, 2 or 4), sharding described as vLLM
    shards it: conv ``[3, (8 + 2 * 4) / tp]`` split on dim 1 in sections x, B, C; ssm
    ``[4 / tp heads, 2, 4]`` on dim 0; and a small tensor replicated on every rank."""
    return StateSpec(
        block_size=block_size,
        shapes=((3, 16 // tp_size), (4 // tp_size, 2, 4), (6,)),
        dtypes=(torch.float16, torch.float32, torch.float16),
        sharding=(
            StateSharding(dim=1, sections=(8 // tp_size, 4 // tp_size, 4 // tp_size)),
            StateSharding(dim=0),
            StateSharding(dim=None),
        ),
    )


def shard(full: torch.Tensor, how: StateSharding, rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``rank`` of ``tp_size``'s shard of a whole state tensor (``how`` in whole-model
    sizes), cut with torch: the oracle for ``kvbridge.handshake.tp_state``'s byte ranges."""
    if how.dim is None:
        return full
    sections = full.split(list(how.sections) or [full.shape[how.dim]], dim=how.dim)
    return torch.cat([s.chunk(tp_size, dim=how.dim)[rank] for s in sections], dim=how.dim)


def unshard(shards: list[torch.Tensor], how: StateSharding, replica: int) -> torch.Tensor:
    """The whole tensor rebuilt from every rank's shard (``how`` in per-rank sizes); a
    replicated one is rank ``replica``'s (seeded ranks hold different copies, so a check
    against it also shows which rank was read)."""
    if how.dim is None:
        return shards[replica]
    split = [s.split(list(how.sections) or [s.shape[how.dim]], dim=how.dim) for s in shards]
    return torch.cat(
        [torch.cat([parts[j] for parts in split], dim=how.dim) for j in range(len(split[0]))],
        dim=how.dim,
    )


def make_groups(
    block_size: int,
    kinds: str,
    num_kv_heads: int = 2,
    tp_size: int = 1,
    layers: Sequence[int] = (0, 1),
    group_layers: Sequence[Sequence[int]] | None = None,
) -> list[KVCacheGroup]:
    """kinds: 'F' full, 'S' sliding window, 'M' state (sharding not described), 'T' state
    whose TP sharding is described (:func:`sharded_state` at ``tp_size``), 'R' state
    described as replicated on every rank, 'L' MLA latent (one head, replicated on every
    tensor-parallel rank). The model has two layers, each with one layer of every group
    (``g{i}.a`` in model layer 0, ``g{i}.b`` in layer 1); ``layers``: the model layers this
    side holds (a pipeline stage holds some). ``group_layers``: instead, the model layers
    each group has (up to 8: ``a``..``h``), as a hybrid model alternates its kinds; the side
    holds those in ``layers``."""
    groups = []
    for i, k in enumerate(kinds):
        common = {
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_size": 4,
            "dtype": torch.float16,
        }
        spec: KVCacheSpec
        if k == "F":
            spec = FullAttentionSpec(**common)
        elif k == "S":
            spec = SlidingWindowSpec(sliding_window=24, **common)
        elif k == "L":
            spec = MLASpec(**{**common, "num_kv_heads": 1, "head_size": 8})
        elif k == "T":
            spec = sharded_state(block_size, tp_size)
        elif k == "R":  # described, but whole on every rank
            spec = StateSpec(
                block_size=block_size,
                shapes=((3, 4), (5,)),
                dtypes=(torch.float32, torch.float16),
                sharding=(StateSharding(dim=None), StateSharding(dim=None)),
            )
        else:
            spec = StateSpec(
                block_size=block_size, shapes=((3, 4), (5,)), dtypes=(torch.float32, torch.float16)
            )
        mine = layers if group_layers is None else [n for n in group_layers[i] if n in layers]
        names = tuple(f"g{i}.{'abcdefgh'[layer]}" for layer in mine)
        groups.append(KVCacheGroup(group_id=i, layer_names=names, spec=spec))
    return groups


@dataclass
class Side:
    buffers: KVCacheBuffers
    layout: PeerLayout


def make_side(
    engine: str,
    block_size: int,
    fmt: CacheFormat,
    kinds: str,
    num_blocks: int,
    *,
    rewrites_in_place: bool = True,
    rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int = 2,
    layers: Sequence[int] = (0, 1),
    group_layers: Sequence[Sequence[int]] | None = None,
    pp: tuple[int, int] | None = None,
) -> Side:
    """A side of ``total_kv_heads`` model heads at rank ``rank`` of ``tp_size``, holding
    the model ``layers`` (fewer than both: a pipeline stage, ``pp_size`` 2; ``pp``:
    ``(pp_rank, pp_size)`` instead), each group those of its ``group_layers``."""
    from kvbridge.handshake.tp import rank_heads

    heads = rank_heads(rank, tp_size, total_kv_heads).count
    groups = make_groups(block_size, kinds, heads, tp_size, layers, group_layers)
    config = KVCacheConfig.uniform(groups, num_blocks)
    buffers = KVCacheBuffers(config, fmt)
    for t in buffers.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    identity = WorkerIdentity(
        engine_id=engine,
        agent_name=engine,
        model_name="m",
        dtype="float16",
        num_layers=config.num_layers,
        num_kv_heads=total_kv_heads,
        head_size=4,
        rank=rank,
        tp_size=tp_size,
        pp_rank=pp[0] if pp else layers[0] if len(layers) < 2 else 0,
        pp_size=pp[1] if pp else 2 if len(layers) < 2 else 1,
    )
    desc = describe(
        identity,
        buffers,
        nixl_metadata=b"",
        compat_hash=compat_hash(identity, config),
        rewrites_in_place=rewrites_in_place,
    )
    return Side(buffers=buffers, layout=parse_description(desc))


def execute(
    plan: TransferPlan,
    local: Side,
    remote: Side,
    group_id: int,
    chunk_ids: np.ndarray,
    local_ids: np.ndarray,
    remote_ids: np.ndarray,
    *,
    local_first: int = 0,
    remote_first: int = 0,
    receiver_rewrite: bool = True,
) -> int:
    """Sender rewrite, memmove every piece, receiver rewrite; returns descriptors moved."""
    gp = plan.groups[group_id]
    if gp.sender:
        rewrite_group(remote.buffers, group_id, remote_ids, gp.sender.src, gp.sender.dst)
    moved = 0
    for stream in gp.streams:
        lreg = local.layout.regions[stream.local_region].region
        rreg = remote.layout.regions[stream.remote_region].region
        ltab = block_descriptors(
            lreg, np.arange(lreg.num_blocks), offsets=gp.local_offsets(stream), length=stream.length
        )
        rtab = block_descriptors(
            rreg,
            np.arange(rreg.num_blocks),
            offsets=gp.remote_offsets(stream),
            length=stream.length,
        )
        li, ri = gp.indices(
            stream,
            chunk_ids,
            local_ids,
            remote_ids,
            local_first_block=local_first,
            remote_first_block=remote_first,
        )
        for a, b in zip(ltab[li], rtab[ri], strict=True):
            assert a[1] == b[1]
            ctypes.memmove(int(a[0]), int(b[0]), int(a[1]))
        moved += li.size
    if gp.receiver and receiver_rewrite:
        rewrite_group(local.buffers, group_id, local_ids, gp.receiver.src, gp.receiver.dst)
    return moved
