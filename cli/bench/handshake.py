"""Handshake benchmark: latency over loopback (fetch + NIXL add_remote_agent) and throughput.

A spawned child process plays the prefill worker: one NIXL agent, a HandshakeListener that
publishes its metadata. This process plays decode:

    latency:    N x [ fetch() -> add_remote_agent(metadata) ]  (remove_remote_agent untimed)
    throughput: C threads, each with its own HandshakeClient, fetch() as fast as they can

Run:  kvbridge bench handshake [--iterations 500] [--clients 50]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from nixl._api import nixl_agent, nixl_agent_config

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.handshake import (
    PROTOCOL_VERSION,
    ClientConfig,
    HandshakeClient,
    HandshakeListener,
    HandshakeSecurity,
    ListenerConfig,
    WireGroup,
    WireRegion,
    WireSpec,
    WorkerDescription,
    encode,
)

NUM_LAYERS = 32
BLOCK_BYTES = 2 * 16 * 8 * 128 * 2  # K+V, 16 tokens, 8 heads, head 128, fp16
NUM_BLOCKS = 4096
SECRET = b"bench-secret-0123456789abcdef"


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    iterations: int
    warmup: int
    clients: int
    per_client: int
    secret: bytes | None


def make_agent(name: str) -> nixl_agent:
    # No progress thread: it would spin a core (NIXL_NOTES.md); the handshake needs none.
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def describe(agent_name: str, metadata: bytes, port: int) -> WorkerDescription:
    spec = WireSpec(
        kind="full_attention", block_size=16, num_kv_heads=8, head_size=128, dtype="float16"
    )
    regions = [
        WireRegion(
            name=f"layers.{layer}",
            base_addr=0x7F00_0000_0000 + layer * BLOCK_BYTES * NUM_BLOCKS,
            block_bytes=BLOCK_BYTES,
            block_stride_bytes=BLOCK_BYTES,
            num_blocks=NUM_BLOCKS,
            memory_kind="DRAM",
            group_id=0,
            layer_index=layer,
        )
        for layer in range(NUM_LAYERS)
    ]
    return WorkerDescription(
        protocol_version=PROTOCOL_VERSION,
        engine_id="bench-prefill",
        agent_name=agent_name,
        rank=0,
        tp_size=1,
        model_name="bench-model",
        dtype="float16",
        num_layers=NUM_LAYERS,
        num_kv_heads=8,
        head_size=128,
        compat_hash="bench",
        block_size=16,
        kernel_block_size=16,
        kv_layout="NHD",
        kv_packing="blocks_first",
        cross_layer=False,
        groups=[WireGroup(0, [f"layers.{i}" for i in range(NUM_LAYERS)], spec)],
        regions=regions,
        nixl_metadata=metadata,
        side_channel_host="127.0.0.1",
        side_channel_port=port,
    )


def serve(conn: Connection, secret: bytes | None) -> None:
    """Child process: a prefill-side NIXL agent and a listener publishing its metadata."""
    agent_name = f"bench-prefill-{os.getpid()}"
    agent = make_agent(agent_name)
    config = ListenerConfig(port=0, security=HandshakeSecurity(secret=secret))
    holder: list[WorkerDescription] = []
    with HandshakeListener(config, lambda: holder[0]) as listener:
        holder.append(describe(agent_name, agent.get_agent_metadata(), listener.port))
        conn.send(listener.port)
        conn.recv()  # any message (or EOF) means stop
    del agent


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_latency(port: int, cfg: BenchConfig) -> dict[str, list[float]]:
    agent = make_agent(f"bench-decode-{os.getpid()}")
    security = HandshakeSecurity(secret=cfg.secret)
    times: dict[str, list[float]] = {"fetch": [], "add_remote_agent": [], "total": []}
    with HandshakeClient(ClientConfig(security=security)) as client:
        for i in range(cfg.warmup + cfg.iterations):
            t0 = time.perf_counter()
            description = client.fetch("127.0.0.1", port)
            t1 = time.perf_counter()
            name = agent.add_remote_agent(description.nixl_metadata)
            t2 = time.perf_counter()
            agent.remove_remote_agent(name)
            if i >= cfg.warmup:
                times["fetch"].append(t1 - t0)
                times["add_remote_agent"].append(t2 - t1)
                times["total"].append(t2 - t0)
    return times


def bench_throughput(port: int, cfg: BenchConfig) -> float:
    security = HandshakeSecurity(secret=cfg.secret)
    barrier = threading.Barrier(cfg.clients + 1)
    failures: list[BaseException] = []

    def run() -> None:
        with HandshakeClient(ClientConfig(timeout_s=10.0, security=security)) as client:
            barrier.wait()
            try:
                for _ in range(cfg.per_client):
                    client.fetch("127.0.0.1", port)
            except BaseException as exc:
                failures.append(exc)

    threads = [threading.Thread(target=run) for _ in range(cfg.clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise failures[0]
    return cfg.clients * cfg.per_client / elapsed


def run_mode(cfg: BenchConfig) -> tuple[dict[str, list[float]], float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(child, cfg.secret), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise TimeoutError("bench listener process did not start within 60 s")
        port = parent.recv()
        return bench_latency(port, cfg), bench_throughput(port, cfg)
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--per-client", type=int, default=40)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    size = len(encode(describe("bench-prefill-0", b"\x00" * 331, 5600)))
    print(f"description: {NUM_LAYERS} regions, ~{size} bytes on the wire; N={args.iterations}")
    print(f"{'auth':<6} {'what':<18} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    rates, rows = [], []
    for label, secret in (("none", None), ("hmac", SECRET)):
        cfg = BenchConfig(
            iterations=args.iterations,
            warmup=args.warmup,
            clients=args.clients,
            per_client=args.per_client,
            secret=secret,
        )
        times, rate = run_mode(cfg)
        for what, samples in times.items():
            p50, p99 = percentile(samples, 0.50) * 1e3, percentile(samples, 0.99) * 1e3
            mean = statistics.fmean(samples) * 1e3
            print(f"{label:<6} {what:<18} {p50:8.3f} {p99:8.3f} {mean:8.3f}")
            rows.append(
                {"auth": label, "what": what, "p50_ms": p50, "p99_ms": p99, "mean_ms": mean}
            )
        rates.append((label, rate))
    for label, rate in rates:
        print(f"{label:<6} throughput, {args.clients} concurrent clients: {rate:,.0f} handshakes/s")
        rows.append({"auth": label, "what": "throughput", "handshakes_per_s": rate})
    write_json(args.json, "bench_handshake", rows, **vars(args) | {"json": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
