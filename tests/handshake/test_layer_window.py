"""Pipeline stages: a plan moves exactly the layers both ranks hold.

The model of ``plan_harness`` has two layers, each with one layer of every group. A side
holding both is an engine without pipeline parallelism; one holding layer 0 or layer 1 is
stage 0 or 1 of an engine at PP 2. Every case runs the plan with memmove and checks, byte
for byte, that the shared layers arrive and the local layers the peer does not hold stay
as they were.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.handshake.compat import check_compatible
from kvbridge.handshake.description import describe
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.plan import negotiate
from kvbridge.layouts.allocation import read_group_token_major
from kvbridge.layouts.transforms import rewrite_group
from tests.handshake.plan_harness import Side, cache_format, execute, make_side

TOKENS = 70  # a partial last block on every block size below

# (layers of each prefill stage, layers of the decode stage)
STAGES = [
    (((0,), (1,)), (0, 1)),  # prefill PP 2, decode PP 1
    (((0, 1),), (0,)),  # prefill PP 1, decode PP 2: stage 0
    (((0, 1),), (1,)),  # and stage 1
    (((0,), (1,)), (1,)),  # both PP 2: stage 1 reads stage 1 only
]
# (block size, cache format) per side: per-layer caches (cross-layer ones are read whole)
FORMATS = [
    ((16, cache_format("NHD", False)), (16, cache_format("NHD", False))),
    ((32, cache_format("NHD", False)), (16, cache_format("HND", False, kernel=16))),
    ((16, cache_format("HND", False, packing="kv_split")), (48, cache_format("NHD", False))),
    ((16, cache_format("NHD", True)), (32, cache_format("HND", False))),  # whole stages
]


def _load(prefills: list[Side], local: Side, seed: int = 0) -> None:
    """Load a prompt into ``local`` from every prefill stage holding one of its layers,
    then land it once (the receiver rewrite acts on whole local blocks, as
    ``decode.landing`` runs it after every source's READs ended); every local layer must
    equal the prefill stage's that holds it."""
    rng = np.random.default_rng(seed)
    bl = local.buffers.config.groups[0].spec.block_size
    lids = rng.permutation(local.buffers.config.num_blocks)[: -(-TOKENS // bl)]
    mine = [g.layer_names for g in local.buffers.config.groups]
    want: dict[tuple[int, str], torch.Tensor] = {}
    receivers: dict[int, set] = {}
    for remote in prefills:
        theirs = [g.layer_names for g in remote.buffers.config.groups]
        if not set(local.buffers.config.layer_names) & set(remote.buffers.config.layer_names):
            continue  # the router never reads a stage whose layers do not overlap
        plan = negotiate(local.layout, remote.layout, min_native_piece_bytes=1)
        br = remote.buffers.config.groups[0].spec.block_size
        rids = rng.permutation(remote.buffers.config.num_blocks)[: -(-TOKENS // br)]
        for g in plan.groups:
            sent = read_group_token_major(remote.buffers, g.group_id, rids)  # before rewrites
            for j, name in enumerate(theirs[g.group_id]):
                want[(g.group_id, name)] = sent[j, :, :TOKENS]
            chunks = g.chunks_for_tokens(0, TOKENS)
            execute(plan, local, remote, g.group_id, chunks, lids, rids, receiver_rewrite=False)
            if g.streams:  # as landing: the sources that moved the group say how it lands
                receivers.setdefault(g.group_id, set()).add(g.receiver)
    for gid, rewrites in receivers.items():
        assert len(rewrites) == 1, f"stages land group {gid} differently: {rewrites}"
        (rewrite,) = rewrites
        if rewrite:
            rewrite_group(local.buffers, gid, lids, rewrite.src, rewrite.dst)
    for gid, names in enumerate(mine):
        got = read_group_token_major(local.buffers, gid, lids)
        for i, name in enumerate(names):
            assert torch.equal(got[i, :, :TOKENS], want[(gid, name)]), (gid, name)


def _sides(stages, formats, kinds: str = "FS") -> tuple[list[Side], Side]:
    (b_remote, f_remote), (b_local, f_local) = formats
    prefills = [make_side("P", b_remote, f_remote, kinds, 12, layers=s) for s in stages[0]]
    return prefills, make_side("D", b_local, f_local, kinds, 12, layers=stages[1])


@pytest.mark.parametrize("formats", FORMATS, ids=["same", "blocks-hnd", "kvsplit-48", "cross"])
@pytest.mark.parametrize("stages", STAGES, ids=["pp2-pp1", "pp1-pp2s0", "pp1-pp2s1", "pp2-pp2"])
def test_a_decode_stage_loads_every_layer_from_the_stages_that_hold_it(stages, formats):
    prefills, local = _sides(stages, formats)
    if formats[0][1].cross_layer and len(stages[0][0]) > len(stages[1]):
        pytest.skip("a cut cross-layer prefill: refused (test below)")
    _load(prefills, local)


# a hybrid model of 4 layers alternating its kinds: full attention in layers 1 and 3,
# sliding window in 0 and 2 (as vLLM groups a Gemma-like model)
ALTERNATING = ((1, 3), (0, 2))


def _stage(name: str, layers, fmt, pp) -> Side:
    return make_side(name, fmt[0], fmt[1], "FS", 12, layers=layers, group_layers=ALTERNATING, pp=pp)


@pytest.mark.parametrize("formats", FORMATS[:3], ids=["same", "blocks-hnd", "kvsplit-48"])
def test_stages_that_share_no_layer_of_one_group_move_the_others(formats):
    """Prefill split 2|2, decode 1|3: decode's stage 1 (layers 1-3) shares layer 1 (full
    attention) with prefill's stage 0 but no sliding-window layer; that pair's plan moves
    the full-attention layer and nothing of the window group, which stage 1 brings."""
    prefills = [_stage("P", (0, 1), formats[0], (0, 2)), _stage("P", (2, 3), formats[0], (1, 2))]
    local = _stage("D", (1, 2, 3), formats[1], (1, 2))
    plan = negotiate(local.layout, prefills[0].layout, min_native_piece_bytes=1)
    full, window = plan.groups
    assert full.streams and full.layers == ("g0.b",)
    assert not window.streams and window.receiver is None
    _load(prefills, local)


def test_state_groups_move_per_stage_too():
    fmt = cache_format("NHD", False)
    (_, remote), local = _sides((((0,), (1,)), (0, 1)), ((16, fmt), (16, fmt)), kinds="FM")
    plan = negotiate(local.layout, remote.layout)
    (state,) = [g for g in plan.groups if g.group_id == 1]
    # one stream: layer g1.b, the only one both hold
    assert [local.layout.regions[s.local_region].layer_index for s in state.streams] == [1]


def test_a_cross_layer_cache_cut_by_the_window_is_refused_by_name():
    cross, per_layer = cache_format("NHD", True), cache_format("NHD", False)
    (remote,), local = _sides((((0, 1),), (0,)), ((16, cross), (16, per_layer)), kinds="F")
    with pytest.raises(IncompatiblePeerError, match=r"cross-layer") as info:
        negotiate(local.layout, remote.layout)
    assert "groups[0].layers (remote cross-layer)" in str(info.value)
    (_, remote), local = _sides((((0,), (1,)), (0, 1)), ((16, per_layer), (16, cross)), "F")
    with pytest.raises(IncompatiblePeerError, match=r"local cross-layer"):
        negotiate(local.layout, remote.layout)


def test_stages_without_a_shared_layer_are_refused_by_name():
    fmt = cache_format("NHD", False)
    (remote, _), local = _sides((((0,), (1,)), (1,)), ((16, fmt), (16, fmt)), kinds="F")
    with pytest.raises(IncompatiblePeerError, match=r"hold no layer in common"):
        negotiate(local.layout, remote.layout)


def _description(side: Side):
    from kvbridge.handshake.compat import compat_hash
    from kvbridge.handshake.description import WorkerIdentity

    ident = side.layout.identity
    identity = WorkerIdentity(**{k: getattr(ident, k) for k in WorkerIdentity.__dataclass_fields__})
    return describe(
        identity,
        side.buffers,
        nixl_metadata=b"",
        compat_hash=compat_hash(identity, side.buffers.config),
    )


def test_stages_pass_the_compatibility_check_that_still_refuses_other_layers():
    fmt = cache_format("NHD", False)
    (_, remote), local = _sides((((0,), (1,)), (0, 1)), ((16, fmt), (16, fmt)), kinds="F")
    check_compatible(_description(local), _description(remote))  # stage 1 of the same model
    # without pipeline stages, different layers are another model
    whole = make_side("P", 16, fmt, "FS", 12)
    other = make_side("D", 16, fmt, "F", 12)
    with pytest.raises(IncompatiblePeerError, match=r"num_groups"):
        check_compatible(_description(other), _description(whole))
    # a stage rank outside its engine's stages
    bad = _description(remote)
    import msgspec

    bad = msgspec.structs.replace(bad, pp_rank=2)
    with pytest.raises(IncompatiblePeerError, match=r"pp_rank"):
        check_compatible(_description(local), bad)
