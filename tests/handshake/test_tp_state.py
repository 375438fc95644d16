"""State groups across tensor-parallel sizes (``kvbridge.handshake.tp_state``).

The oracle is independent of the byte arithmetic under test: a whole model state is
sharded with torch (``split``/``cat`` per section along the sharded dimension), each
rank's shard laid out in a state page as ``StateSpec`` lays it out, and every decode
rank's page, filled only through the pieces (or a negotiated plan executed with
memmove), must equal its torch shard byte for byte, each byte written exactly once.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from kvbridge.handshake import tp
from kvbridge.handshake.compat import check_compatible, compat_hash
from kvbridge.handshake.description import WorkerIdentity, describe, spec_from_wire, spec_to_wire
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.messages import WireSpec, WorkerDescription
from kvbridge.handshake.plan import negotiate
from kvbridge.handshake.tp_state import (
    check_state_specs,
    replica_source,
    shard_sources,
    state_pieces,
)
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.specs import StateSharding, StateSpec
from tests.handshake.plan_harness import (
    cache_format,
    execute,
    make_groups,
    make_side,
    shard,
    sharded_state,
    unshard,
)

TP_PAIRS = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (2, 4), (4, 1)]  # (decode, prefill)

# Whole-model state tensors: (shape, dtype, sharded dim or None, sections along it)
Tensor = tuple[tuple[int, ...], torch.dtype, int | None, tuple[int, ...]]
SHARDINGS: dict[str, list[Tensor]] = {
    "dim0": [((8, 3), torch.float32, 0, ())],
    "inner": [((3, 8), torch.float16, 1, ()), ((2, 8, 3), torch.float32, 1, ())],
    "sections": [((16, 3), torch.float16, 0, (8, 4, 4)), ((3, 16), torch.float16, 1, (8, 4, 4))],
    "replicated": [((5,), torch.float16, None, ())],
    "mamba2": [  # vLLM: conv [conv_dim, k-1] with x, B, C; ssm [heads, head_dim, dstate]
        ((16, 3), torch.float16, 0, (8, 4, 4)),
        ((4, 2, 4), torch.float32, 0, ()),
        ((3,), torch.int32, None, ()),
    ],
}


def _spec(tensors: list[Tensor], tp_size: int, block_size: int = 16) -> StateSpec:
    """One rank's spec of the whole-model ``tensors`` at TP ``tp_size``."""
    shapes, sharding = [], []
    for shape, _, dim, sections in tensors:
        local = list(shape)
        if dim is not None:
            local[dim] //= tp_size
        shapes.append(tuple(local))
        sharding.append(StateSharding(dim=dim, sections=tuple(s // tp_size for s in sections)))
    return StateSpec(
        block_size=block_size,
        shapes=tuple(shapes),
        dtypes=tuple(t[1] for t in tensors),
        sharding=tuple(sharding),
    )


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return (
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)
    )


def _page(spec: StateSpec, tensors: list[torch.Tensor]) -> np.ndarray:
    page = np.zeros(spec.state_bytes, dtype=np.uint8)
    for t, offset in zip(tensors, spec.state_offsets, strict=True):
        raw = _raw(t).numpy()
        page[offset : offset + raw.size] = raw
    return page


@pytest.mark.parametrize("name", sorted(SHARDINGS))
@pytest.mark.parametrize(("local_tp", "remote_tp"), TP_PAIRS)
def test_pieces_give_every_decode_rank_exactly_its_shard(name, local_tp, remote_tp):
    tensors = SHARDINGS[name]
    gen = torch.Generator().manual_seed(local_tp * 10 + remote_tp)
    full = [_random(shape, dtype, gen) for shape, dtype, _, _ in tensors]
    whole = [StateSharding(dim=d, sections=s) for _, _, d, s in tensors]
    lspec, rspec = _spec(tensors, local_tp), _spec(tensors, remote_tp)
    remote_pages = [
        _page(rspec, [shard(f, h, p, remote_tp) for f, h in zip(full, whole, strict=True)])
        for p in range(remote_tp)
    ]
    sharded = any(h.dim is not None for h in whole)
    for r in range(local_tp):
        page = np.zeros(lspec.state_bytes, dtype=np.uint8)
        written = np.zeros(lspec.state_bytes, dtype=np.int64)
        replica = replica_source(r, local_tp, remote_tp, 4)
        sources = set(shard_sources(r, local_tp, remote_tp)) if sharded else set()
        for p in sorted(sources | {replica}):
            for piece in state_pieces(lspec, rspec, r, p, read_replicated=p == replica):
                lo, ro, n = piece.local_offset, piece.remote_offset, piece.length
                page[lo : lo + n] = remote_pages[p][ro : ro + n]
                written[lo : lo + n] += 1
        want = _page(lspec, [shard(f, h, r, local_tp) for f, h in zip(full, whole, strict=True)])
        assert np.array_equal(page, want), (name, r)
        used = np.zeros(lspec.state_bytes, dtype=bool)
        for offset, nbytes in zip(lspec.state_offsets, lspec.state_nbytes, strict=True):
            used[offset : offset + nbytes] = True
        assert (written[used] == 1).all() and (written[~used] == 0).all(), (name, r)


def test_shard_sources_are_the_prefill_ranks_whose_fraction_overlaps():
    assert shard_sources(0, 1, 2) == (0, 1)
    assert shard_sources(1, 2, 1) == (0,)
    assert shard_sources(1, 2, 4) == (2, 3)
    assert [shard_sources(r, 4, 2) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert shard_sources(1, 2, 3) == (1, 2)  # sizes that do not nest still overlap right


def test_a_dim_0_slice_is_one_run_and_an_inner_slice_one_run_per_row():
    """ssm [4 heads, 2, 4] fp32 on dim 0, decode TP 1 <- prefill rank 1 of 2: heads 2..3
    are one 64 B run; conv [3, 16] fp16 on dim 1 with sections (8, 4, 4): per row and
    section one run, 3 x 3 pieces."""
    ssm = [((4, 2, 4), torch.float32, 0, ())]
    (piece,) = state_pieces(_spec(ssm, 1), _spec(ssm, 2), 0, 1, read_replicated=False)
    assert (piece.local_offset, piece.remote_offset, piece.length) == (64, 0, 64)
    conv = [((3, 16), torch.float16, 1, (8, 4, 4))]
    pieces = state_pieces(_spec(conv, 1), _spec(conv, 2), 0, 1, read_replicated=False)
    assert [(p.local_offset, p.remote_offset, p.length) for p in pieces[:3]] == [
        (8, 0, 8),  # x channels 4..7 of row 0
        (20, 8, 4),  # B channels 2..3
        (28, 12, 4),  # C channels 2..3
    ]
    assert len(pieces) == 9 and pieces[3].local_offset == 32 + 8  # row 1


def test_replicated_tensors_are_read_once_from_the_first_head_source():
    rep = [((5,), torch.float16, None, ())]
    spec = _spec(rep, 1)
    assert state_pieces(spec, spec, 0, 0, read_replicated=False) == ()
    (piece,) = state_pieces(spec, spec, 0, 1, read_replicated=True)
    assert (piece.local_offset, piece.remote_offset, piece.length) == (0, 0, 10)
    # decode TP 4 <- prefill TP 2 with 4 KV heads: decode ranks 0, 1 read prefill rank 0
    assert [replica_source(r, 4, 2, 4) for r in range(4)] == [0, 0, 1, 1]
    # MLA-like replication on prefill (1 KV head): decode ranks spread over the replicas
    assert [replica_source(r, 2, 4, 1) for r in range(2)] == [0, 1]


# -- negotiated plans, executed byte for byte ------------------------------------------

FORMATS = {
    "cross->per-layer": (cache_format("HND", False), cache_format("NHD", True)),
    "per-layer->cross": (cache_format("NHD", True), cache_format("HND", False)),
    "kv-split": (cache_format("NHD", False, packing="kv_split"), cache_format("NHD", False)),
}


@pytest.mark.parametrize("fmts", sorted(FORMATS))
@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "heads"),
    # 4 KV heads; then KV heads replicated over decode ranks (GQA 2 heads, one head as MLA)
    [(*p, 4) for p in TP_PAIRS] + [(4, 2, 2), (4, 1, 2), (2, 1, 1), (4, 1, 1)],
)
@pytest.mark.parametrize(("b_local", "b_remote"), [(16, 16), (32, 16)])
def test_plans_rebuild_each_decode_ranks_shard_of_the_whole_state(
    fmts, local_tp, remote_tp, heads, b_local, b_remote
):
    """Every decode rank negotiates with the prefill ranks it reads heads from, executes
    the state group's plan into one block, and holds exactly its shard of the whole state
    rebuilt from every prefill rank's block."""
    f_local, f_remote = FORMATS[fmts]
    remotes = [
        make_side("p", b_remote, f_remote, "FT", 8, rank=p, tp_size=remote_tp, total_kv_heads=heads)
        for p in range(remote_tp)
    ]
    rb, lb = 5, 3
    layers = remotes[0].buffers.config.groups[1].layer_names
    rhow = remotes[0].layout.config.groups[1].spec.sharding
    whole_how = sharded_state(16, 1).sharding
    assert rhow is not None and whole_how is not None
    for d in range(local_tp):
        local = make_side(
            "d", b_local, f_local, "FT", 8, rank=d, tp_size=local_tp, total_kv_heads=heads
        )
        moved = 0
        for s in tp.sources(d, local_tp, remote_tp, heads):
            plan = negotiate(local.layout, remotes[s.remote_rank].layout)
            g = plan.groups[1]
            assert g.sender is None and g.receiver is None
            chunks = np.array([0])
            moved += execute(
                plan, local, remotes[s.remote_rank], 1, chunks, np.array([lb]), np.array([rb])
            )
        assert moved > 0
        for layer in layers:
            got = local.buffers.state_views(layer)
            for i, (how, wh) in enumerate(zip(rhow, whole_how, strict=True)):
                shards = [side.buffers.state_views(layer)[i][rb] for side in remotes]
                first = tp.sources(d, local_tp, remote_tp, heads)[0].remote_rank
                full = unshard(shards, how, first)
                want = shard(full, wh, d, local_tp)
                assert torch.equal(_raw(got[i][lb]), _raw(want)), (d, layer, i)


def test_a_decode_rank_reads_sharded_state_with_one_descriptor_per_run_and_layer():
    """Decode TP 1 <- prefill rank 1 of 2, per-layer both sides: per layer, conv 3 rows x
    (x, B, C) = 9 runs, ssm + replicated tensor none (replicas come from rank 0, ssm
    heads 2..3 one run)."""
    fmt = cache_format("NHD", False)
    local = make_side("d", 16, fmt, "FT", 8, rank=0, tp_size=1, total_kv_heads=4)
    remote = make_side("p", 16, fmt, "FT", 8, rank=1, tp_size=2, total_kv_heads=4)
    g = negotiate(local.layout, remote.layout).groups[1]
    assert g.descriptors_per_chunk == 2 * (9 + 1)
    assert g.bytes_per_chunk == 2 * (3 * 8 * 2 + 2 * 2 * 4 * 4)


# -- refusals by name ----------------------------------------------------------------


def test_state_described_on_one_side_only_is_refused_across_tp_sizes():
    fmt = cache_format("NHD", True)
    local = make_side("d", 16, fmt, "FT", 8, rank=0, tp_size=2, total_kv_heads=4)
    remote = make_side("p", 16, fmt, "FM", 8, rank=0, tp_size=1, total_kv_heads=4)
    with pytest.raises(IncompatiblePeerError) as err:
        negotiate(local.layout, remote.layout)
    assert err.value.differences == [("tp_size", 2, 1)]
    assert "StateSpec.sharding" in err.value.hint


def test_sharded_state_on_a_prefill_rank_read_for_no_heads_is_refused_by_name():
    """2 KV heads, prefill TP 4 (each head on two replicas): decode rank 0 of 1 reads head
    0 from prefill rank 0 and head 1 from rank 2, but its state shards lie on all four."""
    fmt = cache_format("NHD", True)
    local = make_side("d", 16, fmt, "FT", 8, rank=0, tp_size=1, total_kv_heads=2)
    remote = make_side("p", 16, fmt, "FT", 8, rank=0, tp_size=4, total_kv_heads=2)
    with pytest.raises(IncompatiblePeerError) as err:
        negotiate(local.layout, remote.layout)
    assert err.value.differences == [("tp_size", 1, 4)]
    assert "from prefill ranks [0, 1, 2, 3] but reads its KV heads only from [0, 2]" in (
        err.value.hint
    )
    assert "at most 2" in err.value.hint


def _pair(lt: list[Tensor], rt: list[Tensor], ltp: int, rtp: int) -> IncompatiblePeerError:
    with pytest.raises(IncompatiblePeerError) as err:
        check_state_specs(1, _spec(lt, ltp), _spec(rt, rtp), ltp, rtp, "p/rank0")
    return err.value


def test_sections_that_do_not_add_up_across_tp_sizes_are_refused_with_both_values():
    """Decode TP 4 holding 2 of 6 ssm heads per rank is 8 heads, not prefill's 6."""
    local = StateSpec(
        block_size=16,
        shapes=((2, 4),),
        dtypes=(torch.float32,),
        sharding=(StateSharding(dim=0),),
    )
    remote = StateSpec(
        block_size=16, shapes=((6, 4),), dtypes=(torch.float32,), sharding=(StateSharding(dim=0),)
    )
    with pytest.raises(IncompatiblePeerError) as err:
        check_state_specs(1, local, remote, 4, 1, "p/rank0")
    assert err.value.differences == [("groups[1].state[0].sections", (2,), (6,)), ("tp_size", 4, 1)]
    assert "[8] (local, x TP 4) and [6] (remote, x TP 1)" in err.value.hint
    assert "do not shard evenly" in err.value.hint


def test_different_sharded_dimensions_and_dtypes_are_refused_by_name():
    a = [((8, 4), torch.float32, 0, ())]
    b = [((8, 4), torch.float32, 1, ())]
    err = _pair(a, b, 1, 2)
    assert err.differences == [("groups[1].state[0].sharding", "dim 0", "dim 1")]
    c = [((8, 4), torch.float16, 0, ())]
    assert _pair(a, c, 1, 2).differences == [("groups[1].state_dtypes", ["float32"], ["float16"])]
    d = [((8, 5), torch.float32, 0, ())]
    assert _pair(a, d, 1, 2).differences == [("groups[1].state[0].shape", (8, 4), (4, 5))]


@pytest.mark.parametrize(
    ("shapes", "sharding", "match"),
    [
        (((4, 2),), (StateSharding(dim=0), StateSharding(dim=1)), "describes 2 state tensors"),
        (((4, 2),), (StateSharding(dim=2),), r"dim=2, not a dimension of its shape \(4, 2\)"),
        (((4, 2),), (StateSharding(dim=0, sections=(2, 1)),), r"add up to 3, but its dim 0"),
        (((4, 2),), (StateSharding(dim=None, sections=(4,)),), "replicated .* has sections"),
        (((4, 2),), (StateSharding(dim=0, sections=(4, 0)),), "must be positive integers"),
    ],
)
def test_a_state_sharding_that_does_not_fit_its_shapes_is_a_layout_error(shapes, sharding, match):
    with pytest.raises(LayoutError, match=match):
        StateSpec(block_size=16, shapes=shapes, dtypes=(torch.float32,), sharding=sharding)


# -- the description travels in the handshake and the compatibility hash -----------------


def test_the_sharding_travels_on_the_wire():
    spec = sharded_state(16, 2)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(spec_to_wire(spec)), type=WireSpec)
    assert spec_from_wire(wire).sharding == spec.sharding
    assert spec_from_wire(wire).shapes == spec.shapes
    legacy = StateSpec(block_size=16, shapes=((3, 4),), dtypes=(torch.float32,))
    assert spec_to_wire(legacy).state_sharding == []
    assert spec_from_wire(spec_to_wire(legacy)).sharding is None


