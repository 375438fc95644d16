"""Any pair of block sizes: wire chunks of ``gcd(b_remote, b_local)`` tokens.

Every case loads tokens ``[start, end)``: ``start`` a local prefix hit (a multiple of the
local block size), ``end`` anywhere (the prompt's last partial block moves too). The
local tokens of that range must equal the sender's, byte for byte, and no block outside
the range may change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.handshake.plan import negotiate
from kvbridge.layouts.allocation import read_group_token_major
from tests.handshake.plan_harness import cache_format, execute, make_side

NON_MULTIPLE_PAIRS = [(80, 32), (96, 64), (528, 64), (48, 32), (32, 48), (64, 96), (32, 80)]


_fmt = cache_format


def _load(b_remote, f_remote, b_local, f_local, start, end, *, kinds="F", in_place=True, seed=0):
    """Load ``[start, end)`` through the plan; returns (plan, descriptors moved)."""
    rng = np.random.default_rng(seed)
    n_remote, n_local = -(-end // b_remote), -(-end // b_local)
    remote = make_side(
        "prefill", b_remote, f_remote, kinds, n_remote + 3, rewrites_in_place=in_place
    )
    local = make_side("decode", b_local, f_local, kinds, n_local + 3)
    plan = negotiate(local.layout, remote.layout, min_native_piece_bytes=1)
    rids = rng.permutation(n_remote + 3)[:n_remote]
    lids = rng.permutation(n_local + 3)[:n_local]
    moved = 0
    for g in plan.groups:
        want = read_group_token_major(remote.buffers, g.group_id, rids)
        before = read_group_token_major(local.buffers, g.group_id, lids)
        chunks = g.chunks_for_tokens(start, end)
        first = start // b_local
        moved += execute(
            plan, local, remote, g.group_id, chunks, lids[first:], rids, local_first=first
        )
        got = read_group_token_major(local.buffers, g.group_id, lids)
        assert torch.equal(got[:, :, start:end], want[:, :, start:end]), (
            f"group {g.group_id}: tokens {start}..{end} differ under\n{plan}"
        )
        # blocks below the prefix hit are never touched; past ``end`` only the rest of the
        # last local block may be (a receiver rewrite permutes whole blocks; decode
        # overwrites those slots when it computes them)
        assert torch.equal(got[:, :, :start], before[:, :, :start])
        tail = -(-end // b_local) * b_local
        assert torch.equal(got[:, :, tail:], before[:, :, tail:])
    return plan, moved


@pytest.mark.parametrize("b_remote,b_local", NON_MULTIPLE_PAIRS)
@pytest.mark.parametrize("layouts", [("NHD", "NHD"), ("NHD", "HND"), ("HND", "NHD")])
@pytest.mark.parametrize("cross", [(True, True), (False, False), (True, False), (False, True)])
def test_non_multiple_block_sizes_move_every_token(b_remote, b_local, layouts, cross):
    end = 3 * max(b_remote, b_local) - 7  # a partial last block on both sides
    plan, _ = _load(
        b_remote, _fmt(layouts[0], cross[0]), b_local, _fmt(layouts[1], cross[1]), 0, end
    )
    g = plan.groups[0]
    assert g.wire_tokens == np.gcd(b_remote, b_local)
    assert g.remote_chunks_per_block * g.wire_tokens == b_remote
    assert g.local_chunks_per_block * g.wire_tokens == b_local
    if cross == (True, True):
        assert g.descriptors_per_chunk == 1


@pytest.mark.parametrize(
    "b_remote,k_remote,b_local,k_local",
    [(80, 16, 32, 32), (96, 32, 64, 64), (48, 16, 32, 32), (32, 32, 48, 16), (64, 64, 96, 32)],
)
@pytest.mark.parametrize("packings", [("blocks_first", "kv_split"), ("kv_split", "blocks_first")])
def test_kernel_blocks_on_either_side(b_remote, k_remote, b_local, k_local, packings):
    _load(
        b_remote,
        _fmt("HND", False, k_remote, packings[0]),
        b_local,
        _fmt("NHD", False, k_local, packings[1]),
        0,
        2 * b_remote + 5,
    )


@pytest.mark.parametrize("b_remote,b_local", [(80, 32), (48, 32), (32, 48), (64, 96)])
def test_load_after_a_local_prefix_hit_ends_mid_block(b_remote, b_local):
    start = 2 * b_local
    _load(b_remote, _fmt("NHD", True), b_local, _fmt("HND", False), start, start + 3 * b_remote + 1)


@pytest.mark.parametrize("b_remote,b_local", [(80, 32), (32, 80), (96, 64)])
@pytest.mark.parametrize("cross", [True, False])
def test_hybrid_attention_groups(b_remote, b_local, cross):
    plan, _ = _load(
        b_remote, _fmt("HND", cross), b_local, _fmt("NHD", cross), 0, 4 * b_remote - 3, kinds="FS"
    )
    assert len(plan.groups) == 2


@pytest.mark.parametrize("b_remote,b_local", [(80, 32), (96, 64), (32, 48)])
def test_a_sender_that_may_not_rewrite_is_read_natively(b_remote, b_local):
    plan, _ = _load(
        b_remote, _fmt("NHD", False), b_local, _fmt("NHD", False), 0, 2 * b_remote, in_place=False
    )
    assert plan.sender_rewrites() == {}


def test_descriptor_count_stays_within_a_small_factor_of_equal_sizes():
    """Per request of ~2048 tokens, cross-layer both sides: one descriptor per wire chunk."""
    counts = {}
    for b_remote, b_local in [(64, 64), (80, 32), (96, 64), (528, 64), (48, 32)]:
        _, moved = _load(b_remote, _fmt("NHD", True), b_local, _fmt("NHD", True), 0, 2047)
        counts[(b_remote, b_local)] = moved
    same = counts[(64, 64)]
    assert same == 32
    assert counts[(96, 64)] == 64  # gcd 32: 2x
    assert counts[(80, 32)] == counts[(528, 64)] == counts[(48, 32)] == 128  # gcd 16: 4x


def test_a_corrupted_chunk_is_caught():
    remote = make_side("p", 80, _fmt("NHD", True), "F", 6)
    local = make_side("d", 32, _fmt("HND", False), "F", 10)
    plan = negotiate(local.layout, remote.layout)
    rids, lids = np.arange(3), np.arange(8)
    want = read_group_token_major(remote.buffers, 0, rids)
    execute(plan, local, remote, 0, plan.groups[0].chunks_for_tokens(0, 240), lids, rids)
    local.buffers.tensors[0].view(-1)[100] ^= 0xFF
    got = read_group_token_major(local.buffers, 0, lids)
    assert not torch.equal(got[:, :, :240], want)
