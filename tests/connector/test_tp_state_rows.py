"""A state group across TP sizes as the load executes it: rows from the plan's streams.

A replicated state is read once per decode rank, from the first prefill rank it reads
heads from; the plan against any other prefill rank it reads heads from has no state
streams, and the load must treat that group as nothing to move there (no rows, and no
"blocks outside what the peer advertised" refusal).
"""

from __future__ import annotations

import numpy as np

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.decode.inflight import outside
from kvbridge.connector.worker.peers import Peer
from kvbridge.connector.worker.rows import group_rows
from kvbridge.handshake.plan import negotiate
from tests.handshake.plan_harness import cache_format, execute, make_side


def test_a_prefill_rank_whose_replicated_state_is_read_elsewhere_moves_no_state_rows():
    fmt = cache_format("NHD", False)
    local = make_side("d", 16, fmt, "FR", 8, rank=0, tp_size=1, total_kv_heads=4)
    p0, p1 = (make_side("p", 16, fmt, "FR", 8, rank=r, tp_size=2, total_kv_heads=4) for r in (0, 1))
    read, skipped = negotiate(local.layout, p0.layout), negotiate(local.layout, p1.layout)
    assert read.groups[1].streams and skipped.groups[1].streams == ()
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="p",
        remote_tp_size=2,
        remote_block_ids=[[1, 2, 3, 4], [5]],
        remote_first_block=[0, 3],
        remote_block_size=16,
        num_tokens=64,
    )
    peer = Peer(key=("p", 1), host="127.0.0.1", port=0, layout=p1.layout, plan=skipped)
    assert outside(params, peer) == ""
    spec = local.buffers.config.groups[1].spec
    rows = group_rows(skipped.groups[1], spec, np.arange(4), np.array([5]), 3, 0, 64)
    assert rows.num_descs == 0
    # the replica comes from prefill rank 0, byte for byte
    assert execute(read, local, p0, 1, np.array([0]), np.array([3]), np.array([5])) == 2
    for layer in local.buffers.config.groups[1].layer_names:
        for a, b in zip(
            local.buffers.state_views(layer), p0.buffers.state_views(layer), strict=True
        ):
            assert a[3].numpy().tobytes() == b[5].numpy().tobytes()
