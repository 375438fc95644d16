"""KV-head mapping between tensor-parallel ranks of the prefill and the decode engine."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.handshake.tp import (
    HeadSlice,
    RankHeads,
    expected_done,
    notified_by,
    rank_heads,
    readers,
    releaser,
    sources,
)
from kvbridge.layouts.errors import LayoutError

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8)


# --- rank_heads -------------------------------------------------------------------------


def test_rank_heads_tp_below_heads_splits_contiguously():
    assert [rank_heads(r, 2, 8) for r in range(2)] == [RankHeads(0, 4), RankHeads(4, 4)]
    assert [rank_heads(r, 4, 8) for r in range(4)] == [
        RankHeads(0, 2),
        RankHeads(2, 2),
        RankHeads(4, 2),
        RankHeads(6, 2),
    ]
    assert rank_heads(0, 1, 4) == RankHeads(first=0, count=4)


def test_rank_heads_tp_equal_heads_one_head_each():
    assert [rank_heads(r, 4, 4) for r in range(4)] == [RankHeads(h, 1) for h in range(4)]


def test_rank_heads_tp_above_heads_replicates():
    # 2 KV heads over 8 ranks: 4 replicas of each head.
    assert [rank_heads(r, 8, 2).first for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {rank_heads(r, 8, 2).count for r in range(8)} == {1}
    assert [rank_heads(r, 4, 2) for r in range(4)] == [
        RankHeads(0, 1),
        RankHeads(0, 1),
        RankHeads(1, 1),
        RankHeads(1, 1),
    ]


def test_mla_is_one_head_replicated_on_every_rank():
    # MLA's latent cache is identical on every rank: total_kv_heads == 1, all replicas.
    for tp in (1, 2, 4, 8, 16):
        assert {rank_heads(r, tp, 1) for r in range(tp)} == {RankHeads(0, 1)}


def test_rank_heads_non_dividing_tp_names_both_numbers():
    with pytest.raises(LayoutError, match=r"tp=3 does not divide total_kv_heads=4"):
        rank_heads(0, 3, 4)
    with pytest.raises(LayoutError, match=r"tp=6 .*total_kv_heads=4.*not a multiple"):
        rank_heads(0, 6, 4)


@pytest.mark.parametrize(
    ("rank", "tp", "heads", "pattern"),
    [
        (2, 2, 4, r"rank=2 is out of range for tensor-parallel size 2"),
        (-1, 2, 4, r"rank=-1 is out of range"),
        (0, 0, 4, r"tp \(tensor-parallel size\) must be >= 1, got 0"),
        (0, 2, 0, r"total_kv_heads must be >= 1, got 0"),
    ],
)
def test_rank_heads_rejects_bad_input(rank, tp, heads, pattern):
    with pytest.raises(LayoutError, match=pattern):
        rank_heads(rank, tp, heads)


def test_layout_error_is_a_value_error():
    with pytest.raises(ValueError):
        rank_heads(0, 3, 4)


# --- sources, 4 KV heads ------------------------------------------------------------------


def _all_sources(local_tp, remote_tp, heads):
    return [sources(r, local_tp, remote_tp, heads) for r in range(local_tp)]


def test_sources_local_1_remote_2():
    assert _all_sources(1, 2, 4) == [
        (HeadSlice(0, local_head=0, remote_head=0, num_heads=2), HeadSlice(1, 2, 0, 2)),
    ]


def test_sources_local_2_remote_1():
    assert _all_sources(2, 1, 4) == [(HeadSlice(0, 0, 0, 2),), (HeadSlice(0, 0, 2, 2),)]


def test_sources_local_2_remote_2():
    assert _all_sources(2, 2, 4) == [(HeadSlice(0, 0, 0, 2),), (HeadSlice(1, 0, 0, 2),)]


def test_sources_local_1_remote_4():
    assert _all_sources(1, 4, 4) == [tuple(HeadSlice(h, h, 0, 1) for h in range(4))]


def test_sources_local_4_remote_2():
    assert _all_sources(4, 2, 4) == [
        (HeadSlice(0, 0, 0, 1),),
        (HeadSlice(0, 0, 1, 1),),
        (HeadSlice(1, 0, 0, 1),),
        (HeadSlice(1, 0, 1, 1),),
    ]
    assert readers(0, 4, 2, 4) == (0, 1)
    assert readers(1, 4, 2, 4) == (2, 3)
    assert [expected_done(r, 4, 2, 4) for r in range(2)] == [2, 2]


def test_sources_local_4_remote_1():
    assert _all_sources(4, 1, 4) == [(HeadSlice(0, 0, h, 1),) for h in range(4)]
    assert readers(0, 4, 1, 4) == (0, 1, 2, 3)
    assert expected_done(0, 4, 1, 4) == 4


def test_sources_local_2_remote_4():
    assert _all_sources(2, 4, 4) == [
        (HeadSlice(0, 0, 0, 1), HeadSlice(1, 1, 0, 1)),
        (HeadSlice(2, 0, 0, 1), HeadSlice(3, 1, 0, 1)),
    ]


# --- GQA replication and MLA ----------------------------------------------------------------


def test_gqa_2_heads_remote_4_local_1_reads_one_replica_per_head():
    # Remote ranks 0,1 hold head 0 and 2,3 head 1; local rank 0 takes replica 0 of each.
    assert sources(0, 1, 4, 2) == (HeadSlice(0, 0, 0, 1), HeadSlice(2, 1, 0, 1))
    assert [readers(r, 1, 4, 2) for r in range(4)] == [(0,), (), (0,), ()]
    assert [releaser(r, 1, 4, 2) for r in range(4)] == [None, 0, None, 0]
    assert notified_by(0, 1, 4, 2) == (0, 1, 2, 3)
    assert [expected_done(r, 1, 4, 2) for r in range(4)] == [1, 1, 1, 1]


def test_gqa_2_heads_remote_1_local_4():
    # Local ranks 0,1 hold head 0 and 2,3 head 1; the one remote rank holds both.
    assert _all_sources(4, 1, 2) == [
        (HeadSlice(0, 0, 0, 1),),
        (HeadSlice(0, 0, 0, 1),),
        (HeadSlice(0, 0, 1, 1),),
        (HeadSlice(0, 0, 1, 1),),
    ]
    assert readers(0, 4, 1, 2) == (0, 1, 2, 3)
    assert releaser(0, 4, 1, 2) is None
    assert [notified_by(r, 4, 1, 2) for r in range(4)] == [(0,)] * 4
    assert expected_done(0, 4, 1, 2) == 4


def test_gqa_replicas_on_both_sides_spread_readers():
    # 2 heads, both engines at tp 4: local replicas of a head read different remote replicas.
    assert _all_sources(4, 4, 2) == [(HeadSlice(r, 0, 0, 1),) for r in range(4)]
    # Remote tp 8: 4 replicas per head, local rank r picks replica r % 4.
    assert [s[0].remote_rank for s in _all_sources(4, 8, 2)] == [0, 1, 6, 7]


def test_mla_tp_2_to_4():
    # Local tp 2 reads from remote tp 4: local rank r reads replica r, ranks 2 and 3 unread.
    assert _all_sources(2, 4, 1) == [(HeadSlice(0, 0, 0, 1),), (HeadSlice(1, 0, 0, 1),)]
    assert [readers(r, 2, 4, 1) for r in range(4)] == [(0,), (1,), (), ()]
    assert [releaser(r, 2, 4, 1) for r in range(4)] == [None, None, 0, 1]
    assert notified_by(0, 2, 4, 1) == (0, 2)
    assert notified_by(1, 2, 4, 1) == (1, 3)
    assert [expected_done(r, 2, 4, 1) for r in range(4)] == [1, 1, 1, 1]


def test_mla_tp_4_to_2():
    assert _all_sources(4, 2, 1) == [(HeadSlice(r % 2, 0, 0, 1),) for r in range(4)]
    assert readers(0, 4, 2, 1) == (0, 2)
    assert readers(1, 4, 2, 1) == (1, 3)
    assert [expected_done(r, 4, 2, 1) for r in range(2)] == [2, 2]


# --- errors of the mapping ------------------------------------------------------------------


def test_sources_names_the_bad_side():
    with pytest.raises(LayoutError, match=r"remote_tp=3 does not divide total_kv_heads=4"):
        sources(0, 2, 3, 4)
    with pytest.raises(LayoutError, match=r"local_tp=6 .*total_kv_heads=4"):
        sources(0, 6, 2, 4)
    with pytest.raises(LayoutError, match=r"local_rank=2 is out of range"):
        sources(2, 2, 2, 4)


def test_readers_and_releaser_reject_bad_input():
    with pytest.raises(LayoutError, match=r"remote_rank=4 is out of range"):
        readers(4, 2, 4, 4)
    with pytest.raises(LayoutError, match=r"local_tp \(tensor-parallel size\) must be >= 1"):
        releaser(0, 0, 4, 4)
    with pytest.raises(LayoutError, match=r"remote_tp=3"):
        expected_done(0, 2, 3, 4)


# --- properties over every combination ------------------------------------------------------


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "heads"), list(itertools.product(TPS, TPS, HEADS))
)
def test_mapping_properties(local_tp, remote_tp, heads):
    k = max(1, remote_tp // heads)
    pairs = 0
    for local_rank in range(local_tp):
        mine = rank_heads(local_rank, local_tp, heads)
        slices = sources(local_rank, local_tp, remote_tp, heads)
        # Sorted by local head, contiguous, covering [0, count) exactly once.
        covered = [s.local_head + i for s in slices for i in range(s.num_heads)]
        assert covered == list(range(mine.count))
        # One slice per remote rank.
        assert len({s.remote_rank for s in slices}) == len(slices)
        for s in slices:
            assert s.num_heads >= 1
            theirs = rank_heads(s.remote_rank, remote_tp, heads)
            assert 0 <= s.remote_head and s.remote_head + s.num_heads <= theirs.count
            for i in range(s.num_heads):
                assert mine.first + s.local_head + i == theirs.first + s.remote_head + i
            # The replica picked is local_rank % k among the k holding the head.
            assert s.remote_rank % k == local_rank % k
        pairs += len(notified_by(local_rank, local_tp, remote_tp, heads))

    for remote_rank in range(remote_tp):
        who = readers(remote_rank, local_tp, remote_tp, heads)
        rel = releaser(remote_rank, local_tp, remote_tp, heads)
        # Either read, or released by exactly one local rank.
        assert (len(who) > 0) != (rel is not None)
        assert who == tuple(
            r
            for r in range(local_tp)
            if remote_rank in {s.remote_rank for s in sources(r, local_tp, remote_tp, heads)}
        )
        senders = [
            r for r in range(local_tp) if remote_rank in notified_by(r, local_tp, remote_tp, heads)
        ]
        assert senders == (list(who) if who else [rel])
        assert expected_done(remote_rank, local_tp, remote_tp, heads) == len(senders)

    total = sum(expected_done(r, local_tp, remote_tp, heads) for r in range(remote_tp))
    assert total == pairs
