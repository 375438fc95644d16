"""Pipeline stages across OS processes, at the worker level (no engine).

The model of the cluster has two layers; at PP 2 stage 0 holds layer 0 and stage 1 layer
1 of every group. Each prefill rank (a TP rank of a stage) is its own child process with
its own NIXL agent, side channel and seeded cache holding only its stage's layers; each
decode rank is a :class:`KVBridgeWorker` in the test process holding its stage's layers.
After a load every decode layer equals, byte for byte, the layer of the prefill rank that
holds it (and its heads), and a prefill rank frees the request only once every decode
stage that reads from it said ``Done``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvbridge.handshake import tp
from kvbridge.layouts.allocation import read_group_token_major
from kvbridge.layouts.layout import KVLayout
from tests.connector.conftest import SideFormat
from tests.connector.tp_cluster import (
    DECODE_FMT,
    PREFILL_FMT,
    TOKENS,
    DecodeRank,
    Prefill,
    Request,
    TPCluster,
    held,
    load_all,
    load_spec,
    new_request,
    packed,
    pump,
    send,
    window_lo,
)

pytestmark = pytest.mark.integration

PP2 = ((0, 1), (1, 2))  # model layers [first, end) of stage 0 and stage 1
PER_LAYER = SideFormat(block_size=16, layout=KVLayout.HND)  # a prefill read in part
NHD_PER_LAYER = SideFormat(block_size=16)  # rewritten after save for an HND decode


@pytest.fixture
def setup(tmp_path: Path) -> Iterator:
    with TPCluster(tmp_path) as cluster:
        yield cluster.make


def check_layers(prefill: Prefill, decode: DecodeRank, decode_tp: int, req: Request) -> None:
    """Every layer and head of ``decode`` equals the prefill rank's that holds it (every
    prefill rank's cache holds different seeded bytes, so this shows which was read)."""
    slices = tp.sources(decode.rank, decode_tp, prefill.tp_size, prefill.heads)
    for g, kind in enumerate(prefill.kinds):
        lo = window_lo(kind)
        off = req.first[g] * prefill.fmt.block_size
        got = read_group_token_major(decode.buffers, g, np.asarray(req.local[g]))
        for i, name in enumerate(decode.buffers.config.groups[g].layer_names):
            for s in slices:
                (src,) = [
                    c.buffers
                    for c in prefill.ranks
                    if c.rank == s.remote_rank and name in c.buffers.config.groups[g].layer_names
                ]
                j = src.config.groups[g].layer_names.index(name)
                want = read_group_token_major(src, g, np.asarray(req.remote[g]))
                a = got[i, :, lo:TOKENS, s.local_head : s.local_head + s.num_heads]
                b = want[j, :, lo - off : TOKENS - off, s.remote_head : s.remote_head + s.num_heads]
                assert a.equal(b), (decode.pp_rank, decode.rank, name, s)


# a hybrid model of 6 layers alternating its kinds (full attention 1, 3, 5; sliding
# window 0, 2, 4), split 2|4 on prefill and 3|3 on decode: decode's stage 0 shares only a
# sliding-window layer (2) with prefill's stage 1, and no full-attention one
ALTERNATING = ((1, 3, 5), (0, 2, 4))
SPLIT_24, SPLIT_33 = ((0, 2), (2, 6)), ((0, 3), (3, 6))

CASES = {
    # id: (prefill TP, prefill stages, decode TP, decode stages, formats, group layers)
    "pp2-to-pp1": (1, PP2, 1, (), (PREFILL_FMT, DECODE_FMT), None),
    "pp1-to-pp2": (1, (), 1, PP2, (PER_LAYER, DECODE_FMT), None),
    "pp2-to-pp2": (1, PP2, 1, PP2, (PREFILL_FMT, DECODE_FMT), None),
    "pp2tp2-to-pp1tp1": (2, PP2, 1, (), (PER_LAYER, DECODE_FMT), None),
    "hybrid-2|4-to-3|3": (1, SPLIT_24, 1, SPLIT_33, (PER_LAYER, DECODE_FMT), ALTERNATING),
    # the same, NHD prefill blocks rewritten for an HND decode: a stage reading one group
    # of a prefill stage must not claim the other group's blocks as they are, which
    # another decode stage has rewritten
    "hybrid-rewritten": (1, SPLIT_24, 1, SPLIT_33, (NHD_PER_LAYER, DECODE_FMT), ALTERNATING),
    # larger prefill pages through decode's staging slots, which the engine splits layer
    # by layer: a stage's pages must land in its own layers
    "packed-staged-pp2-to-pp1": (1, PP2, 1, (), (packed(64), packed(32)), None),
}


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_decode_layer_comes_from_the_prefill_stage_that_holds_it(setup, case, mode):
    ptp, pstages, dtp, dstages, formats, groups = CASES[case]
    prefill, decodes = setup(
        dtp, ptp, 2, mode, formats=formats, stages=(pstages, dstages), group_layers=groups
    )
    req = new_request(prefill, decodes[0].fmt, np.random.default_rng(1))
    send(prefill, req)
    spec = load_spec(prefill, req)
    load_all(prefill, decodes, spec, f"{case} {mode}: every decode rank loaded, prefill freed")
    assert all(not d.failed for d in decodes), [d.failed for d in decodes]
    for d in decodes:
        check_layers(prefill, d, dtp, req)


