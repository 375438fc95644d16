"""Soak: many concurrent requests through vllm-router, client aborts and injected faults, for a
bounded time; then every completed output must equal the single-process reference, no
block and no NIXL handle may be left, and memory must stay flat.

::

    .venv/bin/python scripts/soak.py [--duration-s 600] [--concurrency 64] [--verify all]

Starts a prefill (block 32), a decode (block 16, drops its first Done) and the router as
separate processes (tests/reliability/cluster.py). Client threads loop until the deadline:
each picks a prompt of random length from a pool and sends it through the router (a
fraction streamed and dropped after the first chunk: a client abort). A fault thread
injects, in turn: tampered params sent straight to decode (must get a 400), a prefill
frozen with SIGSTOP for a second, a decode request whose prefill params name blocks past
prefill's (must be computed locally). At the end it waits for leases to drain and prints
a summary; exit status 0 only when nothing mismatched and nothing leaked.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from kvbridge.examples.check import CORPUS
from kvbridge.examples.launch import MODEL, Cluster, Proc
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.tokenizer import ByteTokenizer

MAX_TOKENS = 6
LEASE_S = 5.0


def prompts(n: int, rng: random.Random) -> list[str]:
    text = CORPUS * 4
    return [text[rng.randrange(97) :][: rng.randint(8, 400)] for _ in range(n)]


def rss_kib(proc: Proc) -> int:
    assert proc.proc is not None
    for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def post(url: str, body: dict, *, abort_after_first_chunk: bool = False) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if abort_after_first_chunk:
            resp.readline()
            return resp.status, {}  # closing the connection aborts the request
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


class Soak:
    def __init__(self, cluster: Cluster, pool: list[str], want: dict[str, list[int]], args):
        self.cluster, self.pool, self.want, self.args = cluster, pool, want, args
        self.counts: Counter[str] = Counter()
        self.mismatches: list[str] = []
        self.lock = threading.Lock()
        self.deadline = time.monotonic() + args.duration_s

    def count(self, what: str, note: str = "") -> None:
        with self.lock:
            self.counts[what] += 1
            if note:
                self.mismatches.append(note)

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        router = self.cluster["router"].url
        while time.monotonic() < self.deadline:
            prompt = rng.choice(self.pool)
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            try:
                if rng.random() < self.args.abort_fraction:
                    status, _ = post(router, {**body, "stream": True}, abort_after_first_chunk=True)
                    self.count("aborted" if status == 200 else f"http_{status}")
                    continue
                status, out = post(router, body)
            except OSError as exc:
                self.count("client_error", f"client error: {exc}")
                continue
            if status != 200:
                self.count(f"http_{status}", f"HTTP {status}: {out.get('error')}")
            elif out["token_ids"] != self.want[prompt]:
                self.count("mismatched", f"tokens differ for a {len(prompt)}-char prompt")
            else:
                self.count("completed")
                u = out["usage"]
                with self.lock:
                    self.counts["tokens_loaded"] += u["loaded_tokens"]

    def faults(self) -> None:
        rng = random.Random(7)
        prefill, decode = self.cluster["prefill"], self.cluster["decode"]
        kinds = ["tampered", "freeze", "foreign_ids"]
        i = 0
        while time.monotonic() < self.deadline - 2:
            time.sleep(self.args.fault_every_s)
            kind = kinds[i % len(kinds)]
            i += 1
            prompt = rng.choice(self.pool)
            if kind == "freeze":
                prefill.signal(signal.SIGSTOP)
                time.sleep(1.0)
                prefill.signal(signal.SIGCONT)
                self.count("fault_freeze")
                continue
            status, out = post(
                prefill.url,
                {
                    "prompt": prompt,
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True},
                },
            )
            if status != 200:
                self.count("fault_setup_failed", f"prefill HTTP {status}")
                continue
            params = out["kv_transfer_params"]
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            if kind == "tampered":
                bad = {**params, "remote_block_ids": [[1, 1]] * len(params["remote_block_ids"])}
                status, _ = post(decode.url, {**body, "kv_transfer_params": bad})
                self.count("fault_tampered", "" if status == 400 else f"tampered got {status}")
                # the genuine params still load
                status, out = post(decode.url, {**body, "kv_transfer_params": params})
            else:
                far = [[10_000 + g] for g in range(len(params["remote_block_ids"]))]
                bad = {**params, "remote_block_ids": far}
                status, out = post(decode.url, {**body, "kv_transfer_params": bad})
                self.count("fault_foreign_ids")
                post(decode.url, {**body, "kv_transfer_params": params})  # release the hold
            if status != 200 or out["token_ids"] != self.want[prompt]:
                self.count("mismatched", f"after a {kind} fault: HTTP {status}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts in the pool")
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--fault-every-s", type=float, default=3.0)
    ap.add_argument("--rss-growth-limit", type=float, default=0.25, help="fraction, per process")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument(
        "--verify",
        choices=["off", "sample", "all"],
        default=None,
        help="decode's extra.verify (all: every load proves its bytes by prefill's digests; "
        "default: the connector's)",
    )
    args = ap.parse_args()

    rng = random.Random(2026)
    pool = prompts(args.prompts, rng)
    model = load_model(MODEL)
    tok = ByteTokenizer()
    want = {
        p: reference_generate(model, tok.encode(p), MAX_TOKENS, eos_id=None).token_ids for p in pool
    }
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvbridge-soak-"))
    cluster = Cluster(
        logs,
        prefill_kv={"lease_s": LEASE_S, "heartbeat_s": 1.0},
        decode_kv={
            "transfer_timeout_s": 10.0,
            **({"extra": {"verify": args.verify}} if args.verify else {}),
        },
        decode_args=["--fault-inject", "drop-done", "--max-num-seqs", "32"],
    )
    try:
        cluster.start()
        # warm up (first contact, first compiles), then take the memory baseline
        for p in pool[:4]:
            post(cluster["router"].url, {"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True})
        rss0 = {n: rss_kib(cluster[n]) for n in ("prefill", "decode")}
        soak = Soak(cluster, pool, want, args)
        threads = [
            threading.Thread(target=soak.client, args=(i,), daemon=True)
            for i in range(args.concurrency)
        ]
        threads.append(threading.Thread(target=soak.faults, daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.duration_s + 180)
        hung = sum(t.is_alive() for t in threads)
        elapsed = time.monotonic() - t0
        leaks = {}
        for n in ("prefill", "decode"):
            try:
                cluster[n].wait_all_free(LEASE_S + 10)
                leaks[n] = 0
            except AssertionError:
                free, total = cluster[n].free_blocks()
                leaks[n] = int(total - free)
        handles = {
            n: int(cluster[n].metrics().get("kvbridge_live_transfer_handles", -1))
            for n in ("prefill", "decode")
        }
        decode_metrics = cluster["decode"].metrics()
        verified = int(decode_metrics.get("kvbridge_loads_verified_total", 0))
        verify_failures = int(decode_metrics.get("kvbridge_load_verify_failures_total", 0))
        rss1 = {n: rss_kib(cluster[n]) for n in ("prefill", "decode")}
        growth = {n: (rss1[n] - rss0[n]) / max(1, rss0[n]) for n in rss0}
        c = soak.counts
        errors = sum(v for k, v in c.items() if k.startswith("http_") or k == "client_error")
        faults = c["fault_tampered"] + c["fault_freeze"] + c["fault_foreign_ids"] + 1  # + drop-done
        print(
            f"SOAK duration={elapsed:.0f}s clients={args.concurrency} "
            f"completed={c['completed']} aborted={c['aborted']} mismatched={c['mismatched']} "
            f"errors={errors} "
            f"faults={faults} (tampered {c['fault_tampered']}, freeze {c['fault_freeze']}, "
            f"foreign ids {c['fault_foreign_ids']}, dropped Done 1) "
            f"tokens_loaded={c['tokens_loaded']} hung_threads={hung} "
            f"leaked_blocks={leaks} live_handles={handles} "
            f"verified={verified} verify_failures={verify_failures} "
            f"rss_kib={rss0}->{rss1}"
        )
        for note in soak.mismatches[:10]:
            print("  " + note)
        ok = (
            c["completed"] > 0
            and not soak.mismatches
            and hung == 0
            and not any(leaks.values())
            and not any(handles.values())
            and verify_failures == 0
            and all(g <= args.rss_growth_limit for g in growth.values())
        )
        print("RESULT: PASS" if ok else "RESULT: FAIL")
        return 0 if ok else 1
    finally:
        cluster.close()


if __name__ == "__main__":
    sys.exit(main())
