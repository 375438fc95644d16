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

from collections.abc import Iterator
from pathlib import Path

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
    pump,
    send,
    window_lo,
)

pytestmark = pytest.mark.integration

PP2 = ((0, 1), (1, 2))  # model layers [first, end) of stage 0 and stage 1
PER_LAYER = SideFormat(block_size=16, layout=KVLayout.HND)  # a prefill read in part


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


CASES = {
    # id: (prefill TP, prefill stages, decode TP, decode stages, formats)
    "pp2-to-pp1": (1, PP2, 1, (), (PREFILL_FMT, DECODE_FMT)),
    "pp1-to-pp2": (1, (), 1, PP2, (PER_LAYER, DECODE_FMT)),
    "pp2-to-pp2": (1, PP2, 1, PP2, (PREFILL_FMT, DECODE_FMT)),
    "pp2tp2-to-pp1tp1": (2, PP2, 1, (), (PER_LAYER, DECODE_FMT)),
}


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_decode_layer_comes_from_the_prefill_stage_that_holds_it(setup, case, mode):
    ptp, pstages, dtp, dstages, formats = CASES[case]
    prefill, decodes = setup(dtp, ptp, 2, mode, formats=formats, stages=(pstages, dstages))
    req = new_request(prefill, decodes[0].fmt, np.random.default_rng(1))
    send(prefill, req)
    spec = load_spec(prefill, req)
    load_all(prefill, decodes, spec, f"{case} {mode}: every decode rank loaded, prefill freed")
    assert all(not d.failed for d in decodes), [d.failed for d in decodes]
    for d in decodes:
        check_layers(prefill, d, dtp, req)


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
