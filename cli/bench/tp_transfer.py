"""Transfer speed across tensor-parallel sizes: connector loads vs a raw NIXL READ.

Real bytes between OS processes with real NIXL. Prefill runs as one child process per rank
(``kvbridge bench transfer``'s ``--serve``: a KVBridgeWorker over caches it fills with
seeded bytes, seed ``1 + rank``); decode's ranks are KVBridgeWorkers in this process::

    1:2   prefill TP 1 (8 heads) ----> decode rank 0 of TP 2 (heads 0-3)   timed
                                 \\---> decode rank 1 (heads 4-7)          untimed, after
    2:1   prefill rank 0 (heads 0-3) --\\
          prefill rank 1 (heads 4-7) ---> decode TP 1 (8 heads)            timed

Only decode rank 0's load is timed (``start_load_kv`` until ``get_finished`` reports it);
the other decode ranks load after it, so that prefill hears ``Done`` from every reader and
restores its blocks before the next request. Rows (cache formats, both sides alike):

    (a)  cross-layer NHD: prefill rewrites its blocks into head-major chunks (on decode's
         Prepare, or on save with ``extra.rewrite_on_save``); one descriptor per (chunk,
         source rank)
    (b)  per-layer HND, prefill ``rewrites_in_place=False`` (vLLM on a GPU): decode reads
         its head slice in place, one descriptor per (layer, K|V, block, source rank)
    (c)  per-layer HND, prefill may rewrite (head-major chunks per layer)
    push (a) again with prefill WRITEing (``--push``)

Baselines from the same children: one raw NIXL READ (and WRITE) of one descriptor of
decode rank 0's share of the bytes, and a torch copy of those bytes. ``x raw`` = raw time /
connector time for the same bytes. After each row, every decode rank's heads are compared
(sha256 of token-major slices) with the prefill heads ``kvbridge.handshake.tp.sources`` assigns it.

Run:  kvbridge bench tp_transfer [--pairs 1:2,2:1] [--iterations 7]
          [--tokens 2048] [--layers 32] [--push]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.cli.bench.transfer_baselines import measure_raw
from kvbridge.cli.bench.transfer_child import Child, PrefillRank, _config
from kvbridge.cli.bench.transfer_loads import Row, load, load_spec, median_s
from kvbridge.cli.bench.transfer_shape import Shape, add_common_args, kv_digest, parse_format
from kvbridge.connector.worker.worker import KVBridgeWorker
from kvbridge.handshake import tp
from kvbridge.layouts.allocation import KVCacheBuffers

# -- pure helpers (tests/cli/test_bench_tp_transfer.py) ---------------------------------


@dataclass(frozen=True, kw_only=True)
class Pair:
    """Prefill and decode TP sizes, ``1:2`` on the command line."""

    prefill_tp: int
    decode_tp: int

    @classmethod
    def parse(cls, text: str) -> Pair:
        prefill, decode = text.split(":")
        return cls(prefill_tp=int(prefill), decode_tp=int(decode))

    def __str__(self) -> str:
        return f"{self.prefill_tp}:{self.decode_tp}"


@dataclass(frozen=True, kw_only=True)
class Case:
    """One row: both sides' cache format (bench_transfer codes) and prefill's rules."""

    label: str
    fmt: str
    rewrites_in_place: bool = True
    on_save: bool = False
    mode: str = "pull"

    @property
    def name(self) -> str:
        rules = "no rewrite" if not self.rewrites_in_place else "rewrite"
        rules += " on save" if self.on_save else (" on Prepare" if self.rewrites_in_place else "")
        return f"({self.label}) {self.mode} {self.fmt}, {rules}"


CASES = (
    Case(label="a", fmt="x-NHD"),
    Case(label="a", fmt="x-NHD", on_save=True),
    Case(label="b", fmt="bf-HND", rewrites_in_place=False),
    Case(label="c", fmt="bf-HND"),
)
PUSH_CASE = Case(label="a", fmt="x-NHD", on_save=True, mode="push")


def share_bytes(shape: Shape, decode_rank: int, decode_tp: int) -> int:
    """The request bytes decode rank ``decode_rank`` of TP ``decode_tp`` loads."""
    heads = tp.rank_heads(decode_rank, decode_tp, shape.heads).count
    return shape.request_bytes * heads // shape.heads


def head_mismatches(
    buffers: KVCacheBuffers,
    block_ids: list[int],
    slices: tuple[tp.HeadSlice, ...],
    prefill_digest: Callable[[tp.HeadSlice], str],
) -> list[str]:
    """The slices whose heads in ``buffers`` (decode's blocks ``block_ids``) differ from
    the prefill heads they name (``prefill_digest(s)``: sha256 of those, token-major)."""
    bad = []
    for s in slices:
        got = kv_digest(buffers, block_ids, heads=(s.local_head, s.num_heads))
        want = prefill_digest(s)
        if got != want:
            bad.append(
                f"heads {s.local_head}..{s.local_head + s.num_heads - 1} != prefill rank "
                f"{s.remote_rank} heads {s.remote_head}..{s.remote_head + s.num_heads - 1} "
                f"(sha256 {got[:12]} vs {want[:12]})"
            )
    return bad


# -- one row: prefill children and decode workers ------------------------------------------

# kvbridge.connector.worker.decode.inflight: where a load's time goes
PHASES = ("prepare", "data", "finish")


def phase_seconds(worker: KVBridgeWorker) -> np.ndarray:
    return np.array([getattr(worker.metrics, f"load_{p}_seconds") for p in PHASES])


@dataclass
class DecodeRank:
    rank: int
    worker: KVBridgeWorker
    buffers: KVCacheBuffers


@dataclass
class Result:
    row: Row
    nbytes: int
    bytes_ok: bool
    descs_note: str = ""
    load: float | None = None  # the 1-minute load average as the row started (shared host)
    phases_ms: tuple[float, ...] = ()  # mean prepare, data, finish ms of decode rank 0's loads


def start_prefill(
    stack: contextlib.ExitStack, shape: Shape, case: Case, prefill_tp: int
) -> list[Child]:
    """One child per prefill rank, each closed (killed) when ``stack`` unwinds."""
    engine_id = f"bench-P-{uuid.uuid4().hex[:6]}"
    children = []
    for r in range(prefill_tp):  # kv_port 0: each rank binds an ephemeral port and says which
        rank = PrefillRank(
            rank=r, tp_size=prefill_tp, kv_port=0, rewrites_in_place=case.rewrites_in_place
        )
        try:
            child = Child(
                shape, case.fmt, case.mode, "cpu", case.on_save, tp=rank, engine_id=engine_id
            )
        except SystemExit as err:  # it waited for the child's "ready": say which child
            raise SystemExit(f"prefill rank {r} of TP {prefill_tp}, {case.name}: {err}") from None
        stack.callback(child.close)
        children.append(child)
    return children


def start_decode(
    stack: contextlib.ExitStack, shape: Shape, case: Case, decode_tp: int
) -> list[DecodeRank]:
    engine_id = f"bench-D-{uuid.uuid4().hex[:6]}"
    decodes = []
    for r in range(decode_tp):
        worker = KVBridgeWorker(
            _config("kv_consumer", engine_id, case.mode), shape.model(), rank=r, tp_size=decode_tp
        )
        stack.callback(worker.shutdown)
        local = replace(shape, heads=tp.rank_heads(r, decode_tp, shape.heads).count)
        buffers = local.buffers(parse_format(case.fmt))
        worker.register_kv_caches(buffers)
        decodes.append(DecodeRank(r, worker, buffers))
    return decodes


def measure_case(
    shape: Shape, case: Case, pair: Pair, iterations: int, *, with_raw: bool
) -> tuple[Result, list[Row]]:
    """Decode rank 0's load time (median), its descriptors and the bytes check; with
    ``with_raw`` also the raw NIXL READ / WRITE and torch rows for its share of the bytes."""
    load1 = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        children = start_prefill(stack, shape, case, pair.prefill_tp)
        decodes = start_decode(stack, shape, case, pair.decode_tp)
        timed = decodes[0]
        n = shape.blocks_per_request
        rng = np.random.default_rng(0)  # scattered blocks on both sides, as in bench_transfer
        rids = rng.permutation(shape.num_blocks)[:n].tolist()
        lids = rng.permutation(shape.num_blocks)[:n].tolist()
        keep_ms: list[float] = []
        prefill_posted = [0]

        def one_load() -> float:
            rid = f"r-{uuid.uuid4().hex[:8]}"
            for child in children:
                child.command(cmd="send", request_id=rid, block_ids=rids)
            keep_ms.append(max(child.wait("kept")["keep_ms"] for child in children))
            spec = load_spec(
                children[0],
                shape,
                rid,
                rids,
                lids,
                remote_tp_size=pair.prefill_tp,
                remote_ports=[c.port for c in children],
            )
            t0 = time.perf_counter()
            load(timed.worker, spec)
            took = time.perf_counter() - t0
            for other in decodes[1:]:  # untimed: prefill frees after every reader's Done
                load(other.worker, spec)
            prefill_posted[0] = sum(c.wait("sent")["descriptors_posted"] for c in children)
            return took

        first_s = one_load()  # warm-up: handshakes, descriptor lists, UCX connections
        posted0, prefill0 = timed.worker.metrics.descriptors_posted, prefill_posted[0]
        phases0 = phase_seconds(timed.worker)
        seconds = median_s(one_load, iterations)
        phases_ms = tuple((phase_seconds(timed.worker) - phases0) / iterations * 1e3)
        if case.mode == "pull":
            descs = (timed.worker.metrics.descriptors_posted - posted0) // iterations
            note = ""
        else:  # prefill's WRITEs, for every decode rank together
            descs = (prefill_posted[0] - prefill0) // iterations
            note = "*"

        def prefill_digest(s: tp.HeadSlice) -> str:
            child = children[s.remote_rank]
            child.command(cmd="digest", block_ids=rids, heads=[s.remote_head, s.num_heads])
            return child.wait("digest")["sha256"]

        bad = []
        for d in decodes:
            slices = tp.sources(d.rank, pair.decode_tp, pair.prefill_tp, shape.heads)
            bad += [
                f"decode rank {d.rank}: {m}"
                for m in head_mismatches(d.buffers, lids, slices, prefill_digest)
            ]
        for line in bad:
            print(f"  BYTES DIFFER {pair} {case.name}: {line}", flush=True)
        keep = float(np.median(keep_ms[1:]))
        row = Row(f"{pair} {case.name}", descs, seconds, keep_ms=keep, first_ms=first_s * 1e3)
        nbytes = share_bytes(shape, 0, pair.decode_tp)
        raw_rows: list[Row] = []
        if with_raw:  # last: the raw WRITE overwrites prefill rank 0's cache
            raw_rows = list(measure_raw(children[0], timed.buffers, shape, iterations, nbytes))
        return Result(row, nbytes, not bad, note, load1, phases_ms), raw_rows


# -- report --------------------------------------------------------------------------------

HEADER = (
    f"{'what':<46} {'desc/req':>8} {'MiB':>7} {'ms':>8} {'GB/s':>6} {'x raw':>6} "
    f"{'keep ms':>8} {'1st ms':>8} {'bytes':>6} {'load':>5} {'prep/data/fin ms':>18}"
)


def report_line(row: Row, nbytes: int, raw_s: float, result: Result | None = None) -> str:
    """One table line; ``result``: a connector row's check, notes and load average."""
    bytes_ok, note = (None, "") if result is None else (result.bytes_ok, result.descs_note)
    load = "" if result is None or result.load is None else f"{result.load:.1f}"
    phases = "/".join(f"{ms:.0f}" for ms in result.phases_ms) if result else ""
    keep = f"{row.keep_ms:.1f}" if isinstance(row.keep_ms, float) else row.keep_ms
    first = f"{row.first_ms:.1f}" if isinstance(row.first_ms, float) else row.first_ms
    check = "-" if bytes_ok is None else ("ok" if bytes_ok else "DIFFER")
    return (
        f"{row.name:<46} {f'{row.descs}{note}':>8} {nbytes / 2**20:7.1f} "
        f"{row.seconds * 1e3:8.2f} {nbytes / row.seconds / 1e9:6.2f} {raw_s / row.seconds:6.2f} "
        f"{keep:>8} {first:>8} {check:>6} {load:>5} {phases:>18}"
    )


def record(pair: Pair, row: Row, nbytes: int, raw_s: float, result: Result | None = None) -> dict:
    """One table line as a JSON row (``--json``)."""
    return {
        "pair": str(pair),
        **asdict(row),
        "nbytes": nbytes,
        "x_raw": raw_s / row.seconds,
        "bytes_ok": None if result is None else result.bytes_ok,
        "load": None if result is None else result.load,
        "phases_ms": [] if result is None else list(result.phases_ms),
    }


def run_pair(
    shape: Shape, pair: Pair, cases: list[Case], iterations: int, records: list[dict]
) -> bool:
    """Measure ``cases`` for one TP pair, print its table and add its rows to ``records``;
    False if bytes differed."""
    results: list[Result] = []
    raw_rows: list[Row] = []
    for i, case in enumerate(cases):
        result, raw = measure_case(shape, case, pair, iterations, with_raw=i == 0)
        results.append(result)
        raw_rows = raw_rows or raw
        print(f"  done: {result.row.name}", flush=True)
    read_row, write_row, torch_row = raw_rows
    nbytes = results[0].nbytes
    print(f"\nprefill TP {pair.prefill_tp} -> decode TP {pair.decode_tp}, decode rank 0:")
    print(HEADER)
    print("-" * len(HEADER))
    for raw in (read_row, write_row, torch_row):
        raw_s = write_row.seconds if raw is write_row else read_row.seconds
        print(report_line(raw, nbytes, raw_s))
        records.append(record(pair, raw, nbytes, raw_s))
    for r in results:
        raw_s = write_row.seconds if " push " in r.row.name else read_row.seconds
        print(report_line(r.row, r.nbytes, raw_s, r))
        records.append(record(pair, r.row, r.nbytes, raw_s, r))
    print(flush=True)
    return all(r.bytes_ok for r in results)


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is, so that it unwinds like Ctrl-C: every
    child killed, every worker shut down (not a SystemExit: those carry our timeouts)."""


def terminate(signum: int, frame: object) -> None:
    raise Terminated(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--pairs", default="1:2,2:1", help="prefill:decode TP sizes (comma list)")
    ap.add_argument("--push", action="store_true", help="add row (a) in push mode")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    shape = Shape.from_args(args)
    pairs = [Pair.parse(p) for p in args.pairs.split(",") if p.strip()]
    cases = [*CASES, PUSH_CASE] if args.push else list(CASES)
    signal.signal(signal.SIGTERM, terminate)
    print(
        f"shape: {shape.layers} layers x {shape.heads} KV heads x {shape.head_size} fp16, "
        f"block {shape.block_size}, {shape.tokens}-token request = "
        f"{shape.request_bytes / 2**20:.0f} MiB; {args.iterations} timed runs each (median); "
        f"pid {os.getpid()}, {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    try:
        records: list[dict] = []
        ok = all([run_pair(shape, pair, cases, args.iterations, records) for pair in pairs])
    except Terminated:
        raise SystemExit(143) from None
    print(
        "MiB: decode rank 0's share of the request (its heads); GB/s and 'x raw' over those\n"
        "bytes. 'x raw' = raw NIXL time / row time (1.0: as fast as one READ of one\n"
        "descriptor of the same bytes between the same processes): pull rows against the raw\n"
        "READ, push rows against the raw WRITE. desc/req: descriptors decode rank 0 posted\n"
        "per request (* push: prefill's WRITEs for every decode rank together). keep ms:\n"
        "prefill's handover (its rewrite on save), before the timed load. 1st ms: the first\n"
        "load (handshakes, descriptor lists, UCX connections), not in the median. bytes:\n"
        "every decode rank's heads equal the prefill heads kvbridge.handshake.tp.sources\n"
        "assigns it.\n"
        "load: the 1-minute load average as the row started (the raw rows: with row 1).\n"
        "prep/data/fin ms: decode rank 0's mean load phases\n"
        "(kvbridge.connector.worker.decode.inflight): the\n"
        "Prepare round trip (prefill's rewrite on demand), the READs / WRITEs, decode's own\n"
        "rewrite once every source rank's heads are in.\n"
        f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    write_json(args.json, "bench_tp_transfer", records, shape=asdict(shape), pairs=args.pairs)
    if not ok:
        raise SystemExit("loaded bytes differ from prefill's (see BYTES DIFFER above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
