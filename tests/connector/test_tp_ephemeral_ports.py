"""``kv_port`` 0 end to end with a prefill at TP 2: every rank binds an ephemeral port,
the scheduler advertises every rank's bound port in the params, and a decode reads from
both ranks through them.

The prefill ranks are OS processes (``_prefill_child.py``, real NIXL, each its own side
channel on an ephemeral port it reports); the scheduler is a real
:class:`KVBridgeScheduler` of that prefill engine, handed the ranks' ports the way the
example engine (same process) or the vLLM adapter (vLLM's handshake metadata) hand them
over. The params cross a JSON hop, as through the proxy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbridge.connector.common.metadata import LoadSpec
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.scheduler.advertised import PortsNotBoundError
from kvbridge.connector.scheduler.scheduler import KVBridgeScheduler
from kvbridge.handshake import tp
from kvbridge.layouts.groups import KVCacheConfig
from tests.connector.conftest import NUM_BLOCKS, new_id, transfer_config
from tests.connector.tp_cluster import TOKENS, Request, TPCluster, check_heads, load_all
from tests.handshake.plan_harness import make_groups

pytestmark = pytest.mark.integration

HEADS = 4  # prefill rank r holds heads 2r, 2r+1; the TP-1 decode reads both ranks


@dataclass(frozen=True)
class Prompt:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: KVTransferParams | None


@pytest.fixture
def setup(tmp_path: Path) -> Iterator:
    with TPCluster(tmp_path) as cluster:
        yield cluster.make


def test_kv_port_0_advertises_every_rank_and_decode_reads_both(setup) -> None:
    prefill, (decode,) = setup(1, 2, HEADS, kinds="F")
    assert all(port > 0 for port in prefill.ports)
    kv = KVCacheConfig.uniform(make_groups(prefill.fmt.block_size, "F", HEADS, 2), NUM_BLOCKS)
    sched = KVBridgeScheduler(
        transfer_config("kv_producer", prefill.engine_id, kv_port=0), kv, tp_size=2
    )
    blocks = [np.random.default_rng(7).permutation(NUM_BLOCKS)[: TOKENS // 16].tolist()]
    prompt = Prompt(new_id("req"), list(range(TOKENS)), KVTransferParams(do_remote_decode=True))

    # before the workers' ports reached the scheduler: no params, and nothing held
    with pytest.raises(PortsNotBoundError, match="kv_port is 0"):
        sched.request_finished(prompt, blocks)
    assert sched.num_held_sends == 0

    sched.set_side_channel_ports(prefill.ports)
    delay, signed = sched.request_finished(prompt, blocks)
    assert delay and signed is not None
    params = KVTransferParams.from_json(signed.to_json())  # the proxy's hop
    assert (params.remote_port, params.remote_ports) == (prefill.ports[0], prefill.ports)
    params.validate_for_load(1)

    # every rank keeps what the scheduler said; decode loads with the advertised params
    (send,) = sched.build_connector_meta().reqs_to_send
    for child in prefill.ranks:
        child.send(send.request_id, [list(ids) for ids in send.block_ids], list(send.first_block))
    local = [np.arange(-(-TOKENS // decode.fmt.block_size))]
    spec = LoadSpec(
        request_id=new_id("load"),
        params=params,
        local_block_ids=tuple(tuple(int(b) for b in ids) for ids in local),
        start_token=0,
        end_token=params.resume_tokens,
    )
    load_all(prefill, [decode], spec, "decode loaded from both ephemeral-port ranks")
    assert not decode.failed, decode.failed

    req = Request(
        params.remote_request_id,
        [np.asarray(ids) for ids in params.remote_block_ids],
        list(params.remote_first_block),
        local,
    )
    slices = tp.sources(0, 1, 2, HEADS)
    assert {s.remote_rank for s in slices} == {0, 1}
    check_heads(prefill, decode, slices, req, end=params.resume_tokens)
    assert decode.worker.metrics.handshakes == 2  # one per rank, each at its own port
    for child in prefill.ranks:
        assert child.digest() == child.replica_digest()
