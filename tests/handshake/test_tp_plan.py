"""Plans across tensor-parallel sizes, executed with memmove: every decode rank ends up
with exactly its KV heads, byte for byte, from the prefill rank(s) holding them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvbridge.handshake import tp
from kvbridge.handshake.compat import check_compatible
from kvbridge.handshake.description import WorkerIdentity, describe
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.handshake.plan import negotiate
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers, read_group_token_major
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import FullAttentionSpec, StateSharding, StateSpec
from kvbridge.layouts.transforms import rewrite_group
from tests.handshake.plan_harness import execute, make_side

TOKENS = 64


def _fmt(layout: str, cross: bool, kb: int = 0, split: bool = False) -> CacheFormat:
    return CacheFormat(
        layout=KVLayout(layout),
        cross_layer=cross,
        kernel_block_size=kb,
        packing=KVPacking.KV_SPLIT if split else KVPacking.BLOCKS_FIRST,
    )


def _transfer(
    local_tp: int,
    remote_tp: int,
    heads: int,
    *,
    b_local: int = 16,
    b_remote: int = 16,
    f_local: CacheFormat | None = None,
    f_remote: CacheFormat | None = None,
    kinds: str = "F",
    remote_rewrites: bool = True,
    min_native_piece_bytes: int | None = None,
) -> list[int]:
    """Run every decode rank's plans; assert its heads equal the prefill heads (and, for
    a prefill that may not rewrite, its blocks untouched); returns descriptors per decode
    rank."""
    f_local = f_local or _fmt("HND", False)
    f_remote = f_remote or _fmt("NHD", True)
    tokens = math.lcm(TOKENS, b_local, b_remote)  # whole blocks on both sides
    n_r, n_l = tokens // b_remote, tokens // b_local
    nb = max(8, n_r + 1, n_l + 1)
    remotes = [
        make_side(
            "p",
            b_remote,
            f_remote,
            kinds,
            nb,
            rank=r,
            tp_size=remote_tp,
            total_kv_heads=heads,
            rewrites_in_place=remote_rewrites,
        )
        for r in range(remote_tp)
    ]
    untouched = [[t.clone() for t in side.buffers.tensors] for side in remotes]
    rids = np.arange(n_r)[::-1] + 1  # remote blocks out of order
    lids = (np.arange(n_l) * 3 + 1) % nb  # distinct, out of order
    want = {
        (r, g): read_group_token_major(side.buffers, g, rids).clone()
        for r, side in enumerate(remotes)
        for g in range(len(kinds))
    }
    moved = []
    for d in range(local_tp):
        local = make_side(
            "d", b_local, f_local, kinds, nb, rank=d, tp_size=local_tp, total_kv_heads=heads
        )
        total = 0
        slices = tp.sources(d, local_tp, remote_tp, heads)
        for s in slices:
            src = remotes[s.remote_rank]
            plan = negotiate(
                local.layout, src.layout, min_native_piece_bytes=min_native_piece_bytes
            )
            for g in range(len(kinds)):
                gp = plan.groups[g]
                if not remote_rewrites:
                    assert gp.sender is None
                assert gp.head_slice == (
                    ()
                    if len(slices) == 1
                    and s.num_heads == tp.rank_heads(d, local_tp, heads).count
                    and s.num_heads == tp.rank_heads(s.remote_rank, remote_tp, heads).count
                    else (s.local_head, s.remote_head, s.num_heads)
                )
                chunks = gp.chunks_for_tokens(0, tokens)
                total += execute(plan, local, src, g, chunks, lids, rids, receiver_rewrite=False)
                if gp.sender:  # prefill restores its blocks (Done)
                    rewrite_group(src.buffers, g, rids, gp.sender.dst, gp.sender.src)
        for g in range(len(kinds)):
            gp = plan.groups[g]
            if gp.receiver:
                rewrite_group(local.buffers, g, lids, gp.receiver.src, gp.receiver.dst)
            got = read_group_token_major(local.buffers, g, lids)
            for s in slices:
                ref = want[(s.remote_rank, g)]
                a = got[..., s.local_head : s.local_head + s.num_heads, :]
                b = ref[..., s.remote_head : s.remote_head + s.num_heads, :]
                assert torch.equal(a, b), (d, s, g)
        moved.append(total)
    if not remote_rewrites:
        for side, before in zip(remotes, untouched, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(side.buffers.tensors, before, strict=True))
    return moved


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "heads"),
    [
        (2, 1, 4),
        (1, 2, 4),
        (2, 2, 4),
        (4, 1, 4),
        (1, 4, 4),
        (4, 2, 4),
        (2, 4, 4),
        (4, 2, 2),
        (1, 4, 2),
        (4, 1, 2),
    ],
)
def test_every_decode_rank_gets_its_heads(local_tp, remote_tp, heads):
    _transfer(local_tp, remote_tp, heads)


@pytest.mark.parametrize(
    ("b_local", "b_remote", "f_local", "f_remote"),
    [
        (16, 64, _fmt("HND", False, kb=8), _fmt("NHD", True)),
        (64, 16, _fmt("NHD", True), _fmt("HND", False)),
        (32, 16, _fmt("NHD", False, split=True), _fmt("NHD", True)),
        (16, 32, _fmt("HND", True, kb=8), _fmt("NHD", False, split=True)),
        (16, 16, _fmt("NHD", True), _fmt("HND", True)),
        (32, 48, _fmt("HND", False), _fmt("NHD", True)),  # not multiples: 16-token chunks
        (48, 32, _fmt("NHD", True), _fmt("HND", False, kb=16)),
    ],
)
@pytest.mark.parametrize(("local_tp", "remote_tp"), [(2, 1), (1, 2)])
def test_block_size_layout_and_granularity_differences_combine_with_tp(
    local_tp, remote_tp, b_local, b_remote, f_local, f_remote
):
    _transfer(
        local_tp,
        remote_tp,
        4,
        b_local=b_local,
        b_remote=b_remote,
        f_local=f_local,
        f_remote=f_remote,
        kinds="FS",
    )


def test_head_major_cross_layer_moves_one_descriptor_per_chunk_and_source():
    """Both sides cross-layer, equal blocks: a decode rank's head slice of a block is one
    descriptor (all layers, K and V); per-layer peers need one per layer."""
    cross = _fmt("NHD", True)
    assert _transfer(2, 1, 4, f_local=cross, f_remote=cross) == [TOKENS // 16] * 2
    assert _transfer(1, 2, 4, f_local=cross, f_remote=cross) == [2 * TOKENS // 16]
    per_layer = _fmt("HND", False)
    assert _transfer(2, 1, 4, f_local=per_layer, f_remote=cross) == [2 * TOKENS // 16] * 2


def test_equal_heads_on_both_ranks_use_the_plain_plan():
    """GQA replication: 2 KV heads at TP 4 vs TP 2, every rank holds one head."""
    remote = make_side("p", 16, _fmt("NHD", True), "F", 8, rank=3, tp_size=4, total_kv_heads=2)
    local = make_side("d", 16, _fmt("NHD", True), "F", 8, rank=1, tp_size=2, total_kv_heads=2)
    plan = negotiate(local.layout, remote.layout)
    assert plan.groups[0].head_slice == () and plan.groups[0].sender is None


def test_a_prefill_rank_holding_none_of_the_heads_is_refused_by_name():
    remote = make_side("p", 16, _fmt("NHD", True), "F", 8, rank=1, tp_size=2, total_kv_heads=4)
    local = make_side("d", 16, _fmt("NHD", True), "F", 8, rank=0, tp_size=4, total_kv_heads=4)
    with pytest.raises(
        IncompatiblePeerError, match=r"prefill rank 1 of 2 holds none of the KV heads"
    ):
        negotiate(local.layout, remote.layout)


@pytest.mark.parametrize(
    ("kinds", "heads", "local", "remote"),
    [
        ("FM", 4, (0, 2), (0, 1)),  # decode reads half of the prefill rank's heads
        ("FM", 4, (0, 1), (1, 2)),  # decode reads two prefill ranks
        ("SFM", 2, (1, 2), (3, 4)),  # GQA replication: each rank one whole head (no slice)
        ("LM", 1, (1, 2), (0, 1)),  # MLA: the latent alone would move with the plain plan
    ],
)
def test_state_groups_across_tp_sizes_are_refused_when_the_sharding_is_not_described(
    kinds, heads, local, remote
):
    """A rank holds only its shard of a state; without a description of how it is split
    ('M') no byte range of one rank's state is known to be another's. Before this check
    the two rows without a head slice planned a plain copy of one prefill rank's state
    into a decode rank of another TP size."""
    fmt = _fmt("NHD", True)
    (lr, ltp), (rr, rtp) = local, remote
    lside = make_side("d", 16, fmt, kinds, 8, rank=lr, tp_size=ltp, total_kv_heads=heads)
    rside = make_side("p", 16, fmt, kinds, 8, rank=rr, tp_size=rtp, total_kv_heads=heads)
    with pytest.raises(IncompatiblePeerError) as err:
        negotiate(lside.layout, rside.layout)
    state = kinds.index("M")
    assert err.value.differences == [("tp_size", ltp, rtp)]
    assert f"groups [{state}] hold recurrent (Mamba-like) state" in err.value.hint
    assert f"same TP size (both {ltp} or both {rtp})" in err.value.hint
    assert "StateSpec.sharding" in err.value.hint


@pytest.mark.parametrize(
    ("kinds", "heads", "local", "remote", "pieces"),
    [
        # decode rank 0 of 2 <- prefill TP 1: x, B, C halves of 3 conv rows, ssm heads 0..1
        # and the replicated tensor (apart on prefill's side): 9 + 2 runs per layer
        ("FT", 4, (0, 2), (0, 1), 22),
        # decode TP 1 <- prefill rank 1 of 2: 9 conv runs + ssm heads 2..3 (no replica)
        ("FT", 4, (0, 1), (1, 2), 20),
        # MLA: decode rank 1 of 2 reads its latent and its state shard from prefill rank 0;
        # ssm heads 2..3 and the replica are contiguous on both sides: 9 + 1 runs
        ("LT", 1, (1, 2), (0, 1), 20),
    ],
)
def test_state_groups_across_tp_sizes_move_their_shard_when_the_sharding_is_described(
    kinds, heads, local, remote, pieces
):
    """The same rows with the sharding described ('T', Mamba2-like): planned, one
    descriptor per contiguous run of the decode rank's shard (executed byte for byte
    against the whole state in ``test_tp_state.py``)."""
    fmt = _fmt("NHD", True)
    (lr, ltp), (rr, rtp) = local, remote
    lside = make_side("d", 16, fmt, kinds, 8, rank=lr, tp_size=ltp, total_kv_heads=heads)
    rside = make_side("p", 16, fmt, kinds, 8, rank=rr, tp_size=rtp, total_kv_heads=heads)
    g = negotiate(lside.layout, rside.layout).groups[kinds.index("T")]
    assert g.descriptors_per_chunk == pieces
    assert (g.sender, g.receiver, g.head_slice) == (None, None, ())


def test_described_state_with_prefill_head_replicas_is_refused_by_name():
    """GQA replication on prefill (2 KV heads, TP 4): decode rank 1 of 2 reads its head
    from prefill rank 3 alone, but its state shard lies on ranks 2 and 3."""
    fmt = _fmt("NHD", True)
    lside = make_side("d", 16, fmt, "SFT", 8, rank=1, tp_size=2, total_kv_heads=2)
    rside = make_side("p", 16, fmt, "SFT", 8, rank=3, tp_size=4, total_kv_heads=2)
    with pytest.raises(IncompatiblePeerError) as err:
        negotiate(lside.layout, rside.layout)
    assert err.value.differences == [("tp_size", 2, 4)]
    assert "from prefill ranks [2, 3] but reads its KV heads only from [3]" in err.value.hint


def _state_description(rank: int, tp_size: int, described: bool = False) -> WorkerDescription:
    """A rank of a model whose state is sharded as a Mamba layer's is: conv [3, 16 / tp],
    ssm [16 / tp, 4] (so the state shapes differ between TP sizes); ``described``: the
    spec says so (conv on dim 1, ssm on dim 0)."""
    from kvbridge.handshake.compat import compat_hash

    sharding = (StateSharding(dim=1), StateSharding(dim=0)) if described else None
    groups = [
        KVCacheGroup(
            group_id=0,
            layer_names=("a",),
            spec=FullAttentionSpec(
                block_size=16, num_kv_heads=4 // tp_size, head_size=4, dtype=torch.float16
            ),
        ),
        KVCacheGroup(
            group_id=1,
            layer_names=("m",),
            spec=StateSpec(
                block_size=16,
                shapes=((3, 16 // tp_size), (16 // tp_size, 4)),
                dtypes=(torch.float16, torch.float32),
                sharding=sharding,
            ),
        ),
    ]
    buffers = KVCacheBuffers(KVCacheConfig.uniform(groups, 4), _fmt("NHD", False))
    identity = WorkerIdentity(
        engine_id=f"e{tp_size}",
        agent_name=f"e{tp_size}-{rank}",
        model_name="m",
        dtype="float16",
        num_layers=2,
        num_kv_heads=4,
        head_size=4,
        rank=rank,
        tp_size=tp_size,
    )
    digest = compat_hash(identity, buffers.config)
    return describe(identity, buffers, nixl_metadata=b"", compat_hash=digest)


def test_sharded_state_shapes_across_tp_sizes_are_refused_for_the_tp_sizes():
    """The handshake's compatibility check sees the per-rank state shapes differ and no
    sharding described; the error says why (the TP sizes) instead of calling it another
    model."""
    with pytest.raises(IncompatiblePeerError) as err:
        check_compatible(_state_description(0, 2), _state_description(0, 1))
    assert err.value.differences == [("tp_size", 2, 1)]
    assert "groups [1] hold recurrent" in err.value.hint
    assert err.value.peer == "e1/rank0"
    check_compatible(_state_description(1, 2), _state_description(1, 2))  # equal sizes pass


def test_sharded_state_shapes_across_tp_sizes_pass_when_the_sharding_is_described():
    """Described, the per-rank shapes are shards of one whole state: the same hash at
    both TP sizes, no difference named."""
    decode, prefill = _state_description(0, 2, True), _state_description(0, 1, True)
    assert decode.compat_hash == prefill.compat_hash
    check_compatible(decode, prefill)
    check_compatible(prefill, _state_description(1, 2, True))


def test_state_groups_move_rank_to_rank_at_equal_tp_sizes():
    """TP 2 on both sides: decode rank 1 copies prefill rank 1's state, one descriptor per
    layer and state block, byte for byte."""
    fmt = _fmt("NHD", False)
    local = make_side("d", 16, fmt, "FM", 8, rank=1, tp_size=2, total_kv_heads=4)
    remote = make_side("p", 16, fmt, "FM", 8, rank=1, tp_size=2, total_kv_heads=4)
    plan = negotiate(local.layout, remote.layout)
    g = plan.groups[1]
    ids = np.array([3])
    assert execute(plan, local, remote, 1, g.chunks_for_tokens(0, 16), ids, np.array([5])) == 2
    for layer in local.buffers.config.groups[1].layer_names:
        for a, b in zip(
            local.buffers.state_views(layer), remote.buffers.state_views(layer), strict=True
        ):
            assert torch.equal(_raw(a[3]), _raw(b[5]))  # bytes: random fp bits hold NaNs


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize(
    ("b_local", "b_remote", "f_local", "f_remote"),
    [
        (16, 16, _fmt("HND", False), _fmt("HND", False)),  # vLLM GPU, HND on both sides
        (16, 64, _fmt("HND", False), _fmt("HND", False)),
        (64, 16, _fmt("NHD", False), _fmt("HND", False, kb=8)),
        (32, 16, _fmt("HND", False, split=True), _fmt("HND", False, split=True)),
        (16, 16, _fmt("NHD", True), _fmt("HND", False, split=True)),
        (32, 48, _fmt("HND", False), _fmt("HND", False)),  # not multiples: 16-token chunks
        (16, 16, _fmt("HND", False), _fmt("NHD", False)),  # NHD: one piece per token
    ],
)
@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "heads"), [(2, 1, 4), (1, 2, 4), (4, 2, 4), (1, 4, 2), (4, 1, 2)]
)
def test_a_sender_that_may_not_rewrite_is_read_head_slice_by_head_slice(
    local_tp, remote_tp, heads, b_local, b_remote, f_local, f_remote
):
    """vLLM on a GPU: prefill's prefix cache may read its blocks, so they are read as
    they are; each decode rank still gets exactly its heads, prefill's bytes untouched."""
    _transfer(
        local_tp,
        remote_tp,
        heads,
        b_local=b_local,
        b_remote=b_remote,
        f_local=f_local,
        f_remote=f_remote,
        kinds="FS",
        remote_rewrites=False,
        min_native_piece_bytes=8,
    )


