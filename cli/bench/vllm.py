"""kvbridge vs vLLM's NixlConnector on the same vLLM servers: TTFT through the router.

::

    kvbridge bench vllm                       # the default grid
    kvbridge bench vllm --lengths 256 1024 --concurrency 1 4

For each connector (kvbridge, then nixl) one prefill server, one decode server and the
router run side by side (same model, same block sizes, same machine). At every point
(prompt length x concurrency) the client sends streaming requests through the router and
takes the time to the first streamed token (TTFT: prefill + handover + KV load + first
decode step). Decode's Prometheus metrics give the KV load time, bytes and descriptors
per request. Then every configuration in ``--refused`` (prefill -> decode block sizes) is
tried once per connector and reported as served or refused.

Before the grid, nothing warms the servers: the first request after all of them report
healthy is the cold-start row, sent to a plain reference server (no connector, started
with the pair) and then through the router, side by side (docs/handover.md).

Prints one table row per point with the kvbridge / NixlConnector TTFT ratio (< 1: kvbridge
is faster) and the loads decode recomputed (kvbridge: ``loads_recomputed``; NixlConnector:
``nixl_num_failed_transfers``). Prompts are unique per request (no prefix-cache hits
anywhere).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from dataclasses import dataclass

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.examples.vllm.client import RequestError, compare, complete, make_prompts
from kvbridge.examples.vllm.pd_servers import PDServers, start_pd
from kvbridge.examples.vllm.scraped_metrics import scrape

# Decode-side metric names per connector: (load seconds sum, loads, bytes sum, descriptors
# sum, loads recomputed)
LOAD_METRICS = {
    "kvbridge": (
        "vllm:kvbridge_transfer_seconds_total",
        "vllm:kvbridge_transfers_total",
        "vllm:kvbridge_bytes_read_total",
        "vllm:kvbridge_descriptors_posted_total",
        "vllm:kvbridge_loads_recomputed_total",
    ),
    "nixl": (
        "vllm:nixl_xfer_time_seconds_sum",
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_bytes_transferred_sum",
        "vllm:nixl_num_descriptors_sum",
        "vllm:nixl_num_failed_transfers_total",
    ),
}


@dataclass
class Point:
    connector: str
    length: int
    concurrency: int
    ttft_s: list[float]
    errors: int
    load_ms: float | None
    bytes_per_req: float | None
    descs_per_req: float | None
    recomputed: float = 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, int(q * len(xs)))]


def ttft(url: str, model: str, prompt: list[int], timeout_s: float) -> float:
    """Seconds until the first streamed completion chunk arrives through ``url``."""
    host, port = url.removeprefix("http://").split(":")
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    start = time.monotonic()
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RequestError(url, resp.status, resp.read(300).decode(errors="replace"))
        while True:
            line = resp.readline()
            if not line:
                raise RequestError(url, resp.status, "stream ended before the first token")
            if line.startswith(b"data:") and b'"text"' in line:
                return time.monotonic() - start
    finally:
        conn.close()


def run_point(
    pd: PDServers, length: int, concurrency: int, requests: int, seed: int, timeout_s: float
) -> Point:
    # make_prompts(1, n) is ~0.6 n tokens long: ask for 2 n and cut at exactly `length`
    prompts = [
        make_prompts(1, 2 * length, seed=seed * 1_000_003 + i)[0][:length] for i in range(requests)
    ]
    before = scrape(pd.decode_url)
    results: list[float] = []
    errors = 0
    lock = threading.Lock()
    queue = list(prompts)

    def worker() -> None:
        nonlocal errors
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            try:
                t = ttft(pd.router_url, pd.model_name, prompt, timeout_s)
                with lock:
                    results.append(t)
            except (RequestError, OSError) as exc:
                with lock:
                    errors += 1
                print(f"    request failed: {exc}", flush=True)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = scrape(pd.decode_url)
    secs, count, nbytes, descs, recomputed = (
        after.get(n, 0.0) - before.get(n, 0.0) for n in LOAD_METRICS[pd.connector]
    )
    loads = count if count > 0 else None
    return Point(
        connector=pd.connector,
        length=length,
        concurrency=concurrency,
        ttft_s=results,
        errors=errors,
        load_ms=1e3 * secs / loads if loads else None,
        bytes_per_req=nbytes / len(results) if results else None,
        descs_per_req=descs / len(results) if results else None,
        recomputed=recomputed,
    )


@dataclass
class ColdStart:
    """The first request after every server reported healthy, side by side."""

    connector: str
    reference_s: float  # a plain vLLM server's first request (TTFT)
    pd_s: float  # the first request through the router (TTFT)
    recomputed: float


def stats_after_load(
    pd: PDServers, before: dict[str, float], recomputed: str, timeout_s: float = 5.0
) -> dict[str, float]:
    """Decode's stats once the load shows in them: vLLM's engine ships its stats to the API
    server after the request's output, so poll until a transfer or a recompute is counted
    (a pair that moved nothing never shows one: read what is there at the deadline)."""
    moved = (LOAD_METRICS[pd.connector][1], recomputed)
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(pd.decode_url)
        if any(after.get(n, 0.0) > before.get(n, 0.0) for n in moved):
            return after
        if time.monotonic() > deadline:
            return after
        time.sleep(0.05)  # poll interval, not synchronisation: the loop checks the stats


def cold_start(pd: PDServers, length: int, timeout_s: float) -> ColdStart:
    """TTFT of the reference server's first request, then of the pair's (other prompts
    of the same length: no prefix cache helps either)."""
    assert pd.reference_url is not None
    prompts = [make_prompts(1, 2 * length, seed=7_000 + i)[0][:length] for i in range(2)]
    before = scrape(pd.decode_url)
    ref_s = ttft(pd.reference_url, pd.model_name, prompts[0], timeout_s)
    pd_s = ttft(pd.router_url, pd.model_name, prompts[1], timeout_s)
    name = LOAD_METRICS[pd.connector][4]
    after = stats_after_load(pd, before, name)
    return ColdStart(pd.connector, ref_s, pd_s, after.get(name, 0.0) - before.get(name, 0.0))


def try_config(connector: str, prefill_bs: int, decode_bs: int, args) -> str:
    """Serve one prompt through the router and compare it with a single server."""
    with start_pd(
        connector=connector,
        prefill_block_size=prefill_bs,
        decode_block_size=decode_bs,
        with_reference=True,
        max_model_len=args.max_model_len,
        enforce_eager=not args.compile,
        progress=False,
    ) as pd:
        prompt = make_prompts(1, 300, seed=99)[0]
        assert pd.reference_url is not None
        ref = complete(
            pd.reference_url, pd.model_name, prompt, max_tokens=8, timeout_s=args.timeout
        )
        before = scrape(pd.decode_url)
        try:
            got = complete(
                pd.router_url, pd.model_name, prompt, max_tokens=8, timeout_s=args.timeout
            )
        except RequestError as exc:
            return f"request failed (HTTP {exc.status}: {exc.reason[:80]})"
        after = scrape(pd.decode_url)
        key = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
        moved = after.get(key, 0.0) - before.get(key, 0.0)
        same = compare(ref, got).tokens_equal
        return (
            f"served, {moved:.0f} prompt tokens from the connector, "
            f"{same}/{len(ref.token_ids)} tokens equal a single server"
        )


def fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=8, help="requests per point (>= concurrency)")
    ap.add_argument("--prefill-block-size", type=int, default=32)
    ap.add_argument("--decode-block-size", type=int, default=32)
    ap.add_argument("--connectors", nargs="+", default=["kvbridge", "nixl"])
    ap.add_argument(
        "--refused",
        nargs="*",
        default=["64:32", "32:64"],
        help="prefill:decode block sizes to try once per connector (refusals, wrong tokens)",
    )
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="vLLM's torch.compile warm-up (default: --enforce-eager, ~3x faster start)",
    )
    ap.add_argument("--refused-only", action="store_true", help="only the --refused rows")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    if args.refused_only:
        args.connectors_for_grid = []
    else:
        args.connectors_for_grid = args.connectors

    points: dict[tuple[str, int, int], Point] = {}
    colds: list[ColdStart] = []
    for connector in args.connectors_for_grid:
        print(
            f"== {connector}: prefill {args.prefill_block_size} -> decode {args.decode_block_size}",
            flush=True,
        )
        with start_pd(
            connector=connector,
            prefill_block_size=args.prefill_block_size,
            decode_block_size=args.decode_block_size,
            with_reference=True,  # the cold-start row's baseline
            # kvbridge's defaults: start_pd would lower the engine threads' priority on
            # a machine with fewer cores than busy engine threads; a user's servers do not
            kv_extra={"extra": {"engine_thread_nice": 0}} if connector == "kvbridge" else None,
            max_model_len=args.max_model_len,
            enforce_eager=not args.compile,
        ) as pd:
            # no warm-up: the first request is the cold-start row
            cold = cold_start(pd, args.lengths[0], args.timeout)
            colds.append(cold)
            print(
                f"  cold start: first TTFT {cold.pd_s * 1e3:.0f} ms through the router, "
                f"{cold.reference_s * 1e3:.0f} ms on a cold single server, "
                f"recomputed {cold.recomputed:.0f}",
                flush=True,
            )
            for length in args.lengths:
                for conc in args.concurrency:
                    n = max(args.requests, conc)
                    p = run_point(
                        pd, length, conc, n, seed=length * 10 + conc, timeout_s=args.timeout
                    )
                    points[(connector, length, conc)] = p
                    print(
                        f"  len {length:5d} conc {conc}: TTFT p50 {p.pct(0.5) * 1e3:8.1f} ms "
                        f"p90 {p.pct(0.9) * 1e3:8.1f} ms, load {fmt(p.load_ms)} ms, "
                        f"{fmt(p.bytes_per_req, 1 / 1024, 0)} KiB, "
                        f"{fmt(p.descs_per_req, 1, 0)} desc, errors {p.errors}, "
                        f"recomputed {p.recomputed:.0f}",
                        flush=True,
                    )

    print(
        "\n| connector | cold start: first TTFT after health (ms) | cold single server (ms) "
        "| difference (ms) | recomputed |"
    )
    print("|---|---|---|---|---|")
    for c in colds:
        print(
            f"| {c.connector} | {c.pd_s * 1e3:.0f} | {c.reference_s * 1e3:.0f} "
            f"| {(c.pd_s - c.reference_s) * 1e3:+.0f} | {c.recomputed:.0f} |"
        )
    print(
        "\n| prompt | conc | kvbridge TTFT p50 / p90 (ms) | NixlConnector TTFT p50 / p90 (ms) "
        "| ratio p50 / p90 | decode KV load (ms) kvb / nixl | KiB/req | desc/req kvb / nixl "
        "| recomputed kvb / nixl |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        for conc in args.concurrency:
            k, x = points.get(("kvbridge", length, conc)), points.get(("nixl", length, conc))
            if k is None or x is None:
                continue
            r50, r90 = k.pct(0.5) / x.pct(0.5), k.pct(0.9) / x.pct(0.9)
            print(
                f"| {length} | {conc} | {k.pct(0.5) * 1e3:.0f} / {k.pct(0.9) * 1e3:.0f} "
                f"| {x.pct(0.5) * 1e3:.0f} / {x.pct(0.9) * 1e3:.0f} | {r50:.2f} / {r90:.2f} "
                f"| {fmt(k.load_ms)} / {fmt(x.load_ms)} | {fmt(k.bytes_per_req, 1 / 1024, 0)} "
                f"| {fmt(k.descs_per_req, 1, 0)} / {fmt(x.descs_per_req, 1, 0)} "
                f"| {k.recomputed:.0f} / {x.recomputed:.0f} |"
            )
    rows = [{**vars(p), "ttft_p50_ms": p.pct(0.5) * 1e3, "ttft_p90_ms": p.pct(0.9) * 1e3}
            for p in points.values()]  # fmt: skip
    if rows:
        write_json(args.json, "bench_vllm", rows, prefill_block=args.prefill_block_size,
                   decode_block=args.decode_block_size, requests=args.requests)  # fmt: skip
    for spec in args.refused:
        pb, db = (int(v) for v in spec.split(":"))
        for connector in args.connectors:
            outcome = try_config(connector, pb, db, args)
            print(f"| prefill {pb} -> decode {db} | {connector}: {outcome} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
