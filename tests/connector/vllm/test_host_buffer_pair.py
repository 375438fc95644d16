"""``kv_buffer_device: "cpu"`` end to end: two staged vLLM workers, real NIXL between
their host mirrors, vLLM's copy operation recorded on both sides.

Prefill runs in its own OS process (``_staged_prefill.py``), decode in the test's; each
holds what vLLM's allocation code builds (or K|V-split tensors vLLM's operation cannot
index), registered through the adapter and staged through a host mirror. The cache is
in host memory here, so staging is forced; vLLM's ``copy_kv_blocks`` runs with the CUDA
platform's block copies (``vllm_copy_ops``). Every token's K|V of every head on decode
must equal prefill's, and the recorded calls show which copies moved them: d2h of the
request's blocks on prefill when the request is kept (after save), h2d of the loaded
blocks on decode before the load is reported; none for a layout vLLM's operation cannot
copy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbridge.connector.common.metadata import ConnectorMetadata, LoadSpec
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.vllm.step_metadata import KVBridgeMetadata
from kvbridge.connector.vllm.worker_side import VLLMWorkerSide
from kvbridge.examples.vllm.layout_peer import NUM_BLOCKS, SideSpec
from kvbridge.examples.vllm.prefill_host import EVENT_TIMEOUT_S, PrefillHost
from tests.connector.conftest import new_id
from tests.connector.vllm.staged_peer import StagedCache, StagedSpec, staged_cache, staged_side
from tests.connector.vllm.vllm_copy_ops import CopyCall, RecordingCopyOp

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

TOKENS = 120  # not a multiple of any block size: the last block is partial
FA = "FLASH_ATTN"
CHILD = "tests.connector.vllm._staged_prefill"  # the staged prefill process
REPO = Path(__file__).resolve().parents[3]

# (prefill, decode, mode): layouts, block sizes, pull and push; vLLM's copies or kvbridge's
CASES = [
    (StagedSpec(SideSpec(FA, "BLHNC", 16)), StagedSpec(SideSpec(FA, "LBHNC", 32)), "pull"),
    (StagedSpec(SideSpec(FA, "BHLNC", 32)), StagedSpec(SideSpec(FA, "LBHNC", 16)), "push"),
    # K|V-split tensors (dim 0 is K or V, not a block) on both sides, whose K|V layout
    # must match: kvbridge's copies, no call to vLLM's operation
    (
        StagedSpec(SideSpec(FA, "LBHNC", 32), split=True),
        StagedSpec(SideSpec(FA, "LBHNC", 16), split=True),
        "pull",
    ),
    (
        StagedSpec(SideSpec(FA, "LBHNC", 16), split=True),
        StagedSpec(SideSpec(FA, "LBHNC", 16), split=True),
        "push",
    ),
]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillHost]:
    h = PrefillHost(tmp_path_factory.mktemp("staged-prefill") / "prefill.log", CHILD, REPO)
    try:
        yield h
    finally:
        h.close()


def _kernel_ids(cache: StagedCache, block_ids: np.ndarray) -> list[int]:
    """The ids vLLM's operation indexes (dim 0) for manager blocks ``block_ids``."""
    view = next(iter(cache.allocation.kv_caches.values()))
    r = view.shape[0] // NUM_BLOCKS
    return (np.sort(block_ids)[:, None] * r + np.arange(r)).reshape(-1).tolist()


def _kernel_block_bytes(cache: StagedCache) -> int:
    """Bytes of one kernel block, all layers (vLLM's views: one index of dim 0)."""
    views = cache.allocation.kv_caches.values()
    return sum(v[0].numel() * v.element_size() for v in views)


