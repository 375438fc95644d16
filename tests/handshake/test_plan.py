"""Negotiation table: every plan, executed on synthetic caches, delivers the sender's KV."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.modes import TransferMode
from kvbridge.handshake.plan import negotiate
from kvbridge.handshake.plan_model import TransformSide
from kvbridge.layouts.allocation import CacheFormat, read_group_token_major
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.region import KVRegion, MemoryKind
from tests.handshake.plan_harness import cache_format, execute, make_side

NUM_TOKENS = 256
BLOCK_SIZES = (16, 32, 64, 128)


_fmt = cache_format


def _run(b_remote, f_remote, b_local, f_local, kinds="F", seed=0, *, in_place=True):
    rng = np.random.default_rng(seed)
    n_remote, n_local = NUM_TOKENS // b_remote, NUM_TOKENS // b_local
    remote = make_side(
        "prefill", b_remote, f_remote, kinds, num_blocks=n_remote + 5, rewrites_in_place=in_place
    )
    local = make_side("decode", b_local, f_local, kinds, num_blocks=n_local + 5)
    plan = negotiate(local.layout, remote.layout, min_native_piece_bytes=1)
    rids = rng.permutation(n_remote + 5)[:n_remote]
    lids = rng.permutation(n_local + 5)[:n_local]
    sender_bytes = [t.clone() for t in remote.buffers.tensors]
    for g in plan.groups:
        if g.kind.value == "state":
            continue
        want = read_group_token_major(remote.buffers, g.group_id, rids)
        chunks = g.chunks_for_tokens(0, NUM_TOKENS)
        moved = execute(plan, local, remote, g.group_id, chunks, lids, rids)
        got = read_group_token_major(local.buffers, g.group_id, lids)
        assert torch.equal(got, want), f"group {g.group_id} differs under\n{plan}"
        assert moved == chunks.size * g.descriptors_per_chunk
    if not in_place:  # the sender's blocks were read as they are, never rewritten
        assert plan.sender_rewrites() == {}
        for before, after in zip(sender_bytes, remote.buffers.tensors, strict=True):
            assert torch.equal(before, after)
    return plan


@pytest.mark.parametrize("b_remote,b_local", list(itertools.product(BLOCK_SIZES, BLOCK_SIZES)))
@pytest.mark.parametrize(
    "l_remote,l_local", [("NHD", "NHD"), ("NHD", "HND"), ("HND", "NHD"), ("HND", "HND")]
)
@pytest.mark.parametrize(
    "x_remote,x_local", [(True, True), (False, False), (True, False), (False, True)]
)
def test_block_size_layout_cross_layer_matrix(
    b_remote, b_local, l_remote, l_local, x_remote, x_local
):
    plan = _run(b_remote, _fmt(l_remote, x_remote), b_local, _fmt(l_local, x_local))
    g = plan.groups[0]
    assert g.wire_tokens == min(b_remote, b_local)
    if x_remote and x_local:
        assert g.descriptors_per_chunk == 1  # one contiguous descriptor per chunk
    if (b_remote, l_remote, x_remote) == (b_local, l_local, x_local):
        assert plan.transform_side is TransformSide.NONE


@pytest.mark.parametrize(
    "b_remote,k_remote,b_local,k_local",
    [
        (64, 16, 16, 16),
        (16, 16, 64, 16),
        (64, 32, 64, 16),
        (32, 8, 128, 32),
        (128, 64, 32, 32),
        (16, 8, 64, 32),
    ],
)
@pytest.mark.parametrize("layouts", [("NHD", "HND"), ("HND", "HND"), ("HND", "NHD")])
@pytest.mark.parametrize(
    "packings",
    [("blocks_first", "kv_split"), ("kv_split", "kv_split"), ("kv_split", "blocks_first")],
)
def test_kernel_block_sizes_and_packings(b_remote, k_remote, b_local, k_local, layouts, packings):
    _run(
        b_remote,
        _fmt(layouts[0], False, k_remote, packings[0]),
        b_local,
        _fmt(layouts[1], False, k_local, packings[1]),
    )


@pytest.mark.parametrize("x_remote,x_local", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("packing", ["kv_split", "blocks_first"])
def test_cross_layer_against_per_layer_kernel_blocks(x_remote, x_local, packing):
    _run(64, _fmt("HND", x_remote, 16, packing), 32, _fmt("NHD", x_local, 8, packing))


@pytest.mark.parametrize("b_remote,b_local", [(128, 32), (64, 16), (32, 32), (16, 64)])
@pytest.mark.parametrize("l_remote,l_local", [("HND", "HND"), ("NHD", "HND"), ("HND", "NHD")])
@pytest.mark.parametrize("x_remote,x_local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("kernel", [None, 16])
def test_sender_that_may_not_rewrite_is_read_natively(
    b_remote, b_local, l_remote, l_local, x_remote, x_local, kernel
):
    plan = _run(
        b_remote,
        _fmt(l_remote, x_remote, kernel),
        b_local,
        _fmt(l_local, x_local),
        kinds="FS",
        in_place=False,
    )
    assert all(g.sender is None for g in plan.groups)


def test_native_read_of_larger_hnd_blocks_costs_one_descriptor_per_head():
    # vLLM on CPU: per-layer HND blocks, prefill 128 tokens -> decode 32 tokens
    for in_place in (True, False):
        plan = _run(128, _fmt("HND", False), 32, _fmt("HND", False), in_place=in_place)
        g = plan.groups[0]
        assert g.native_read is not in_place
        assert (g.sender is None) is not in_place
        # two layers, K and V, two heads: the rewrite gives one piece per layer, reading
        # natively one per (layer, K/V, head)
        assert g.descriptors_per_chunk == (2 if in_place else 8)


def test_native_read_with_tiny_pieces_is_refused_by_name():
    remote = make_side("p", 64, _fmt("NHD", False), "F", 8, rewrites_in_place=False)
    local = make_side("d", 16, _fmt("HND", False), "F", 8)
    with pytest.raises(IncompatiblePeerError, match=r"(?s)8-byte pieces.*does not rewrite"):
        negotiate(local.layout, remote.layout)


@pytest.mark.parametrize("kinds", ["FS", "FSM", "MSF"])
@pytest.mark.parametrize("b_remote,b_local", [(16, 64), (64, 16), (32, 32)])
@pytest.mark.parametrize("cross", [True, False])
def test_hybrid_groups(kinds, b_remote, b_local, cross):
    plan = _run(b_remote, _fmt("HND", cross), b_local, _fmt("NHD", cross), kinds=kinds)
    assert [g.kind.value[0] for g in plan.groups] == [
        {"F": "f", "S": "s", "M": "s"}[k] for k in kinds
    ]


def test_identical_sides_need_no_transform_and_one_descriptor_per_block():
    plan = _run(32, _fmt("NHD", True), 32, _fmt("NHD", True))
    assert plan.transform_side is TransformSide.NONE
    assert plan.groups[0].descriptors_per_chunk == 1
    assert plan.groups[0].local_chunks_per_block == plan.groups[0].remote_chunks_per_block == 1


def test_sender_transforms_when_it_has_larger_blocks():
    plan = _run(64, _fmt("NHD", True), 16, _fmt("HND", True))
    g = plan.groups[0]
    assert g.sender is not None and g.receiver is None
    assert g.remote_chunks_per_block == 4
    assert "sender after save" in str(plan)


def test_receiver_merges_cross_layer_chunks():
    plan = _run(16, _fmt("NHD", True), 64, _fmt("NHD", True))
    assert plan.groups[0].receiver is not None


def test_corrupted_piece_is_detected():
    """The harness check can fail: flip one transferred byte and compare."""
    remote = make_side("p", 32, _fmt("NHD", True), "F", 10)
    local = make_side("d", 32, _fmt("HND", False), "F", 10)
    plan = negotiate(local.layout, remote.layout)
    ids = np.arange(8)
    want = read_group_token_major(remote.buffers, 0, ids)
    execute(plan, local, remote, 0, plan.groups[0].chunks_for_tokens(0, NUM_TOKENS), ids, ids)
    local.buffers.tensors[0].view(-1)[0] ^= 0xFF
    assert not torch.equal(read_group_token_major(local.buffers, 0, ids), want)


def test_sliding_window_tail_only():
    remote = make_side("p", 16, _fmt("NHD", False), "FS", 20)
    local = make_side("d", 64, _fmt("HND", False), "FS", 20)
    plan = negotiate(local.layout, remote.layout)
    g = plan.groups[1]
    # window of 24 tokens ending at 256: tokens 232..255 -> chunks 14, 15 of 16 tokens
    chunks = g.chunks_for_tokens(256 - 24, 256)
    assert chunks.tolist() == [14, 15]
    rids = np.array([7, 9])  # remote logical blocks 14, 15 only
    lids = np.array([11])  # local logical block 3 only
    want = read_group_token_major(remote.buffers, 1, rids)
    execute(plan, local, remote, 1, chunks, lids, rids, local_first=3, remote_first=14)
    got = read_group_token_major(local.buffers, 1, lids)[:, :, 32:]
    assert torch.equal(got, want)


def test_missing_remote_blocks_are_named():
    remote = make_side("p", 16, _fmt("NHD", False), "F", 20)
    local = make_side("d", 16, _fmt("NHD", False), "F", 20)
    plan = negotiate(local.layout, remote.layout)
    g = plan.groups[0]
    with pytest.raises(Exception, match="remote logical blocks"):
        g.indices(g.streams[0], np.arange(4), np.arange(4), np.arange(2))


def test_a_tp_size_that_does_not_match_the_cache_heads_is_refused_by_name():
    from dataclasses import replace

    remote = make_side("p", 16, _fmt("NHD", False), "F", 8)
    local = make_side("d", 16, _fmt("NHD", False), "F", 8)
    other = replace(remote.layout, identity=replace(remote.layout.identity, tp_size=2))
    with pytest.raises(
        IncompatiblePeerError, match=r"caches hold 2 \(local\) and 2 \(remote\) heads per rank"
    ):
        negotiate(local.layout, other)


def test_state_group_moves_state_bytes_per_layer():
    remote = make_side("p", 16, _fmt("NHD", True), "FM", 8)
    local = make_side("d", 64, _fmt("HND", False), "FM", 8)
    plan = negotiate(local.layout, remote.layout)
    g = plan.groups[1]
    assert g.descriptors_per_chunk == 2 and g.streams[0].length == 3 * 4 * 4 + 5 * 2
    execute(plan, local, remote, 1, np.array([0]), np.array([5]), np.array([3]))
    for name in ("g1.a", "g1.b"):
        for lv, rv in zip(
            local.buffers.state_views(name), remote.buffers.state_views(name), strict=True
        ):
            assert torch.equal(
                lv[5].contiguous().view(torch.uint8), rv[3].contiguous().view(torch.uint8)
            )


def test_engine_packed_blocks_move_whole_between_equal_block_sizes():
    fmt = CacheFormat(layout=KVLayout.HND, block_packing="vllm-cpu-attn:vec")
    plan = _run(32, fmt, 32, fmt, kinds="FS")
    assert plan.transform_side is TransformSide.NONE
    assert all(g.remote_chunks_per_block == g.local_chunks_per_block == 1 for g in plan.groups)


@pytest.mark.parametrize("b_remote,b_local", [(64, 32), (32, 64)])
def test_engine_packed_blocks_of_different_sizes_are_refused_by_name(b_remote, b_local):
    fmt = CacheFormat(layout=KVLayout.HND, block_packing="vllm-cpu-attn:vec")
    remote = make_side("p", b_remote, fmt, "F", 8)
    local = make_side("d", b_local, fmt, "F", 8)
    with pytest.raises(IncompatiblePeerError, match=r"(?s)groups\[0\]\.block_size.*moves such"):
        negotiate(local.layout, remote.layout)


def test_engine_packed_against_kvbridge_layout_is_refused():
    remote = make_side("p", 32, CacheFormat(layout=KVLayout.HND, block_packing="x"), "F", 8)
    local = make_side("d", 32, CacheFormat(layout=KVLayout.HND), "F", 8)
    with pytest.raises(IncompatiblePeerError, match="block_packing"):
        negotiate(local.layout, remote.layout)


def test_engine_packed_smaller_sender_pages_land_side_by_side_for_a_repack():
    fmt = CacheFormat(layout=KVLayout.HND, block_packing="vllm-cpu-attn:vec")
    remote = make_side("p", 32, fmt, "FS", 8)
    local = make_side("d", 128, fmt, "FS", 8)
    plan = negotiate(local.layout, remote.layout, can_repack=True)
    for g in plan.groups:
        assert (g.repack_from, g.local_chunks_per_block, g.remote_chunks_per_block) == (32, 4, 1)
        assert g.descriptors_per_chunk == 2  # one whole page per layer
        page = remote.layout.regions[g.streams[0].remote_region].region.block_bytes
        assert g.local_offsets(g.streams[0]).tolist() == [0, page, 2 * page, 3 * page]


def test_engine_packed_larger_sender_pages_go_whole_to_staging_for_a_split():
    fmt = CacheFormat(layout=KVLayout.HND, block_packing="vllm-cpu-attn:vec")
    remote = make_side("p", 128, fmt, "FS", 8)
    local = make_side("d", 32, fmt, "FS", 8)
    plan = negotiate(local.layout, remote.layout, can_repack=True)
    for g in plan.groups:
        assert (g.split_from, g.repack_from, g.wire_tokens) == (128, 0, 128)
        assert g.descriptors_per_chunk == 2  # one whole page per layer and remote block
        page = remote.layout.regions[g.streams[0].remote_region].region.block_bytes
        assert g.remote_offsets(g.streams[0]).tolist() == [0]
        assert [s.length for s in g.streams] == [page, page]
        assert g.staging_bytes == 2 * page
    assert "staged, engine splits" in str(plan)


@pytest.mark.parametrize("b_remote,b_local", [(96, 64), (64, 96), (160, 64)])
def test_engine_packed_pages_that_do_not_divide_go_whole_to_staging(b_remote, b_local):
    fmt = CacheFormat(layout=KVLayout.HND, block_packing="vllm-cpu-attn:vec")
    remote = make_side("p", b_remote, fmt, "F", 8)
    local = make_side("d", b_local, fmt, "F", 8)
    plan = negotiate(local.layout, remote.layout, can_repack=True)
    g = plan.groups[0]
    assert (g.split_from, g.repack_from, g.wire_tokens) == (b_remote, 0, b_remote)
    page = remote.layout.regions[g.streams[0].remote_region].region.block_bytes
    assert g.staging_bytes == 2 * page  # one whole remote page per layer


def _push_sides(b_remote: int, b_local: int, staging_bytes: int | None, kinds: str = "FS"):
    """Engine-packed push pair; the local (decode) side advertises a staging arena of
    ``staging_bytes`` (None: none, as an older kvbridge or a decode without repacker)."""
    fmt = CacheFormat(layout=KVLayout.HND, block_packing="vllm-cpu-attn:vec")
    remote, local = make_side("p", b_remote, fmt, kinds, 8), make_side("d", b_local, fmt, kinds, 8)
    arena = None
    if staging_bytes is not None:
        arena = KVRegion(
            name="staging",
            base_addr=1 << 20,
            block_bytes=staging_bytes,
            block_stride_bytes=staging_bytes,
            num_blocks=1,
            memory_kind=MemoryKind.DRAM,
        )
    push = TransferMode.PUSH
    return (
        replace(local.layout, transfer_mode=push, staging=arena),
        replace(remote.layout, transfer_mode=push),
    )


@pytest.mark.parametrize("b_remote,b_local", [(128, 32), (96, 128)])
def test_push_stages_larger_packed_pages_in_the_decode_arena(b_remote, b_local):
    """The plan is pull's: whole pages into staging slots (prefill writes them into the
    arena decode advertises); the arena must hold one slot."""
    local, remote = _push_sides(b_remote, b_local, staging_bytes=1 << 20)
    plan = negotiate(local, remote, can_repack=True)
    pull = negotiate(
        replace(local, transfer_mode=TransferMode.PULL, staging=None),
        replace(remote, transfer_mode=TransferMode.PULL),
        can_repack=True,
    )
    assert plan.groups == pull.groups and all(g.split_from == b_remote for g in plan.groups)


def test_push_of_pages_decode_stages_needs_its_staging_arena():
    local, remote = _push_sides(128, 32, staging_bytes=None)
    with pytest.raises(IncompatiblePeerError, match=r"(?s)staging: local='none'.*groups \[0, 1\]"):
        negotiate(local, remote, can_repack=True)


def test_push_into_an_arena_smaller_than_one_slot_names_the_knob():
    local, remote = _push_sides(128, 32, staging_bytes=4096)
    g = negotiate(
        replace(local, staging=None, transfer_mode=TransferMode.PULL),
        replace(remote, transfer_mode=TransferMode.PULL),
        can_repack=True,
    ).groups[0]
    with pytest.raises(
        IncompatiblePeerError,
        match=rf"(?s)staging_bytes: local=4096 remote="
        rf"{g.staging_bytes}.*raise extra.staging_mib on decode",
    ):
        negotiate(local, remote, can_repack=True)


def test_push_between_pages_that_need_no_staging_needs_no_arena():
    local, remote = _push_sides(32, 128, staging_bytes=None)
    plan = negotiate(local, remote, can_repack=True)
    assert all(g.repack_from == 32 and not g.split_from for g in plan.groups)
