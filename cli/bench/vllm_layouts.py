"""The layout kvbridge asks vLLM for vs vLLM's default: descriptors and load time.

Both sides hold what vLLM 0.32's own allocation code builds for a FlashAttention worker
in one layout (``kvbridge.examples.vllm.allocation``), registered through the adapter's
``register_kv_caches``; prefill ranks live in another OS process
(``kvbridge.examples.vllm.prefill_child``), decode ranks in this one; real NIXL moves
the bytes (pull). vLLM's prefill never rewrites its blocks (its prefix cache may read
them), so decode reads them where they are. Rows, both sides in one layout:

    LBNHC  vLLM's default preference when no connector asks (NHD per layer)
    LBHNC  what NixlConnector asks for (HND per layer)
    BHLNC  what kvbridge asks for (head-outer cross-layer)
    LHBNC  ROCm backends' preference (per layer, each head's blocks apart: one
           descriptor per (layer, head) run of consecutive blocks)

for each TP pair (prefill:decode). Timed: from binding the load on every decode rank
until decode rank 0 reports it loaded (the ranks load at once, in this process).
``descriptors``: what decode rank 0 posted for one request. Baseline, side by side: one
raw NIXL READ of one descriptor of decode rank 0's share of the bytes from the same
prefill process; ``x raw`` = raw time / load time. Every load is checked: decode rank 0's
heads equal the prefill heads kvbridge.handshake.tp.sources assigns it.

Run:  kvbridge bench vllm_layouts [--pairs 1:1,1:2,2:1] [--iterations 5]
          [--layers 16] [--tokens 1024] [--layouts LBNHC,LBHNC,BHLNC,LHBNC]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.connector.common.metadata import ConnectorMetadata, LoadSpec
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.nixl_engine import (
    NixlEngineConfig,
    NixlTransferEngine,
)
from kvbridge.connector.transfer.transport import wait_done
from kvbridge.examples.vllm.layout_peer import (
    SideSpec,
    bind,
    build_allocation,
    fill,
    tokens,
    worker_side,
)
from kvbridge.examples.vllm.prefill_host import PrefillHost
from kvbridge.handshake import tp
from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.description import parse_description
from kvbridge.handshake.messages import PROTOCOL_VERSION, MetadataRequest

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Setup:
    layers: int
    tokens: int
    heads: int = 8
    head_size: int = 128
    block_size: int = 16

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.block_size)

    def spec(self, layout: str, tp_size: int, rank: int = 0) -> SideSpec:
        return SideSpec(
            "FLASH_ATTN",
            layout,
            self.block_size,
            tp_size=tp_size,
            rank=rank,
            head_size=self.head_size,
            num_layers=self.layers,
            num_blocks=self.blocks + 2,  # block 0 is vLLM's null block
            total_heads=self.heads,
        )

    def share_bytes(self, decode_tp: int) -> int:
        """Decode rank 0's bytes of one request (fp16 K|V of its heads)."""
        heads = tp.rank_heads(0, decode_tp, self.heads).count
        return self.layers * self.blocks * self.block_size * heads * self.head_size * 2 * 2


def raw_read_s(host: PrefillHost, port: int, engine_id: str, nbytes: int, iters: int) -> float:
    """Median seconds of one NIXL READ of ``nbytes`` in one descriptor from the prefill
    process's first region (a head-outer cache: one region over every block)."""
    raw = NixlTransferEngine(NixlEngineConfig(agent_name=f"bench-raw-{uuid.uuid4().hex[:6]}"))
    import torch

    dst = torch.empty(nbytes, dtype=torch.uint8)
    try:
        raw.register([dst])
        request = MetadataRequest(
            protocol_version=PROTOCOL_VERSION,
            requester_engine_id="bench-raw",
            requester_rank=0,
            requester_agent_name=raw.agent_name,
            requester_nixl_metadata=raw.metadata(),
        )
        client = HandshakeClient(ClientConfig(timeout_s=5.0), request=request)
        try:
            desc = client.get(engine_id, 0, "127.0.0.1", port)
        finally:
            client.close()
        region = parse_description(desc).regions[0].region
        assert region.span_bytes >= nbytes, (region.span_bytes, nbytes)
        peer = raw.add_peer(desc.nixl_metadata)
        remote = raw.prep_remote(
            peer,
            np.array([[region.base_addr, nbytes, region.device_id]]),
            memory_kind=region.memory_kind,  # as the prefill described it (VRAM on a GPU)
        )
        local = raw.prep_local(np.array([[dst.data_ptr(), nbytes, 0]]))
        one = np.zeros(1, dtype=np.int64)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            handle = raw.read(local, one, remote, one)
            wait_done(raw, handle, timeout_s=TIMEOUT_S, poll_interval_s=0.0)
            times.append(time.perf_counter() - t0)
            raw.release(handle)
        return statistics.median(times)
    finally:
        raw.close()