def test_native_head_slices_of_hnd_blocks_are_one_descriptor_per_layer_part_and_block():
    """HND per-layer blocks (vLLM's GPU layout for heterogeneous TP): a decode rank's head
    slice of a (layer, K|V) block part is one contiguous run."""
    hnd = _fmt("HND", False)
    blocks = TOKENS // 16
    per_rank = 2 * 2 * blocks  # 2 layers x K, V x blocks
    native = {"remote_rewrites": False, "min_native_piece_bytes": 64}
    assert _transfer(2, 1, 4, f_local=hnd, f_remote=hnd, **native) == [per_rank] * 2
    assert _transfer(1, 2, 4, f_local=hnd, f_remote=hnd, **native) == [2 * per_rank]


def test_native_head_slices_smaller_than_the_minimum_piece_are_refused_by_name():
    """An NHD sender that may not rewrite: one head of one token is 8 B here, fewer than
    the 512 B a descriptor must carry by default; the error names HND as the way out."""
    remote = make_side(
        "p",
        16,
        _fmt("NHD", False),
        "F",
        8,
        rank=0,
        tp_size=1,
        total_kv_heads=4,
        rewrites_in_place=False,
    )
    local = make_side("d", 16, _fmt("NHD", False), "F", 8, rank=0, tp_size=2, total_kv_heads=4)
    with pytest.raises(IncompatiblePeerError, match="8-byte pieces") as err:
        negotiate(local.layout, remote.layout)
    assert "does not rewrite blocks in place" in str(err.value)
    assert "VLLM_KV_CACHE_LAYOUT=HND" in str(err.value)