def _calls(host: PrefillHost, key: str) -> dict:
    host.command(cmd="calls", key=key)
    return host.wait_for("calls")


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{p.label()}-to-{d.label()}-{m}" for p, d, m in CASES]
)
def test_staged_pair_moves_every_token_through_the_chosen_copies(host, case) -> None:
    pspec, dspec, mode = case
    engine_id, key = new_id("P"), new_id("k")
    port = host.open_rank(key, pspec.to_dict(), engine_id, mode, seed=1000)
    replica = staged_cache(pspec, 1000)  # prefill's bytes, rebuilt from the seed
    decode_cache = staged_cache(dspec, 5)  # stale bytes the load must overwrite
    decode, op = staged_side(decode_cache, "kv_consumer", new_id("D"), mode)
    try:
        rng = np.random.default_rng(7)
        remote = rng.permutation(np.arange(1, NUM_BLOCKS))[: -(-TOKENS // pspec.side.block_size)]
        local = rng.permutation(np.arange(1, NUM_BLOCKS))[: -(-TOKENS // dspec.side.block_size)]
        rid = new_id("req")
        host.send(key, rid, [remote.tolist()])

        # prefill: the request's blocks went to its mirror when it was kept (after save)
        prefill_calls = _calls(host, key)
        assert prefill_calls["path"] == ("kvbridge" if pspec.split else "vllm")
        want = [] if pspec.split else [["d2h", _kernel_ids(replica, remote)]]
        assert prefill_calls["calls"] == want

        assert decode.host_copy_path == ("kvbridge" if dspec.split else "vllm")
        assert op.calls == []  # nothing is copied before a load
        load = _load(engine_id, port, pspec, rid, remote, local)
        decode.bind(KVBridgeMetadata(ConnectorMetadata(reqs_to_load=(load,))))
        decode.start_load_kv()
        calls_at_load = _wait_loaded(host, decode, op, key, rid, load.request_id)

        # decode: the loaded blocks went from the mirror to the cache before the load was
        # reported, in one h2d call; nothing went the other way
        if dspec.split:
            assert calls_at_load == []
        else:
            assert [(c.direction, list(c.src_block_ids)) for c in calls_at_load] == [
                ("h2d", _kernel_ids(decode_cache, local))
            ]
            assert calls_at_load[0].src_block_ids == calls_at_load[0].dst_block_ids
        assert op.calls == calls_at_load
        moved = len(_kernel_ids(decode_cache, local)) * _kernel_block_bytes(decode_cache)
        assert decode.worker.metrics.staged_to_device_bytes == moved
        got = decode_cache.tokens(local)[:, :TOKENS]
        assert got.equal(replica.tokens(remote)[:, :TOKENS])
        assert _calls(host, key)["calls"] == want  # reads take no copies on prefill
    finally:
        decode.shutdown()
        host.close_rank(key)


def _load(
    engine_id: str,
    port: int,
    pspec: StagedSpec,
    rid: str,
    remote: np.ndarray,
    local: np.ndarray,
) -> LoadSpec:
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=engine_id,
        remote_host="127.0.0.1",
        remote_port=port,
        remote_block_ids=[remote.tolist()],
        remote_first_block=[0],
        remote_block_size=pspec.side.block_size,
        num_tokens=TOKENS,
        remote_request_id=rid,
    )
    return LoadSpec(
        request_id=new_id("load"),
        params=params,
        local_block_ids=(tuple(int(b) for b in local),),
        start_token=0,
        end_token=TOKENS,
    )


def _wait_loaded(
    host: PrefillHost, decode: VLLMWorkerSide, op: RecordingCopyOp, key: str, rid: str, load_id: str
) -> list[CopyCall]:
    """Drive decode until its load is reported and prefill freed the request; the copy
    calls decode had made when the load was reported."""
    calls_at_load = None
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while calls_at_load is None or rid not in host.sent.get(key, set()):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {EVENT_TIMEOUT_S} s waiting for decode to load and prefill "
                f"to free {rid} (loaded: {calls_at_load is not None}, sent: {host.sent})"
            )
        decode.bind(KVBridgeMetadata(ConnectorMetadata()))
        decode.start_load_kv()
        _, recving, failed = decode.transfer_results()
        assert not failed, decode.worker.get_finished()
        if load_id in recving and calls_at_load is None:
            calls_at_load = list(op.calls)
        host.drain()
    return calls_at_load