def measure(host: PrefillHost, s: Setup, layout: str, ptp: int, dtp: int, iters: int):
    """(median load seconds, descriptors per load) for one row; checks every load."""
    engine_id = f"P-{uuid.uuid4().hex[:6]}"
    keys, ports, replicas = [], [], []
    for r in range(ptp):
        spec = s.spec(layout, ptp, r)
        key = f"{engine_id}-r{r}"
        ports.append(host.open_rank(key, asdict(spec), engine_id, "pull", seed=100 + r))
        replica = build_allocation(spec)
        fill(replica, 100 + r)
        keys.append(key)
        replicas.append(replica)
    decodes = []
    try:
        for r in range(dtp):
            spec = s.spec(layout, dtp, r)
            a = build_allocation(spec)
            decodes.append(
                (a, worker_side(spec, a, "kv_consumer", f"D-{uuid.uuid4().hex[:6]}", "pull"))
            )
        remote = list(range(1, s.blocks + 1))
        local = list(range(s.blocks, 0, -1))
        times, descs = [], []
        for _ in range(iters):
            rid = f"req-{uuid.uuid4().hex[:8]}"
            for key in keys:
                host.send(key, rid, [remote])
            load = LoadSpec(
                request_id=f"load-{uuid.uuid4().hex[:8]}",
                params=KVTransferParams(
                    do_remote_prefill=True,
                    remote_engine_id=engine_id,
                    remote_host="127.0.0.1",
                    remote_port=ports[0],
                    remote_ports=ports,
                    remote_rank=0,
                    remote_tp_size=ptp,
                    remote_block_ids=[remote],
                    remote_first_block=[0],
                    remote_block_size=s.block_size,
                    num_tokens=s.tokens,
                    remote_request_id=rid,
                ),
                local_block_ids=(tuple(local),),
                start_token=0,
                end_token=s.tokens,
            )
            posted = decodes[0][1].worker.metrics.descriptors_posted
            t0 = time.perf_counter()
            for _, side in decodes:
                bind(side, ConnectorMetadata(reqs_to_load=(load,)))
            done: set[int] = set()
            took = None
            deadline = time.monotonic() + TIMEOUT_S
            while len(done) < dtp or not all(rid in host.sent.get(k, set()) for k in keys):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{layout} {ptp}:{dtp}: load or free not seen")
                for i, (_, side) in enumerate(decodes):
                    if i in done:
                        continue
                    bind(side, ConnectorMetadata())
                    _, recving, failed = side.transfer_results()
                    if failed:
                        raise RuntimeError(f"{layout} {ptp}:{dtp}: load failed on rank {i}")
                    if load.request_id in recving:
                        done.add(i)
                        if i == 0:
                            took = time.perf_counter() - t0
                host.drain()
            times.append(took)
            descs.append(decodes[0][1].worker.metrics.descriptors_posted - posted)
            _check(decodes[0][0], replicas, s, dtp, ptp, remote, local)
        return statistics.median(times), int(statistics.median(descs))
    finally:
        for _, side in decodes:
            side.shutdown()
        for key in keys:
            host.close_rank(key)


def _check(decode, replicas, s: Setup, dtp: int, ptp: int, remote, local) -> None:
    got = tokens(decode, np.array(local))[:, : s.tokens]
    for sl in tp.sources(0, dtp, ptp, s.heads):
        want = tokens(replicas[sl.remote_rank], np.array(remote))[:, : s.tokens]
        a = got[:, :, sl.local_head : sl.local_head + sl.num_heads]
        b = want[:, :, sl.remote_head : sl.remote_head + sl.num_heads]
        if not a.equal(b):
            raise AssertionError(f"decode rank 0 heads differ from prefill's ({sl})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="1:1,1:2,2:1", help="prefill:decode TP sizes")
    ap.add_argument("--layouts", default="LBNHC,LBHNC,BHLNC,LHBNC")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    add_json_argument(ap)
    args = ap.parse_args(argv)
    s = Setup(layers=args.layers, tokens=args.tokens)
    log = Path(f"/tmp/bench-vllm-layouts-{uuid.uuid4().hex[:6]}.log")
    host = PrefillHost(log)
    rows = []
    try:
        # the raw baseline reads from a head-outer prefill (one region over every block)
        raw_id = f"P-raw-{uuid.uuid4().hex[:6]}"
        raw_spec = replace(s.spec("BHLNC", 1), num_blocks=s.blocks + 2)
        raw_port = host.open_rank("raw", asdict(raw_spec), raw_id, "pull", seed=1)
        print(
            f"vLLM FlashAttention caches, {s.layers} layers x {s.heads} KV heads x "
            f"{s.head_size} (fp16), {s.tokens} tokens in blocks of {s.block_size}; "
            f"median of {args.iterations}"
        )
        print(
            f"{'pair':>5} {'layout':>6} {'MiB':>6} {'descriptors':>11} {'load ms':>8} "
            f"{'raw ms':>7} {'x raw':>6}"
        )
        for pair in args.pairs.split(","):
            ptp, dtp = (int(x) for x in pair.split(":"))
            nbytes = s.share_bytes(dtp)
            for layout in args.layouts.split(","):
                raw = raw_read_s(host, raw_port, raw_id, nbytes, args.iterations)
                took, descs = measure(host, s, layout, ptp, dtp, args.iterations)
                print(
                    f"{pair:>5} {layout:>6} {nbytes / 2**20:6.1f} {descs:11d} "
                    f"{took * 1e3:8.2f} {raw * 1e3:7.2f} {raw / took:6.2f}",
                    flush=True,
                )
                rows.append(
                    {
                        "pair": pair,
                        "layout": layout,
                        "bytes": nbytes,
                        "descriptors": descs,
                        "load_ms": took * 1e3,
                        "raw_ms": raw * 1e3,
                        "x_raw": raw / took,
                    }
                )
        host.close_rank("raw")
    finally:
        host.close()
    write_json(args.json, "bench_vllm_layouts", rows, setup=asdict(s), pairs=args.pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