def _description(kinds: str, rank: int, tp_size: int) -> WorkerDescription:
    heads = tp.rank_heads(rank, tp_size, 4).count
    config = KVCacheConfig.uniform(make_groups(16, kinds, heads, tp_size), 4)
    buffers = KVCacheBuffers(config, cache_format("NHD", False))
    identity = WorkerIdentity(
        engine_id=f"e{tp_size}",
        agent_name=f"e{tp_size}-{rank}",
        model_name="m",
        dtype="float16",
        num_layers=config.num_layers,
        num_kv_heads=4,
        head_size=4,
        rank=rank,
        tp_size=tp_size,
    )
    return describe(identity, buffers, nixl_metadata=b"", compat_hash=compat_hash(identity, config))


def test_a_described_state_hashes_as_the_whole_model_at_every_tp_size():
    one, two, four = _description("FT", 0, 1), _description("FT", 1, 2), _description("FT", 3, 4)
    assert one.compat_hash == two.compat_hash == four.compat_hash
    check_compatible(two, one)
    check_compatible(one, four)
    assert _description("FM", 0, 1).compat_hash != one.compat_hash


def test_described_and_undescribed_state_at_equal_tp_sizes_differ_by_name():
    with pytest.raises(IncompatiblePeerError) as err:
        check_compatible(_description("FT", 0, 2), _description("FM", 0, 2))
    ((field, ours, theirs),) = err.value.differences
    assert field == "groups[1].spec.state"
    assert ours != theirs


def test_different_whole_states_across_tp_sizes_are_refused_by_the_check():
    """Prefill TP 2 describing the same per-rank shapes as decode TP 1: half the state."""
    local = _description("FT", 0, 1)
    remote = _description("FT", 0, 2)
    spec = remote.groups[1].spec
    bad = msgspec.structs.replace(
        remote,
        groups=[
            remote.groups[0],
            msgspec.structs.replace(
                remote.groups[1],
                spec=msgspec.structs.replace(
                    spec,
                    state_shapes=local.groups[1].spec.state_shapes,
                    state_sharding=local.groups[1].spec.state_sharding,
                ),
            ),
        ],
    )
    with pytest.raises(IncompatiblePeerError) as err:
        check_compatible(local, bad)
    assert [d[0] for d in err.value.differences] == ["groups[1].spec.state"]
