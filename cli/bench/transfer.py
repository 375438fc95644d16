"""Transfer benchmark: connector-driven loads vs a raw NIXL READ / WRITE of the same bytes.

Two processes: a child plays the prefill worker (``--serve``: a KVBridgeWorker over caches
it fills itself), this process plays decode (a KVBridgeWorker loading from it). Per cache
format and transfer mode, after one warm-up load (handshake, descriptor lists, UCX
connection)::

    connector:  child keeps a 2048-token request -> LoadSpec -> start_load_kv ->
                get_finished() until the load is reported (timed, median of N); pull:
                decode READs; push: decode sends Push, the child WRITEs into its blocks
    raw NIXL:   one READ (and one WRITE) of one descriptor covering the same number of
                bytes, between the child's cross-layer buffer and ours (no connector code)
    torch:      dst.copy_(src) of the same bytes in this process (the memory's speed)

``--device cuda`` puts both sides' caches in GPU memory (NIXL VRAM registrations).
``--merge on`` posts runs of adjacent blocks as one descriptor each on both sides
(``MergeRuns.ON``; ``off``, the default, posts every block by index and leaves the
coalescing to NIXL); ``compare`` adds per-layer rows with contiguous blocks both ways, so
``descs`` shows the descriptors posted before and after merging and ``rows`` the blocks
x streams asked for.
``--gather-mib N`` adds the shuffled rows of each format (cross-layer, blocks-first,
kv-split) again with ``extra.gather_mib`` on both sides: packed transfers, the rows
gathered by prefill and moved as one range (``descs`` counts its 64 KiB pages, which
NIXL coalesces).
``--host-staging compare`` adds the x-NHD rows again with both sides staged through host
mirrors (``kv_buffer_device: "cpu"``; forced for caches already in host memory), and
``on`` stages every row. ``keep ms`` is the time prefill took to keep the request (its
rewrite on save and its copy to the mirror), before the timed load starts.

It also reports descriptors per request, the time NIXL took to prepare the descriptor
lists (once per peer) and the per-request index computation (``GroupPlan.indices``).
Loaded bytes are checked (sha256 of both sides' token-major KV) for every format.

The parts: the cache (``transfer_shape``), the prefill child (``transfer_child``), timed
loads (``transfer_loads``), raw NIXL, copy and digest baselines (``transfer_baselines``).

Run:  kvbridge bench transfer [--layers 32] [--iterations 7] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.cli.bench.transfer_baselines import measure_digest, measure_raw, print_digest
from kvbridge.cli.bench.transfer_child import Idle, PrefillRank, serve
from kvbridge.cli.bench.transfer_loads import Row, measure_connector, print_phases, time_indices
from kvbridge.cli.bench.transfer_shape import Shape, add_common_args
from kvbridge.connector.common.config import NIXL_PROGRESS_STEP_US
from kvbridge.connector.transfer.nixl_engine import MergeRuns

BUSY_PROGRESS_US = 200  # extra.busy_progress_us, both sides


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where both caches live")
    ap.add_argument("--modes", default="pull,push", help="transfer modes to run (comma list)")
    ap.add_argument("--mode", default="pull", help=argparse.SUPPRESS)
    ap.add_argument(
        "--formats",
        default="",
        help="only the rows whose prefill and decode formats are both in this comma list "
        "(x-NHD, bf-NHD, ks-NHD, x-HND; x-NHD among them: the raw baseline and the "
        "compare rows run on its child; default: every row)",
    )
    ap.add_argument(
        "--host-staging",
        choices=["off", "on", "compare"],
        default="off",
        help="stage both sides through host mirrors: off, on (every row), compare (x-NHD rows "
        "both ways)",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="add the x-NHD rows again with extra.warm_peers (compare their 1st ms)",
    )
    ap.add_argument(
        "--merge",
        choices=["off", "on", "compare"],
        default="off",
        help="post adjacent blocks as one descriptor (MergeRuns.ON) on both sides: off, on "
        "(every row), compare (per-layer contiguous rows both ways)",
    )
    ap.add_argument(
        "--verify",
        choices=["off", "all", "compare"],
        default="off",
        help="extra.verify on decode: off, all (every row), compare (x-NHD rows again with "
        "verify all, and the digest alone vs a copy at 1, 32 and 256 MiB)",
    )
    ap.add_argument(
        "--busy-progress-us",
        type=int,
        default=BUSY_PROGRESS_US,
        help="extra.busy_progress_us on both sides (0: a peer waits for the other side's "
        f"next step; default {BUSY_PROGRESS_US})",
    )
    ap.add_argument(
        "--nixl-progress-us",
        type=int,
        default=0,
        help="extra.nixl_progress_us: NIXL's progress thread, waiting for UCX's events at "
        "most that long, a multiple of 1000 (0: none, progress in the worker's calls only; "
        "vLLM's default is 1000), on --nixl-progress-side",
    )
    ap.add_argument(
        "--nixl-progress-side",
        choices=["both", "prefill", "decode"],
        default="both",
        help="which side runs NIXL's progress thread (--nixl-progress-us); the other none",
    )
    ap.add_argument(
        "--idle-progress-ms",
        type=float,
        default=0,
        help="extra.idle_progress_ms on both sides (0: none, the bench's default; vLLM's is 5)",
    )
    ap.add_argument(
        "--prefill-idle",
        action="store_true",
        help="the prefill child makes no engine call while a load runs (an idle vLLM "
        "prefill): only its progress thread answers decode (default: it steps every ~1 ms)",
    )
    ap.add_argument(
        "--gather-mib",
        type=float,
        default=0,
        help="add the shuffled rows of each format again with extra.gather_mib=MIB on both "
        "sides (packed transfers: the rows move as one range; 0: not)",
    )
    ap.add_argument("--rewrite-on-save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--staged", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", metavar="FORMAT", help=argparse.SUPPRESS)
    ap.add_argument("--engine-id", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--tp-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--kv-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--kv-ip", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--no-rewrites-in-place", action="store_true", help=argparse.SUPPRESS)
    add_json_argument(ap)
    args = ap.parse_args(argv)
    if args.nixl_progress_us < 0 or args.nixl_progress_us % NIXL_PROGRESS_STEP_US:
        ap.error(f"--nixl-progress-us must be 0 or a multiple of {NIXL_PROGRESS_STEP_US}")
    shape = Shape.from_args(args)
    idle = Idle(engine_idle=args.prefill_idle, idle_progress_ms=args.idle_progress_ms)
    if args.serve:
        serve(
            shape,
            args.serve,
            args.engine_id,
            args.mode,
            args.device,
            args.rewrite_on_save,
            args.staged,
            MergeRuns(args.merge),
            PrefillRank(
                rank=args.rank,
                tp_size=args.tp_size,
                kv_port=args.kv_port,
                rewrites_in_place=not args.no_rewrites_in_place,
                kv_ip=args.kv_ip,
            ),
            args.busy_progress_us,
            args.gather_mib,
            args.nixl_progress_us,
            idle,
        )
        return
    indices_s = time_indices()
    # before any NIXL agent lives in this process: UCX's threads would take the cores the
    # digest's and the copy's own threads need on a small machine
    digest = measure_digest(args.device, args.iterations) if args.verify == "compare" else []
    mib = shape.request_bytes / 2**20
    print(
        f"shape: {shape.layers} layers x {shape.heads} KV heads x {shape.head_size} fp16, "
        f"block {shape.block_size}, {shape.tokens}-token request = {mib:.0f} MiB; "
        f"{args.iterations} timed runs each (median); pid {os.getpid()}, "
        f"{os.cpu_count()} CPUs; device {args.device}; "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}; "
        f"extra.busy_progress_us={args.busy_progress_us}, "
        f"extra.nixl_progress_us={args.nixl_progress_us} on "
        f"{'both sides' if args.nixl_progress_side == 'both' else args.nixl_progress_side}, "
        f"extra.idle_progress_ms={args.idle_progress_ms:g}; prefill's engine "
        f"{'idle during a load' if args.prefill_idle else 'steps every ~1 ms'}",
        flush=True,
    )
    rows: list[Row] = []
    # (prefill, decode, shuffled, rewrite on save): the first also serves the raw rows
    formats = [
        ("x-NHD", "x-NHD", True, False),
        ("x-NHD", "x-NHD", False, False),
        ("bf-NHD", "bf-NHD", True, False),
        ("ks-NHD", "ks-NHD", True, False),
        ("x-NHD", "x-HND", True, False),  # sender rewrite when decode asks (Prepare / Push)
        # the same rewrite when the child is handed the request (extra.rewrite_on_save),
        # before the timed load starts: off the handover's critical path
        ("x-NHD", "x-HND", True, True),
    ]
    if args.formats:
        wanted = {f.strip() for f in args.formats.split(",") if f.strip()}
        if "x-NHD" not in wanted:  # the raw rows need the first row's child cross-layer
            raise SystemExit(f"--formats {args.formats}: x-NHD must be among them")
        formats = [f for f in formats if f[0] in wanted and f[1] in wanted]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    staging = args.host_staging == "on"
    merge = MergeRuns.ON if args.merge == "on" else MergeRuns.OFF
    verify = "all" if args.verify == "all" else "off"
    # (mode, *format, host-staged, warm peer, merge, merge named in the row, verify)
    runs = [(mode, *f, staging, False, merge, False, verify) for mode in modes for f in formats]
    if args.merge == "compare":  # the raw baseline's row, then per-layer off/on pairs
        runs = [(modes[0], *formats[0], staging, False, merge, False, verify)] + [
            (mode, pfmt, pfmt, False, False, staging, False, m, True, verify)
            for mode in modes
            for pfmt in ("bf-NHD", "ks-NHD")
            for m in (MergeRuns.OFF, MergeRuns.ON)
        ]
    if args.host_staging == "compare":
        runs += [
            (mode, *f, True, False, merge, False, verify) for mode in modes for f in formats[:2]
        ]
    if args.warm:
        runs += [(mode, *formats[0], staging, True, merge, False, verify) for mode in modes]
    if args.verify == "compare":  # each x-NHD row again, verified
        runs += [
            (mode, *f, staging, False, merge, False, "all") for mode in modes for f in formats[:2]
        ]
    gathers = [0.0] * len(runs)
    if args.gather_mib:  # the shuffled rows of each format again (no rewrite), packed
        packed = [(*r[:5], staging, False, merge, False, verify) for r in runs]
        packed = [r for r in packed if r[1] == r[2] and r[3] and not r[4]]
        runs += packed
        gathers += [args.gather_mib] * len(packed)
    raw_rows: list[Row] = []
    for i, (mode, pfmt, dfmt, shuffled, on_save, staged, warm, m, named, v) in enumerate(runs):
        row, child, decode, buffers = measure_connector(
            shape,
            pfmt,
            dfmt,
            shuffled=shuffled,
            mode=mode,
            device=args.device,
            iterations=args.iterations,
            indices_s=indices_s,
            on_save=on_save,
            staged=staged,
            warm=warm,
            merge=m,
            merge_named=named,
            verify=v,
            busy_us=args.busy_progress_us,
            gather_mib=gathers[i],
            progress_us=args.nixl_progress_us,
            progress_side=args.nixl_progress_side,
            idle=idle,
        )
        try:
            rows.append(row)
            if i == 0:  # after the connector's digest check: the raw WRITE overwrites
                raw_rows = list(measure_raw(child, buffers, shape, args.iterations))
        finally:
            decode.shutdown()
            child.close()
        print(f"  done: {row.name}", flush=True)
    rows = raw_rows + rows
    raw_read_s, raw_write_s = raw_rows[0].seconds, raw_rows[1].seconds
    print()
    header = (
        f"{'what':<60} {'descs':>6} {'rows':>6} {'ms':>8} {'GB/s':>6} {'x raw':>6} "
        f"{'prep ms':>8} {'pick ms':>8} {'read ms':>8} {'keep ms':>8} {'1st ms':>8} "
        f"{'probe ms':>8}"
    )
    print(header)
    print("-" * len(header))
    records = []
    for r in rows:
        gbps = shape.request_bytes / r.seconds / 1e9
        prep = f"{r.prep_ms:.2f}" if isinstance(r.prep_ms, float) else r.prep_ms
        pick = f"{r.pick_ms:.3f}" if isinstance(r.pick_ms, float) else r.pick_ms
        read = f"{r.read_ms:.2f}" if isinstance(r.read_ms, float) else r.read_ms
        keep = f"{r.keep_ms:.2f}" if isinstance(r.keep_ms, float) else r.keep_ms
        first = f"{r.first_ms:.1f}" if isinstance(r.first_ms, float) else r.first_ms
        probe = f"{r.probe_ms:.2f}" if isinstance(r.probe_ms, float) else r.probe_ms
        push = " push " in r.name or "WRITE" in r.name
        raw_s = raw_write_s if push else raw_read_s
        records.append(
            {
                **asdict(r),
                "mode": "push" if push else "pull",
                "gbps": gbps,
                "x_raw": raw_s / r.seconds,
            }
        )
        print(
            f"{r.name:<60} {r.descs!s:>6} {r.rows!s:>6} {r.seconds * 1e3:8.2f} {gbps:6.2f} "
            f"{raw_s / r.seconds:6.2f} {prep:>8} {pick:>8} {read:>8} {keep:>8} {first:>8} "
            f"{probe:>8}"
        )
    print(
        "\ndescs: descriptors posted per request (a merged run counts once); rows: the rows\n"
        "(blocks x streams) asked for, before merging; NIXL coalesces adjacent rows itself.\n"
        "prep ms: NIXL prep of the local + remote descriptor lists (once per peer); "
        "pick ms: GroupPlan.indices per request; read ms: inside engine.read() per request\n"
        "(make_prepped_xfer + post; the default UCX transport copies during the post);\n"
        "1st ms: the first load from a new prefill (handshake, descriptor lists, UCX\n"
        "connection, READ probe), not in the median; probe ms: the first of decode's two\n"
        "READ probes of the child at the handshake (extra.read_probe, auto: GPU memory), in\n"
        "1st ms unless the peer was warm.\n"
        "'x raw' = raw NIXL time / row time (>= 1: as fast as the raw transfer): pull rows\n"
        "against the raw READ, push rows against the raw WRITE. A push row's time runs from\n"
        "decode's start_load_kv to the load reported: Push, the child's rewrite and WRITE,\n"
        "Pushed (the child steps every ~1 ms; with --prefill-idle only its progress thread)."
    )
    print_phases(rows, raw_read_s, raw_write_s)
    if digest:
        print_digest(digest, args.device)
    write_json(
        args.json,
        "bench_transfer",
        records,
        shape=asdict(shape),
        device=args.device,
        busy_progress_us=args.busy_progress_us,
        nixl_progress_us=args.nixl_progress_us,
        nixl_progress_side=args.nixl_progress_side,
        idle_progress_ms=args.idle_progress_ms,
        prefill_idle=args.prefill_idle,
        **({"digest": digest} if digest else {}),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
