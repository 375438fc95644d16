"""The baselines ``kvbridge bench transfer`` sets loads against: one raw NIXL READ and WRITE
of the same bytes between the prefill child's cache and ours, a torch ``copy_`` of them in
one process, and ``extra.verify``'s digest on its own against a copy."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

from kvbridge.cli.bench import transfer_child
from kvbridge.cli.bench.transfer_child import TIMEOUT_S, Child
from kvbridge.cli.bench.transfer_loads import Row, median_s
from kvbridge.cli.bench.transfer_shape import Shape
from kvbridge.connector.transfer.nixl_engine import NixlEngineConfig, NixlTransferEngine
from kvbridge.connector.transfer.transport import wait_done
from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.description import parse_description
from kvbridge.handshake.messages import PROTOCOL_VERSION, MetadataRequest
from kvbridge.layouts.allocation import KVCacheBuffers


def measure_raw(
    child: Child, decode: KVCacheBuffers, shape: Shape, iterations: int, nbytes: int | None = None
) -> tuple[Row, Row, Row]:
    """One READ of one descriptor (the child's cross-layer buffer -> ours), then one WRITE
    (ours -> the child's), same bytes. The WRITE overwrites the child's cache: run last.
    ``nbytes``: how many bytes (default: the whole request, ``shape.request_bytes``); the
    child must be rank 0 of its engine."""
    raw = NixlTransferEngine(NixlEngineConfig(agent_name=f"bench-raw-{uuid.uuid4().hex[:6]}"))
    try:
        dst = decode.tensors[0]
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
            desc = client.get(child.engine_id, 0, transfer_child.PREFILL_HOST, child.port)
        finally:
            client.close()
        region = parse_description(desc).regions[0].region
        if nbytes is None:
            nbytes = shape.request_bytes
            assert region.block_bytes * shape.blocks_per_request == nbytes, "cross-layer region"
        assert nbytes <= min(region.span_bytes, dst.numel() * dst.element_size()), nbytes
        peer = raw.add_peer(desc.nixl_metadata)
        # the prefill's memory as it described it: a VRAM region prepared as DRAM has no
        # backend to move it (NIXL_ERR_NOT_FOUND on a GPU)
        remote = raw.prep_remote(
            peer,
            np.array([[region.base_addr, nbytes, region.device_id]]),
            memory_kind=region.memory_kind,
        )
        device_id = dst.device.index or 0
        local = raw.prep_local(np.array([[dst.data_ptr(), nbytes, device_id]]))
        one = np.zeros(1, dtype=np.int64)

        def once(post) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                handle = post(local, one, remote, one)
                wait_done(raw, handle, timeout_s=TIMEOUT_S, poll_interval_s=0.0)
                took = time.perf_counter() - t0
                raw.release(handle)
                return took

            return run

        read_once, write_once = once(raw.read), once(raw.write)
        read_once()  # connection wire-up
        nixl_row = Row("raw NIXL READ, 1 descriptor", 1, median_s(read_once, iterations))
        write_once()
        write_row = Row("raw NIXL WRITE, 1 descriptor", 1, median_s(write_once, iterations))
    finally:
        raw.close()
    src = torch.empty(nbytes, dtype=torch.uint8, device=dst.device).fill_(7)
    out = torch.empty_like(src)

    def copy_once() -> float:
        sync()
        t0 = time.perf_counter()
        out.copy_(src)
        sync()  # GPU copies are asynchronous: time them to the end
        return time.perf_counter() - t0

    def sync() -> None:
        if src.is_cuda:
            torch.cuda.synchronize(src.device)

    copy_once()
    where = str(src.device) if src.is_cuda else f"{torch.get_num_threads()} threads"
    torch_row = Row(f"torch copy_ in one process ({where})", "-", median_s(copy_once, 5))
    return nixl_row, write_row, torch_row


DIGEST_SIZES_MIB = (1, 32, 256)
DIGEST_BLOCK_BYTES = 256 << 10  # one cross-layer block of the digest rows (a 2-token block)


def measure_digest(device: str, iterations: int) -> list[dict]:
    """``extra.verify``'s cost on its own: the digest of a request's rows (a cross-layer
    block each, ``layouts.digest.row_sums`` + ``fold``) against ``copy_`` of the same
    bytes on the same device, at 1, 32 and 256 MiB; blocks contiguous (one strided
    reduction) and shuffled (run by run)."""
    out = []
    for mib in DIGEST_SIZES_MIB:
        n = max(1, (mib << 20) // DIGEST_BLOCK_BYTES)
        units = torch.randint(0, 256, (2 * n + 16, DIGEST_BLOCK_BYTES), dtype=torch.uint8)
        units = units.to(device)
        copy_s = median_s(_timed(units, _copy_of(units[:n].reshape(-1))), iterations)
        shuffled = np.random.default_rng(0).permutation(units.shape[0])[:n]
        for order, rows in (("contiguous", np.arange(n)), ("shuffled", shuffled)):
            digest_s = median_s(_timed(units, _digest_of(units, rows)), iterations)
            out.append(
                {
                    "mib": n * DIGEST_BLOCK_BYTES / 2**20,
                    "order": order,
                    "digest_ms": digest_s * 1e3,
                    "copy_ms": copy_s * 1e3,
                    "digest_gbps": n * DIGEST_BLOCK_BYTES / digest_s / 1e9,
                    "x_copy": copy_s / digest_s,
                }
            )
    return out


def _copy_of(src: torch.Tensor) -> Callable[[], object]:
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _digest_of(units: torch.Tensor, rows: np.ndarray) -> Callable[[], object]:
    from kvbridge.layouts.digest import fold, row_sums

    offsets = np.zeros(1, dtype=np.int64)
    return lambda: fold(row_sums(units, offsets, DIGEST_BLOCK_BYTES, rows))


def _timed(on: torch.Tensor, fn: Callable[[], object]) -> Callable[[], float]:
    """``fn``'s time, the device's queue drained before and after (GPU work is async)."""

    def sync() -> None:
        if on.is_cuda:
            torch.cuda.synchronize(on.device)

    def run() -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    return run


def print_digest(records: list[dict], device: str) -> None:
    print(f"\ndigest (extra.verify) vs copy_ of the same bytes, {device}:")
    header = f"{'MiB':>6} {'blocks':<11} {'digest ms':>10} {'copy ms':>9} {'GB/s':>7} {'x copy':>7}"
    print(header)
    print("-" * len(header))
    for r in records:
        print(
            f"{r['mib']:6.0f} {r['order']:<11} {r['digest_ms']:10.2f} {r['copy_ms']:9.2f} "
            f"{r['digest_gbps']:7.2f} {r['x_copy']:7.2f}"
        )
    print("x copy = copy time / digest time (>= 0.5: the digest reads as fast as half a copy)")
