"""End-to-end benchmark: paired prefill/decode servers (pull and push) vs the same engine
in one process, through real HTTP and real NIXL.

For each configuration this starts real server processes (``kvbridge.examples.launch``: prefill
block 32, decode block 16, and vllm-router; or one server with no connector) and sends
requests of ``--lengths`` prompt tokens at each ``--concurrency``, every prompt unique
(no prefix-cache hits), ``max_tokens=1``: the answer is the first token, so the client's
time is the time to first token (TTFT)::

    single   client -> server: prefill + first token
    pull     client -> router -> prefill (max_tokens=1) -> decode: handshake once, Prepare
             if a rewrite is due, READ, first token
    push     ... -> decode: Push, prefill WRITEs, Pushed, first token

Per point it prints TTFT p50/p90 per configuration and, from the servers' /metrics, the
mean transfer time per load (decode: post to done), bytes and descriptors per request.
"overhead" = TTFT p50 (P/D) - TTFT p50 (single) - mean transfer: what the handover costs
beyond moving the bytes (the router's second request, decode scheduling, notifications,
polling). One warm-up request per configuration first (handshake, NIXL connection).

Run:  kvbridge bench e2e [--lengths 128,512,2048] [--concurrency 1,4,16]
      [--device cuda]    (every server's weights and KV cache; default cpu)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.examples.device import DeviceError, add_device_argument, parse_device
from kvbridge.examples.launch import Cluster, Proc

TIMEOUT_S = 120.0
PHASES = ("peer", "prepare", "data", "finish")


@dataclass
class Point:
    ttft_s: list[float]
    transfer_ms: float = 0.0  # mean per load (decode's transfer_seconds / transfers)
    bytes_per_req: float = 0.0
    descs_per_req: float = 0.0
    # decode's mean ms per load in each phase (kvbridge.connector.worker.decode.inflight)
    phases_ms: dict[str, float] = field(default_factory=dict)

    def p(self, q: float) -> float:
        values = sorted(self.ttft_s)
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3

    @property
    def p50(self) -> float:
        return statistics.median(self.ttft_s) * 1e3


class Target:
    """Where requests go: the router of a P/D pair, or one server; its /metrics sources."""

    def __init__(self, name: str, url: str, procs: list[Proc], closer) -> None:
        self.name, self.url, self.procs, self._close = name, url, procs, closer

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for proc in self.procs:
            for key, value in proc.metrics().items():
                out[key] = out.get(key, 0.0) + value
        return out

    def close(self) -> None:
        self._close()


def start_pair(mode: str, model: str, num_blocks: int, device: torch.device, logs: Path) -> Target:
    extra = {"extra": {"transfer_mode": mode}}
    args = ["--num-blocks", str(num_blocks), "--max-num-seqs", "64"]
    cluster = Cluster(
        logs / mode,
        prefill_kv={"engine_id": f"prefill-{mode}", "lease_s": 120, **extra},
        decode_kv={"engine_id": f"decode-{mode}", "handshake_timeout_s": 5.0, **extra},
        decode_args=args,
        prefill_args=args,
        model=model,
        device=device,
    )
    (logs / mode).mkdir(parents=True, exist_ok=True)
    try:
        cluster.start()
    except BaseException:
        cluster.close()
        raise
    return Target(
        mode, cluster["router"].url, [cluster["decode"], cluster["prefill"]], cluster.close
    )


def start_single(model: str, num_blocks: int, device: torch.device, logs: Path) -> Target:
    argv = [
        sys.executable,
        "-m",
        "kvbridge.examples.server",
        "--port",
        "0",  # the bound port comes back in the ready file (Proc.wait_ready)
        "--role",
        "both",
        "--model",
        model,
        "--block-size",
        "16",
        "--num-blocks",
        str(num_blocks),
        "--max-num-seqs",
        "64",
        "--device",
        str(device),
    ]
    logs.mkdir(parents=True, exist_ok=True)
    proc = Proc("single", argv, logs / "single.log")
    proc.start()
    try:
        proc.wait_healthy()
    except BaseException:
        proc.kill()
        raise
    return Target("single", proc.url, [], proc.kill)


def one(url: str, prompt: list[int]) -> float:
    from kvbridge.examples.check import complete

    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    t0 = time.perf_counter()
    out = complete(url, body, TIMEOUT_S)
    took = time.perf_counter() - t0
    if len(out.get("token_ids", [])) != 1:
        raise SystemExit(f"{url}: expected one token, got {out}")
    return took


def run_point(target: Target, length: int, conc: int, requests: int, rng: random.Random) -> Point:
    prompts = [[rng.randrange(1, 250) for _ in range(length)] for _ in range(requests)]
    before = target.metrics()
    with ThreadPoolExecutor(max_workers=conc) as pool:
        ttft = list(pool.map(lambda p: one(target.url, p), prompts))
    point = Point(ttft)
    if target.procs:
        after = target.metrics()

        def delta(name: str) -> float:
            key = f"kvbridge_{name}_total"
            return after.get(key, 0.0) - before.get(key, 0.0)

        loads = delta("transfers")
        if loads != requests:
            print(f"  note: {target.name} loaded {loads:.0f} of {requests} requests")
        point.transfer_ms = delta("transfer_seconds") / max(loads, 1) * 1e3
        point.bytes_per_req = delta("bytes_read") / max(loads, 1)
        point.descs_per_req = delta("descriptors_posted") / max(loads, 1)
        point.phases_ms = {
            phase: (
                after.get(f'kvbridge_load_phase_seconds_sum{{phase="{phase}"}}', 0.0)
                - before.get(f'kvbridge_load_phase_seconds_sum{{phase="{phase}"}}', 0.0)
            )
            / max(loads, 1)
            * 1e3
            for phase in PHASES
        }
    return point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="128,512,2048", help="prompt tokens (comma list)")
    ap.add_argument("--concurrency", default="1,4,16", help="clients at once (comma list)")
    ap.add_argument("--requests", type=int, default=16, help="requests per point")
    ap.add_argument("--modes", default="pull,push", help="P/D transfer modes (comma list)")
    ap.add_argument("--model", default="tiny-dense")
    ap.add_argument("--num-blocks", type=int, default=4096)
    add_device_argument(ap, "; every server's weights and KV cache")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    try:  # before any server starts
        device = parse_device(args.device)
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    logs = Path(tempfile.mkdtemp(prefix="kvbridge-bench-e2e-"))
    print(
        f"model {args.model} on {device}, prefill block 32 -> decode block 16, "
        f"{args.requests} requests "
        f"per point, max_tokens=1; logs in {logs}",
        flush=True,
    )
    results: dict[tuple[str, int, int], Point] = {}
    for name in ["single", *modes]:
        target = (
            start_single(args.model, args.num_blocks, device, logs)
            if name == "single"
            else start_pair(name, args.model, args.num_blocks, device, logs)
        )
        try:
            one(target.url, [7] * 64)  # warm-up: handshake, NIXL connection, kernels
            for length in lengths:
                for conc in concs:
                    rng = random.Random(hash((name, length, conc)) & 0xFFFF)
                    results[(name, length, conc)] = run_point(
                        target, length, conc, args.requests, rng
                    )
                    print(f"  {name} {length} x{conc}: done", flush=True)
        finally:
            target.close()
    print()
    header = (
        f"{'tokens':>6} {'conc':>4} {'single p50/p90':>15} "
        + " ".join(f"{m + ' p50/p90':>15} {'xfer ms':>7} {'overhead':>8}" for m in modes)
        + f" {'KiB/req':>8} {'desc/req':>8}"
    )
    print(header)
    print("-" * len(header))
    for length in lengths:
        for conc in concs:
            single = results[("single", length, conc)]
            cells = [f"{length:>6} {conc:>4} {single.p50:7.1f}/{single.p(0.9):<7.1f}"]
            last = None
            for m in modes:
                pt = results[(m, length, conc)]
                overhead = pt.p50 - single.p50 - pt.transfer_ms
                cells.append(
                    f"{pt.p50:7.1f}/{pt.p(0.9):<7.1f} {pt.transfer_ms:7.2f} {overhead:8.1f}"
                )
                last = pt
            assert last is not None
            cells.append(f"{last.bytes_per_req / 1024:8.0f} {last.descs_per_req:8.0f}")
            print(" ".join(cells))
    print(
        "\ndecode's load, phase by phase (mean ms per load; connector/worker/decode/inflight.py):"
    )
    header = f"{'tokens':>6} {'conc':>4} " + " ".join(
        f"{m + ' ' + '/'.join(PHASES):>30}" for m in modes
    )
    print(header)
    print("-" * len(header))
    for length in lengths:
        for conc in concs:
            cells = [f"{length:>6} {conc:>4}"]
            for m in modes:
                ph = results[(m, length, conc)].phases_ms
                cells.append(f"{' / '.join(f'{ph.get(x, 0.0):.2f}' for x in PHASES):>30}")
            print(" ".join(cells))
    print(
        "\nms throughout. xfer ms: decode's mean load time (post to done); overhead: P/D TTFT "
        "p50 - single p50 - xfer (the handover beyond the bytes: router hop, scheduling, "
        "notifications, polling). desc/req: both workers' descriptors (pull: decode's "
        "READs, push: prefill's WRITEs)."
    )
    rows = [
        {
            "target": name,
            "tokens": length,
            "concurrency": conc,
            "ttft_p50_ms": pt.p50,
            "ttft_p90_ms": pt.p(0.9),
            "load_ms": pt.transfer_ms,
            "bytes_per_req": pt.bytes_per_req,
            "descs_per_req": pt.descs_per_req,
            "phases_ms": pt.phases_ms,
        }
        for (name, length, conc), pt in results.items()
    ]
    write_json(
        args.json,
        "bench_e2e",
        rows,
        model=args.model,
        device=str(device),
        requests=args.requests,
        prefill_block=32,
        decode_block=16,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
