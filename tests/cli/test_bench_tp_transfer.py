"""The pure helpers of scripts/bench_tp_transfer.py: each decode rank's share of the bytes,
and the byte check (a decode rank's heads against the prefill heads kvbridge.handshake.tp assigns
it), which must fail on a corrupted slice and on heads read from the wrong rank."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvbridge.cli.bench.tp_transfer import Pair, head_mismatches, share_bytes
from kvbridge.cli.bench.transfer_shape import Shape, fill, kv_digest, parse_format
from kvbridge.handshake import tp
from kvbridge.layouts.allocation import KVCacheBuffers

SHAPE = Shape(layers=2, heads=8, head_size=8, block_size=4, tokens=16)
REMOTE_IDS = [5, 0, 9, 2]
LOCAL_IDS = [1, 7, 3, 12]


def rank_buffers(rank: int, tp_size: int, fmt: str = "x-NHD") -> KVCacheBuffers:
    heads = tp.rank_heads(rank, tp_size, SHAPE.heads).count
    return replace(SHAPE, heads=heads).buffers(parse_format(fmt))


def copy_heads(src: KVCacheBuffers, dst: KVCacheBuffers, s: tp.HeadSlice) -> None:
    """What a load does for one slice: src's heads of REMOTE_IDS into dst's LOCAL_IDS
    (NHD views: (blocks, r, kernel block, heads, head size))."""
    remote, local = torch.tensor(REMOTE_IDS), torch.tensor(LOCAL_IDS)
    for name in src.config.layer_names:
        for a, b in zip(src.attention_views(name), dst.attention_views(name), strict=True):
            heads = a[remote][:, :, :, s.remote_head : s.remote_head + s.num_heads]
            b[local, :, :, s.local_head : s.local_head + s.num_heads] = heads


def digest_of(prefills: list[KVCacheBuffers]):
    def digest(s: tp.HeadSlice) -> str:
        return kv_digest(prefills[s.remote_rank], REMOTE_IDS, heads=(s.remote_head, s.num_heads))

    return digest


def test_share_bytes_is_the_decode_ranks_heads() -> None:
    default = Shape(layers=32, heads=8, head_size=128, block_size=16, tokens=2048)
    assert default.request_bytes == 256 * 2**20
    assert share_bytes(default, 0, 2) == 128 * 2**20  # 1:2, rank 0 holds 4 of 8 heads
    assert share_bytes(default, 1, 2) == 128 * 2**20
    assert share_bytes(default, 0, 1) == 256 * 2**20  # 2:1, decode holds every head
    assert share_bytes(default, 3, 16) == 32 * 2**20  # GQA replication: one head each
    assert Pair.parse("2:1") == Pair(prefill_tp=2, decode_tp=1)
    assert str(Pair(prefill_tp=1, decode_tp=2)) == "1:2"


def test_one_to_two_each_decode_rank_holds_its_half() -> None:
    prefill = rank_buffers(0, 1)
    fill(prefill, seed=1)
    for rank in (0, 1):
        decode = rank_buffers(rank, 2)
        slices = tp.sources(rank, 2, 1, SHAPE.heads)
        assert slices == (tp.HeadSlice(0, 0, 4 * rank, 4),)
        assert head_mismatches(decode, LOCAL_IDS, slices, digest_of([prefill])) != []  # empty
        copy_heads(prefill, decode, slices[0])
        assert head_mismatches(decode, LOCAL_IDS, slices, digest_of([prefill])) == []
        # the other rank's heads are not this rank's
        other = (tp.HeadSlice(0, 0, 4 * (1 - rank), 4),)
        assert len(head_mismatches(decode, LOCAL_IDS, other, digest_of([prefill]))) == 1


@pytest.mark.parametrize("where", [0, -1])
def test_a_corrupted_byte_is_named(where: int) -> None:
    prefills = [rank_buffers(r, 2) for r in (0, 1)]
    for r, p in enumerate(prefills):
        fill(p, seed=1 + r)
    decode = rank_buffers(0, 1)
    slices = tp.sources(0, 1, 2, SHAPE.heads)  # half the heads from each prefill rank
    assert [s.remote_rank for s in slices] == [0, 1]
    for s in slices:
        copy_heads(prefills[s.remote_rank], decode, s)
    assert head_mismatches(decode, LOCAL_IDS, slices, digest_of(prefills)) == []
    # flip one byte of the first or the last loaded block (cross-layer: one row per block)
    block = decode.tensors[0].view(decode.config.num_blocks, -1)[LOCAL_IDS[where]]
    block[where] ^= 0xFF
    bad = head_mismatches(decode, LOCAL_IDS, slices, digest_of(prefills))
    assert len(bad) == 1
    assert bad[0].startswith(f"heads {4 * (where % 2)}..") and f"prefill rank {where % 2}" in bad[0]


def test_heads_read_from_the_wrong_rank_differ() -> None:
    prefills = [rank_buffers(r, 2) for r in (0, 1)]
    for r, p in enumerate(prefills):
        fill(p, seed=1 + r)  # as the children do: every rank holds other bytes
    decode = rank_buffers(0, 1)
    slices = tp.sources(0, 1, 2, SHAPE.heads)
    swapped = tuple(replace(s, remote_rank=1 - s.remote_rank) for s in slices)
    for s in swapped:
        copy_heads(prefills[s.remote_rank], decode, s)
    bad = head_mismatches(decode, LOCAL_IDS, slices, digest_of(prefills))
    assert len(bad) == 2
    assert np.all([f"prefill rank {r} " in b for r, b in enumerate(bad)])
