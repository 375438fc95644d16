"""Different tensor-parallel sizes across OS processes, at the worker level (no engine).

Each prefill rank is its own child process (``_prefill_child.py``: its own NIXL agent, its
side channel on an ephemeral port that the params list, a cache holding that rank's KV
heads, seeded bytes the test can rebuild). Each decode rank is a :class:`KVBridgeWorker`
in the test process with its own agent. Every decode rank loads the same request;
afterwards its cache holds, byte for byte, the heads :func:`kvbridge.handshake.tp.sources`
assigns it, each prefill rank frees the request only after the last decode rank reading it
said ``Done``, and its blocks are byte-exact again (the head-major rewrite after save is
undone).

MLA (one latent, the same on every rank): each decode rank reads it whole from one prefill
rank, and a prefill rank nobody reads is freed by the ``Done`` of the decode rank that
releases it; loads go one decode rank at a time and every prefill rank's ``Done`` set is
checked after each.

State (Mamba-like) groups: where both sides describe how the state is sharded, every
decode rank gets exactly its shard of the whole state (pull and push); where they do not,
the load fails, naming both TP sizes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge.connector.common.metadata import LoadSpec
from kvbridge.handshake import tp
from tests.connector.tp_cluster import (
    KINDS,
    PUMP_TIMEOUT_S,
    TOKENS,
    DecodeRank,
    Prefill,
    Request,
    TPCluster,
    check_heads,
    held,
    load_all,
    load_spec,
    new_request,
    pump,
    send,
    window_lo,
)
from tests.handshake.plan_harness import shard, sharded_state, unshard

pytestmark = pytest.mark.integration


@pytest.fixture
def setup(tmp_path: Path) -> Iterator:
    with TPCluster(tmp_path) as cluster:
        yield cluster.make


def _descriptors(kinds: str, num_sources: int) -> int:
    """Prefill cross-layer, decode per-layer: one descriptor per (layer, 16-token wire
    chunk, source rank); a full or MLA group moves 6 chunks, the sliding window 2
    (tokens 72..95)."""
    chunks = sum(TOKENS // 16 - window_lo(k) // 16 for k in kinds)
    return num_sources * 2 * chunks


def _await_done(
    prefill: Prefill,
    rank: int,
    decodes: list[DecodeRank],
    rid: str,
    before: list[int],
    after: list[int] | None,
) -> None:
    """Prefill rank ``rank`` moves from ``Done`` by ``before`` to ``after`` (decode ranks,
    sorted), or to freed (``after`` None); it is never seen in any other state."""
    child = prefill.ranks[rank]
    deadline = time.monotonic() + PUMP_TIMEOUT_S
    while (done := held(child, rid)) != after:
        assert done == before, f"prefill rank {rank}: Done by {done}, want {before} -> {after}"
        assert time.monotonic() < deadline, f"prefill rank {rank} stayed at Done by {before}"
        for d in decodes:  # flush their notifications
            d.pump()
    if after is None:
        pump(decodes, prefill, lambda: rid in child.sent, f"prefill rank {rank} freed")
    else:
        assert rid not in child.sent, f"prefill rank {rank} freed before all its decode ranks"


def _load_in_turn(
    prefill: Prefill, decodes: list[DecodeRank], spec: LoadSpec, done_by: dict[int, list[int]]
) -> None:
    """``decodes`` load one after another. After each, every prefill rank has heard
    ``Done`` from exactly the decode ranks so far that ``done_by[rank]`` lists (its
    readers, or the one that releases an unread replica), and is freed once all of those
    in ``done_by[rank]`` have."""
    rid = spec.params.remote_request_id
    assert sorted(done_by) == list(range(prefill.tp_size))
    heard: dict[int, list[int]] = {r: [] for r in done_by}
    for r in done_by:
        assert held(prefill.ranks[r], rid) == [], f"prefill rank {r} does not hold {rid}"
    for d in decodes:
        d.load(spec)
        pump(
            [d],
            prefill,
            lambda d=d: spec.request_id in d.loaded or bool(d.failed),
            f"decode rank {d.rank}",
        )
        assert not d.failed, d.failed
        for r, ranks in done_by.items():
            before = heard[r]
            if d.rank in ranks:
                heard[r] = sorted([*before, d.rank])
            after = None if heard[r] == sorted(ranks) else heard[r]
            if d.rank in ranks:
                _await_done(prefill, r, decodes, rid, before, after)
            else:  # not told by this decode rank: unchanged
                assert held(prefill.ranks[r], rid) == after, (r, d.rank)


def _computed_done_by(decode_tp: int, prefill: Prefill) -> dict[int, list[int]]:
    """Prefill rank -> the decode ranks that tell it ``Done``, by kvbridge.handshake.tp."""
    told = [tp.notified_by(d, decode_tp, prefill.tp_size, prefill.heads) for d in range(decode_tp)]
    return {r: [d for d in range(decode_tp) if r in told[d]] for r in range(prefill.tp_size)}


@pytest.mark.parametrize(
    ("decode_tp", "prefill_tp", "heads"),
    [
        (1, 2, 4),  # one decode rank reads two prefill ranks
        (2, 1, 4),  # two decode ranks read halves of one prefill rank
        (2, 2, 4),
        (1, 4, 4),
        (4, 2, 4),
        (1, 4, 2),  # GQA: prefill ranks 0,1 and 2,3 are replicas; decode reads one of each
        (4, 1, 2),  # GQA: decode ranks 0,1 and 2,3 are replicas of one head
    ],
)
def test_decode_ranks_get_their_heads_and_prefill_frees_after_the_last(
    setup, decode_tp, prefill_tp, heads
):
    prefill, decodes = setup(decode_tp, prefill_tp, heads)
    req = new_request(prefill, decodes[0].fmt, np.random.default_rng(decode_tp * 10 + prefill_tp))
    send(prefill, req)
    spec = load_spec(prefill, req)
    # decode rank 0 first: every prefill rank it reports to must keep waiting for the
    # other decode ranks that read it; then the others load at the same time
    _load_in_turn(prefill, decodes[:1], spec, _computed_done_by(decode_tp, prefill))
    load_all(prefill, decodes[1:], spec, "every decode rank loaded, every prefill rank freed")
    for d in decodes:
        assert not d.failed, d.failed
        slices = tp.sources(d.rank, decode_tp, prefill_tp, heads)
        check_heads(prefill, d, slices, req)
        assert d.worker.metrics.descriptors_posted == _descriptors(KINDS, len(slices)), d.rank
    for child in prefill.ranks:
        assert child.digest() == child.replica_digest()  # the rewrite after save was undone


# MLA: one latent per token, the same on every rank (``total_kv_heads`` 1). Written out
# rather than derived from kvbridge.handshake.tp, so that a change there shows up here:
# (decode TP, prefill TP, prefill rank each decode rank reads, decode ranks that tell
# each prefill rank Done). A prefill rank nobody reads hears from decode rank
# ``rank % decode TP``.
MLA_ROWS = [
    (1, 2, [0], {0: [0], 1: [0]}),  # prefill rank 1 unread: decode 0 releases it
    (2, 1, [0, 0], {0: [0, 1]}),  # both decode ranks read the one prefill rank
    (2, 4, [0, 1], {0: [0], 1: [1], 2: [0], 3: [1]}),  # ranks 2, 3 unread
    (4, 2, [0, 1, 0, 1], {0: [0, 2], 1: [1, 3]}),  # reads spread over the replicas
]


@pytest.mark.parametrize(("decode_tp", "prefill_tp", "reads", "done_by"), MLA_ROWS)
def test_mla_latent_is_read_once_per_decode_rank_and_every_prefill_rank_frees(
    setup, decode_tp, prefill_tp, reads, done_by
):
    """Each decode rank reads the whole latent from one prefill rank (the plain plan: no
    head slice, nothing rewritten), byte for byte; every prefill rank, read or not, frees
    after ``Done`` from exactly its decode ranks."""
    prefill, decodes = setup(decode_tp, prefill_tp, 1, kinds="L")
    assert _computed_done_by(decode_tp, prefill) == done_by
    req = new_request(prefill, decodes[0].fmt, np.random.default_rng(7 + decode_tp))
    send(prefill, req)
    spec = load_spec(prefill, req)
    _load_in_turn(prefill, decodes, spec, done_by)
    for r, child in enumerate(prefill.ranks):
        assert req.rid in child.sent, f"prefill rank {r} never freed {req.rid}"
    for d, r in zip(decodes, reads, strict=True):
        check_heads(prefill, d, (tp.HeadSlice(r, 0, 0, 1),), req)
        assert d.worker.metrics.descriptors_posted == 12  # 2 layers x 6 chunks, one source
        assert d.worker.metrics.bytes_read == TOKENS * 2 * 8 * 2  # 2 layers, 8 fp16 latent
        assert d.worker.metrics.receiver_rewrites == 0
    for child in prefill.ranks:
        assert child.digest() == child.replica_digest()  # nothing rewrote the latent


def _check_state(prefill: Prefill, decode: DecodeRank, decode_tp: int, req: Request) -> None:
    """Decode's state block holds, byte for byte, its shard of the whole state rebuilt from
    every prefill rank's block (replicated tensors: the copy of the first prefill rank it
    reads heads from; the seeded copies differ, so this proves which rank was read)."""
    g = prefill.kinds.index("T")
    lblock = int(req.local[g][(TOKENS - 1) // decode.fmt.block_size])
    rblock = int(req.remote[g][0])
    first = tp.sources(decode.rank, decode_tp, prefill.tp_size, prefill.heads)[0].remote_rank
    rank_how = prefill.ranks[0].buffers.config.groups[g].spec.sharding
    whole_how = sharded_state(16).sharding
    assert rank_how is not None and whole_how is not None
    for layer in decode.buffers.config.groups[g].layer_names:
        got = decode.buffers.state_views(layer)
        for i, (how, wh) in enumerate(zip(rank_how, whole_how, strict=True)):
            shards = [c.buffers.state_views(layer)[i][rblock] for c in prefill.ranks]
            want = shard(unshard(shards, how, first), wh, decode.rank, decode_tp)
            assert _raw(got[i][lblock]).equal(_raw(want)), (decode.rank, layer, i)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)  # bytes: random fp bits hold NaNs


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("decode_tp", "prefill_tp"), [(1, 2), (2, 1)])
def test_a_described_state_group_gives_each_decode_rank_its_shard(
    setup, decode_tp, prefill_tp, mode
):
    """Full attention + a Mamba2-like state whose sharding both sides describe (conv split
    on its channels in sections x, B, C; ssm on its heads; one replicated tensor): every
    decode rank gets its heads and exactly its shard of the state, from the prefill ranks
    it reads heads from; every prefill rank frees after its decode ranks' Done, its blocks
    restored."""
    prefill, decodes = setup(decode_tp, prefill_tp, 4, mode, "FT")
    req = new_request(prefill, decodes[0].fmt, np.random.default_rng(40 + decode_tp))
    send(prefill, req)
    spec = load_spec(prefill, req)
    if mode == "pull":  # decode rank 0 first: its prefill ranks wait for the other readers
        _load_in_turn(prefill, decodes[:1], spec, _computed_done_by(decode_tp, prefill))
    load_all(prefill, decodes[1:] if mode == "pull" else decodes, spec, "every shard loaded")
    for d in decodes:
        assert not d.failed, d.failed
        assert spec.request_id in d.loaded
        check_heads(prefill, d, tp.sources(d.rank, decode_tp, prefill_tp, 4), req)
        _check_state(prefill, d, decode_tp, req)
        if mode == "push":
            assert d.worker.metrics.descriptors_posted == 0
    for child in prefill.ranks:
        assert req.rid in child.sent
        assert child.digest() == child.replica_digest()


def test_a_state_group_across_tp_sizes_fails_the_load_naming_both_sizes(setup):
    """Decode TP 1, prefill TP 2, a model with a state group whose sharding is not
    described ('M'): the handshake refuses each prefill rank by name (a rank's state is a
    shard kvbridge cannot map across sizes); the load fails with that reason instead of
    moving anything."""
    prefill, (decode,) = setup(1, 2, 4, kinds="FM")
    req = new_request(prefill, decode.fmt, np.random.default_rng(5))
    send(prefill, req)
    spec = load_spec(prefill, req)
    decode.load(spec)
    pump([decode], prefill, lambda: bool(decode.failed), "the load to fail")
    reason = decode.failed[spec.request_id]
    assert "tp_size: local=1 remote=2" in reason, reason
    assert "groups [1] hold recurrent (Mamba-like) state" in reason, reason
    assert "same TP size (both 1 or both 2)" in reason, reason
    assert decode.loaded == set()
    assert decode.worker.metrics.descriptors_posted == 0
    assert decode.worker.metrics.bytes_read == 0


@pytest.mark.parametrize(
    ("decode_tp", "prefill_tp", "heads", "kinds"),
    [
        (1, 2, 4, KINDS),
        (2, 1, 4, KINDS),
        (4, 2, 4, KINDS),
        (1, 4, 2, KINDS),
        (1, 2, 1, "L"),  # MLA: prefill rank 1 is written by nobody, told Done by decode 0
        (2, 4, 1, "L"),
    ],
)
def test_push_mode_writes_each_decode_rank_its_heads(setup, decode_tp, prefill_tp, heads, kinds):
    """Push: every prefill rank a decode rank reads from WRITEs that rank's heads into its
    blocks (its own handshake with each decode rank, the same head-major plan); decode
    ranks post nothing; prefill frees after the last decode rank's Done."""
    prefill, decodes = setup(decode_tp, prefill_tp, heads, "push", kinds)
    req = new_request(
        prefill, decodes[0].fmt, np.random.default_rng(100 + decode_tp * 10 + prefill_tp)
    )
    send(prefill, req)
    spec = load_spec(prefill, req)
    load_all(prefill, decodes, spec, "every decode rank pushed to, every prefill rank freed")
    for d in decodes:
        assert not d.failed, d.failed
        slices = tp.sources(d.rank, decode_tp, prefill_tp, heads)
        check_heads(prefill, d, slices, req)
        assert d.worker.metrics.descriptors_posted == 0
        assert d.worker.metrics.bytes_read > 0
    for child in prefill.ranks:
        assert child.digest() == child.replica_digest()  # the rewrite after save was undone