def _fail_naming_one_stage(prefill: Prefill, decode: DecodeRank, seed: int) -> str:
    """Load a request on ``decode`` with params that name only prefill's first stage (a
    proxy that dropped ``remote_pp_layers``); wait for the load to fail and return why."""
    req = new_request(prefill, decode.fmt, np.random.default_rng(seed))
    send(prefill, req)
    spec = load_spec(prefill, req)
    params = msgspec.structs.replace(
        spec.params, remote_pp_layers=[], remote_ports=prefill.ports[:1]
    )
    decode.load(dataclasses.replace(spec, params=params))
    pump([decode], prefill, lambda: bool(decode.failed), "the load to fail")
    assert spec.request_id not in decode.loaded
    (reason,) = decode.failed.values()
    return reason


def test_params_that_name_too_few_stages_fail_the_load_by_name(setup):
    """A prefill at PP 2 whose params claim one stage (a proxy that dropped
    ``remote_pp_layers``): decode reads stage 0 only, which holds layer 0 but not layer 1;
    the load fails naming the layers nothing moved, never reported loaded."""
    prefill, (decode,) = setup(1, 1, 2, formats=(PER_LAYER, DECODE_FMT), stages=(PP2, ()))
    reason = _fail_naming_one_stage(prefill, decode, seed=3)
    assert "no source moves layers ['g0.b'] of group 0" in reason, reason


def test_a_group_no_source_moves_fails_the_load_by_name(setup):
    """8 layers alternating their kinds, prefill split 4|4, decode 3|2|3; params that name
    only prefill's first stage. Decode's middle stage (layers 3-4) then reads full
    attention (layer 3) from it, and shares no sliding-window layer with it: layer 4 is
    moved by nobody, and the load fails naming it instead of being reported loaded."""
    prefill, decodes = setup(
        1,
        1,
        2,
        formats=(PER_LAYER, DECODE_FMT),
        stages=(((0, 4), (4, 8)), ((0, 3), (3, 5), (5, 8))),
        group_layers=((1, 3, 5, 7), (0, 2, 4, 6)),
    )
    reason = _fail_naming_one_stage(prefill, decodes[1], seed=4)  # the middle stage
    assert "no source moves layers ['g1.e'] of group 1" in reason, reason


def test_a_prefill_rank_read_by_two_decode_stages_frees_after_the_second_done(setup):
    """Prefill PP 1, decode PP 2: the one prefill rank holds both layers; it waits for the
    Done of each decode stage (engine ranks 0 and 1), not the first."""
    prefill, decodes = setup(1, 1, 2, formats=(PER_LAYER, DECODE_FMT), stages=((), PP2))
    req = new_request(prefill, decodes[0].fmt, np.random.default_rng(2))
    send(prefill, req)
    spec = load_spec(prefill, req)
    rid, (child,) = req.rid, prefill.ranks
    first, second = decodes
    first.load(spec)
    pump([first], prefill, lambda: spec.request_id in first.loaded or bool(first.failed), "stage 0")
    assert not first.failed, first.failed
    pump(
        [first],
        prefill,
        lambda: held(child, rid) == [0],
        "prefill to record stage 0's Done (engine rank 0)",
    )
    assert rid not in child.sent  # still held for stage 1
    second.load(spec)
    pump([first, second], prefill, lambda: rid in child.sent, "prefill to free after stage 1")
    assert not second.failed, second.failed
    assert held(child, rid) is None
    for d in decodes:
        check_layers(prefill, d, 1, req)