def test_plan_str_names_the_head_slice():
    remote = make_side("p", 16, _fmt("NHD", True), "F", 8, rank=0, tp_size=1, total_kv_heads=4)
    local = make_side("d", 16, _fmt("NHD", True), "F", 8, rank=1, tp_size=2, total_kv_heads=4)
    text = str(negotiate(local.layout, remote.layout))
    assert "[heads 0..1 <- remote heads 2..3]" in text


def _packed(heads_major: bool = True) -> CacheFormat:
    return CacheFormat(
        layout=KVLayout.HND, block_packing="vllm-cpu-attn:vec", packed_heads_major=heads_major
    )


@pytest.mark.parametrize(
    ("b_local", "b_remote", "repack", "split"), [(32, 32, 0, 0), (64, 32, 32, 0), (32, 64, 0, 64)]
)
def test_heads_major_packed_pages_move_a_head_slice_per_page(b_local, b_remote, repack, split):
    """vLLM CPU pages keep each head in one run: decode rank 1 of 2 reads the second half
    of every prefill page (one descriptor per page and layer), merged or staged as usual."""
    remote = make_side("p", b_remote, _packed(), "F", 8, rank=0, tp_size=1, total_kv_heads=4)
    local = make_side("d", b_local, _packed(), "F", 8, rank=1, tp_size=2, total_kv_heads=4)
    plan = negotiate(local.layout, remote.layout, can_repack=True)
    g = plan.groups[0]
    page = remote.layout.regions[g.streams[0].remote_region].region.block_bytes
    assert (g.repack_from, g.split_from, g.head_slice) == (repack, split, (0, 2, 2))
    assert g.descriptors_per_chunk == 2  # one per layer
    for s in g.streams:
        assert (s.remote_offsets, s.length) == ((page // 2,), page // 2)
    if split:
        assert g.staging_bytes == 2 * (page // 2)  # slots hold local-heads pages


def test_packed_pages_from_two_prefill_ranks_land_in_one_decode_page():
    """Decode TP 1 reads heads 0..1 from prefill rank 0 and 2..3 from rank 1."""
    local = make_side("d", 64, _packed(), "F", 8, rank=0, tp_size=1, total_kv_heads=4)
    for r in (0, 1):
        remote = make_side("p", 32, _packed(), "F", 8, rank=r, tp_size=2, total_kv_heads=4)
        g = negotiate(local.layout, remote.layout, can_repack=True).groups[0]
        page = remote.layout.regions[g.streams[0].remote_region].region.block_bytes
        assert g.head_slice == (2 * r, 0, 2)
        assert g.streams[0].local_offsets == (r * page,)  # heads 2r.. of the local sub-page
        assert g.local_offsets(g.streams[0]).tolist() == [r * page, 2 * page + r * page]


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "heads"),
    [(1, 2, 4), (1, 4, 4), (2, 4, 4), (1, 4, 2)],  # last: GQA replicas
)
def test_packed_pages_staged_from_several_prefill_ranks_carry_each_ranks_heads(
    local_tp, remote_tp, heads
):
    """Prefill pages larger than decode's blocks, decode's heads spread over several
    prefill ranks: each rank's plan stages its pages (its heads only, one descriptor per
    page and layer) and names where those heads go in decode's pages, so the engine's
    split writes just them; together the sources cover every decode head once."""
    local = make_side("d", 32, _packed(), "F", 8, rank=0, tp_size=local_tp, total_kv_heads=heads)
    read = tp.sources(0, local_tp, remote_tp, heads)
    assert len(read) > 1
    covered = []
    for s in read:
        remote = make_side(
            "p", 64, _packed(), "F", 8, rank=s.remote_rank, tp_size=remote_tp, total_kv_heads=heads
        )
        g = negotiate(local.layout, remote.layout, can_repack=True).groups[0]
        page = remote.layout.regions[g.streams[0].remote_region].region.block_bytes
        per_head = page // tp.rank_heads(s.remote_rank, remote_tp, heads).count
        assert (g.split_from, g.repack_from) == (64, 0)
        assert g.head_slice == (s.local_head, s.remote_head, s.num_heads)
        assert g.descriptors_per_chunk == 2  # one per layer
        for st in g.streams:
            assert st.remote_offsets == (s.remote_head * per_head,)
            assert st.length == st.local_chunk_bytes == s.num_heads * per_head
        assert g.staging_bytes == 2 * s.num_heads * per_head  # slots hold this rank's heads
        covered += range(s.local_head, s.local_head + s.num_heads)
    assert sorted(covered) == list(range(tp.rank_heads(0, local_tp, heads).count))


def test_packed_pages_without_head_runs_are_refused_across_tp_sizes():
    local = make_side("d", 32, _packed(False), "F", 8, rank=0, tp_size=2, total_kv_heads=4)
    remote = make_side("p", 32, _packed(False), "F", 8, rank=0, tp_size=1, total_kv_heads=4)
    with pytest.raises(IncompatiblePeerError, match="heads are not contiguous runs"):
        negotiate(local.layout, remote.layout, can_repack=True)


@pytest.mark.parametrize(("local_tp", "remote_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_mla_latent_is_read_once_per_decode_rank_from_one_prefill_rank(local_tp, remote_tp):
    """The latent cache is the same on every rank: each decode rank reads all of it from one
    prefill rank (spread over ranks), with the plain plan; the others are told to free."""
    fmt_l, fmt_r = _fmt("HND", False, kb=8), _fmt("NHD", True)
    for d in range(local_tp):
        (s,) = tp.sources(d, local_tp, remote_tp, 1)
        assert s.remote_rank == d % remote_tp and s.num_heads == 1
    _transfer(local_tp, remote_tp, 1, f_local=fmt_l, f_remote=fmt_r, kinds="L", b_remote=32)
    told = {r for d in range(local_tp) for r in tp.notified_by(d, local_tp, remote_tp, 1)}
    assert told == set(range(remote_tp))  # every prefill rank hears from some decode rank
