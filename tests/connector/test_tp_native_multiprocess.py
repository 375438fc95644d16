"""Different TP sizes where prefill may not rewrite its blocks (vLLM on a GPU: its prefix
cache may read a block while decode reads it), across OS processes with real NIXL.

Each decode rank reads its head slice where prefill keeps it: with HND blocks one run per
(layer, K|V, block, source rank), so prefill's bytes are never touched, and decode
rewrites its own blocks once every source rank's heads are in. Checked byte for byte
against the prefill heads :func:`kvbridge.handshake.tp.sources` assigns.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbridge.handshake import tp
from kvbridge.layouts.layout import KVLayout
from tests.connector.conftest import SideFormat
from tests.connector.tp_cluster import (
    TOKENS,
    TPCluster,
    check_heads,
    load_all,
    load_spec,
    new_request,
    send,
    window_lo,
)

# 64-token HND blocks: one head of one (layer, K|V) block part is 64 x 4 x 2 B = 512 B,
# the smallest piece the worker posts when it reads a sender natively.
PREFILL = SideFormat(block_size=64, layout=KVLayout.HND)
DECODES = {
    "b64-NHD-k16": SideFormat(block_size=64, layout=KVLayout.NHD, kernel_block_size=16),
    "b128-HND": SideFormat(block_size=128, layout=KVLayout.HND),
}
KINDS = "FS"


@pytest.fixture
def setup(tmp_path: Path) -> Iterator:
    with TPCluster(tmp_path) as cluster:
        yield cluster.make


def _descriptors(decode: SideFormat, num_sources: int) -> int:
    """One per (layer, K|V, 64-token prefill block, source rank) the load touches: the
    full group reads blocks 0..1 (tokens 0..95), the window (tokens 72..95) block 1."""
    blocks = sum(-(-TOKENS // 64) - window_lo(k) // 64 for k in KINDS)
    return num_sources * 2 * 2 * blocks  # 2 layers per group x K, V


@pytest.mark.parametrize("decode_fmt", sorted(DECODES))
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    ("decode_tp", "prefill_tp", "heads"),
    [(2, 1, 4), (1, 2, 4), (4, 2, 4), (1, 4, 2)],  # (1, 4, 2): GQA replicas on prefill
)
def test_each_decode_rank_reads_its_heads_from_a_prefill_that_does_not_rewrite(
    setup, decode_tp, prefill_tp, heads, mode, decode_fmt
):
    fmt = DECODES[decode_fmt]
    prefill, decodes = setup(
        decode_tp,
        prefill_tp,
        heads,
        mode,
        KINDS,
        (PREFILL, fmt),
        prefill_rewrites=False,
    )
    req = new_request(prefill, fmt, np.random.default_rng(decode_tp * 10 + prefill_tp))
    send(prefill, req)
    spec = load_spec(prefill, req)
    load_all(prefill, decodes, spec, "every decode rank loaded, every prefill rank freed")
    for d in decodes:
        assert not d.failed, d.failed
        slices = tp.sources(d.rank, decode_tp, prefill_tp, heads)
        check_heads(prefill, d, slices, req)
        if mode == "pull":
            assert d.worker.metrics.descriptors_posted == _descriptors(fmt, len(slices))
        else:
            assert d.worker.metrics.descriptors_posted == 0  # prefill wrote them
    for child in prefill.ranks:
        assert req.rid in child.sent  # freed after its last reader
        assert child.digest() == child.replica_digest()  # bytes as the engine left them
