"""Engine-packed pages across TP sizes and block sizes, as OS processes with real NIXL.

The pages are the test engine's (``tests/connector/packed_engine``) in vLLM 0.32's shape,
``[heads x block_size x (K | V)]``: each head one run, so a decode rank reads its heads
of a prefill page as one descriptor, but tokens cannot be cut out by byte ranges. When
prefill's blocks are larger than decode's (or do not divide them) every page is staged
whole and decode's engine writes the tokens into its blocks. With prefill TP larger than
decode's, a decode rank's heads come from several prefill ranks: each rank's pages are
staged on their own and the engine writes only that rank's heads of each token. Every
decode rank ends up holding, byte for byte, the heads :func:`kvbridge.handshake.tp.sources` assigns
it, and every prefill rank frees the request after its readers' ``Done``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbridge.handshake import tp
from tests.connector.tp_cluster import (
    KINDS,
    TOKENS,
    TPCluster,
    check_heads,
    load_all,
    load_spec,
    new_request,
    packed,
    send,
    window_lo,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def setup(tmp_path: Path) -> Iterator:
    with TPCluster(tmp_path) as cluster:
        yield cluster.make


def _pages(block_size: int) -> int:
    """Prefill pages a load reads per layer over the groups: the full group all of them,
    the sliding window those holding its last 24 tokens."""
    return sum(-(-TOKENS // block_size) - window_lo(k) // block_size for k in KINDS)


@pytest.mark.parametrize(
    ("decode_tp", "prefill_tp", "heads", "b_decode", "b_prefill", "mode"),
    [
        (1, 2, 4, 32, 64, "pull"),  # staged: heads 0-1 from rank 0, 2-3 from rank 1
        (1, 4, 4, 32, 64, "pull"),  # staged from four ranks, one head each
        (2, 4, 4, 32, 64, "pull"),
        (1, 4, 2, 32, 64, "pull"),  # GQA: prefill ranks 0,1 and 2,3 are replicas
        (1, 2, 4, 64, 96, "pull"),  # neither size divides the other
        (1, 2, 4, 32, 64, "push"),  # each prefill rank WRITEs its heads into decode's slots
        (2, 1, 4, 32, 64, "pull"),  # one source per decode rank, half of its heads
        (1, 2, 4, 64, 32, "pull"),  # smaller prefill pages land side by side and merge
    ],
)
def test_decode_ranks_get_their_heads_from_packed_pages(
    setup, decode_tp, prefill_tp, heads, b_decode, b_prefill, mode
):
    prefill, decodes = setup(
        decode_tp, prefill_tp, heads, mode, formats=(packed(b_prefill), packed(b_decode))
    )
    req = new_request(prefill, decodes[0].fmt, np.random.default_rng(b_prefill + prefill_tp))
    send(prefill, req)
    spec = load_spec(prefill, req)
    load_all(prefill, decodes, spec, "every decode rank loaded, every prefill rank freed")
    for d in decodes:
        assert not d.failed, d.failed
        slices = tp.sources(d.rank, decode_tp, prefill_tp, heads)
        check_heads(prefill, d, slices, req)
        if mode == "pull":  # one descriptor per (prefill page, layer, source rank)
            assert d.worker.metrics.descriptors_posted == len(slices) * 2 * _pages(b_prefill)
        else:
            assert d.worker.metrics.descriptors_posted == 0
        if b_prefill > b_decode or b_decode % b_prefill:
            assert d.worker.metrics.staging_rounds >= len(slices) * len(KINDS)
    for child in prefill.ranks:
        assert req.rid in child.sent
        assert child.digest() == child.replica_digest()  # packed pages are never rewritten
