"""Bandwidth against the link: connector loads across a rate-limited network link, as a
ratio of the link's rate and of a raw NIXL transfer of the same bytes over the same link.

Two network namespaces joined by a veth pair (``kvbridge.examples.netns``), a ``tbf``
limit on both ends, UCX over TCP on the link (``UCX_TLS=tcp``, ``UCX_NET_DEVICES``): the
prefill child of ``kvbridge bench transfer`` runs in one, this process (decode) in the
other. For each rate, request size and transfer mode, ``bench_transfer``'s measurement
(one warm-up load, then the median of ``--iterations``; loaded bytes checked by sha256),
and per rate and size one raw NIXL READ and one raw WRITE of one descriptor covering the
same bytes between the same two hosts::

    x link  = (request bytes / connector time) / link rate
    x raw   = raw NIXL time / connector time   (pull: the raw READ; push: the raw WRITE)

Where the time goes: ``descs`` (descriptors posted per load), and decode's load timeline
per load (``prep ms``: the claim round trip before the data, ``data ms``: waiting for the
READs / the pushed rounds, ``fin ms``: finishing), averaged over the timed loads.
``on link`` is the bytes prefill's end of the link sent per load over the KV bytes (the
proof that they crossed it; > 1: TCP/IP headers, UCX and notification traffic).

Needs root (network namespaces); exits 3 with a message without.
Run:  sudo .venv/bin/kvbridge bench multihost [--rates 1gbit,10gbit] [--modes pull,push]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

from kvbridge.cli.bench import transfer_child
from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.cli.bench.transfer_baselines import measure_raw
from kvbridge.cli.bench.transfer_loads import measure_connector, time_indices
from kvbridge.cli.bench.transfer_shape import Shape
from kvbridge.connector.transfer.nixl_engine import MergeRuns
from kvbridge.examples.netns import Link, unavailable

MODULE = "kvbridge.cli.bench.multihost"  # run again inside decode's namespace


@dataclass
class Result:
    rate: str
    size: str
    mode: str
    nbytes: int
    seconds: float
    raw_seconds: float
    descs: int | str
    prep_ms: float
    data_ms: float
    fin_ms: float
    on_link: float
    drops: int  # packets prefill's end of the link dropped (its tbf queue overflowed)


def timeline_ms(decode, iterations: int) -> tuple[float, float, float]:
    """Decode's load timeline per load (the warm-up's handshake is in ``peer``, not here;
    its prepare/data/finish are averaged in: one load of ``iterations + 1``)."""
    m, n = decode.metrics, iterations + 1
    return (
        m.load_prepare_seconds / n * 1e3,
        m.load_data_seconds / n * 1e3,
        m.load_finish_seconds / n * 1e3,
    )


def run_rate(rate: str, args: argparse.Namespace, argv: list[str]) -> list[Result]:
    """Make the link, and measure from a copy of this benchmark (its arguments ``argv``) in
    decode's namespace (where ``ip netns exec`` also shows UCX the link's device in /sys)."""
    link = Link(rate)
    try:
        inner = [
            sys.executable,
            "-m",
            "kvbridge.cli.bench.multihost",
            *argv,
            "--inner",
            link.to_json(),
        ]
        out = subprocess.run(link.argv("d", *inner), stdout=subprocess.PIPE, text=True)
        for line in out.stdout.splitlines():
            if not line.startswith("@@ "):
                print(line, flush=True)
        if out.returncode != 0:
            raise SystemExit(f"the measurement at {rate} failed (exit {out.returncode})")
        return [
            Result(**json.loads(line[3:])) for line in out.stdout.splitlines() if line[:3] == "@@ "
        ]
    finally:
        link.close()


def measure(link: Link, sizes: dict[str, int], modes: list[str], args) -> list[Result]:
    """In decode's namespace: the prefill child goes to prefill's."""
    rate = link.rate
    results: list[Result] = []
    indices_s = time_indices()
    transfer_child.PREFILL_HOST, transfer_child.DECODE_HOST = link.ip["p"], link.ip["d"]
    transfer_child.CHILD_PREFIX = link.argv(
        "p"
    )  # the child: in prefill's namespace, UCX on its end
    for size, tokens in sizes.items():
        shape = Shape(
            layers=args.layers,
            heads=args.heads,
            head_size=args.head_size,
            block_size=args.block_size,
            tokens=tokens,
        )
        raw: dict[str, float] = {}
        # each mode with the blocks scattered (a descriptor per block), and, with
        # --contiguous, again with the request's blocks adjacent on both sides and merged
        # into one descriptor (MergeRuns.ON): what the descriptor count costs
        runs = [(mode, True) for mode in modes]
        runs += [(mode, False) for mode in modes if args.contiguous and size == "large"]
        for mode, shuffled in runs:
            tx0, drops0 = link.tx_stats("p")
            row, child, decode, buffers = measure_connector(
                shape,
                "x-NHD",
                "x-NHD",
                shuffled=shuffled,
                mode=mode,
                device="cpu",
                iterations=args.iterations,
                indices_s=indices_s,
                merge=MergeRuns.OFF if shuffled else MergeRuns.ON,
            )
            tx1, drops1 = link.tx_stats("p")
            sent, drops = tx1 - tx0, drops1 - drops0
            try:
                if not raw:  # after the digest check: the raw WRITE overwrites
                    read_row, write_row, _ = measure_raw(child, buffers, shape, args.iterations)
                    raw = {"pull": read_row.seconds, "push": write_row.seconds}
                prep, data, fin = timeline_ms(decode, args.iterations)
            finally:
                decode.shutdown()
                child.close()
            results.append(
                Result(
                    rate,
                    size if shuffled else f"{size}, merged",
                    mode,
                    shape.request_bytes,
                    row.seconds,
                    0.0,
                    row.descs,
                    prep,
                    data,
                    fin,
                    sent / (shape.request_bytes * (args.iterations + 1)),
                    drops,
                )
            )
            print(f"  done: {rate} {results[-1].size} {mode}", flush=True)
        for r in results:
            if r.rate == rate and r.size.split(",")[0] == size:
                r.raw_seconds = raw[r.mode]
    return results


def bits(rate: str) -> float:
    n, unit = rate.lower().removesuffix("bit"), 1.0
    for suffix, scale in (("k", 1e3), ("m", 1e6), ("g", 1e9)):
        if n.endswith(suffix):
            n, unit = n[:-1], scale
    return float(n) * unit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", default="1gbit,10gbit", help="tbf rates of the link (comma list)")
    ap.add_argument("--modes", default="pull,push")
    ap.add_argument("--large-tokens", type=int, default=2048)
    ap.add_argument("--small-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument(
        "--contiguous",
        action="store_true",
        help="add large rows with adjacent blocks merged into one descriptor",
    )
    add_json_argument(ap)
    ap.add_argument("--inner", help=argparse.SUPPRESS)  # the link, in decode's namespace
    args = ap.parse_args(argv)
    sizes = {"large": args.large_tokens, "small": args.small_tokens}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.inner:
        for r in measure(Link.attach(args.inner), sizes, modes, args):
            print("@@ " + json.dumps(asdict(r)), flush=True)
        return 0
    why = unavailable()
    if why:
        print(
            f"kvbridge bench multihost: {why}; it needs network namespaces (root)", file=sys.stderr
        )
        return 3
    print(
        f"two namespaces over a veth pair, UCX_TLS=tcp; {args.layers} layers x {args.heads} "
        f"KV heads x {args.head_size} fp16, block {args.block_size}, x-NHD -> x-NHD, blocks "
        f"shuffled; {args.iterations} timed loads each (median); {os.cpu_count()} CPUs",
        flush=True,
    )
    results: list[Result] = []
    for rate in [r.strip() for r in args.rates.split(",") if r.strip()]:
        results += run_rate(rate, args, sys.argv[1:] if argv is None else argv)
    header = (
        f"{'link':>7} {'size':>13} {'mode':>4} {'MiB':>6} {'ms':>8} {'Gbit/s':>7} {'x link':>6} "
        f"{'raw ms':>8} {'x raw':>6} {'descs':>6} {'prep ms':>8} {'data ms':>8} {'fin ms':>7} "
        f"{'on link':>7} {'drops':>6}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        gbit = r.nbytes * 8 / r.seconds / 1e9
        print(
            f"{r.rate:>7} {r.size:>13} {r.mode:>4} {r.nbytes / 2**20:6.2f} {r.seconds * 1e3:8.2f} "
            f"{gbit:7.3f} {gbit * 1e9 / bits(r.rate):6.2f} {r.raw_seconds * 1e3:8.2f} "
            f"{r.raw_seconds / r.seconds:6.2f} {r.descs!s:>6} {r.prep_ms:8.2f} {r.data_ms:8.2f} "
            f"{r.fin_ms:7.2f} {r.on_link:7.3f} {r.drops:6d}"
        )
    print(
        "\nx link: the load's goodput over the link's tbf rate; x raw: raw NIXL time over the"
        "\nload's (>= 1: as fast as one raw descriptor). prep/data/fin ms: decode's load"
        "\ntimeline per load (claim round trip, data, finishing); on link: bytes prefill's"
        "\nend of the link sent per load / the KV bytes; drops: packets its tbf dropped."
    )
    rows = [asdict(r) for r in results]
    write_json(args.json, "bench_multihost", rows, **vars(args) | {"json": None, "inner": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
