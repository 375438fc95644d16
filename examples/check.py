"""End-to-end check of a prefill/decode pair behind vllm-router (used by the shell scripts).

::

    python -m kvbridge.examples.check wait --timeout 60 \\
        --url http://127.0.0.1:8100/health --pid 4242
    python -m kvbridge.examples.check run --router http://127.0.0.1:8000 \\
        --decode http://127.0.0.1:8200 --model tiny-hybrid --num-prompts 8 --max-tokens 16

``run`` sends prompts through the router in two waves (the second extends prompts of the
first, so both workers see local prefix hits and decode loads only the rest), runs the
same prompts through :mod:`kvbridge.examples.reference` on ``--device`` (the workers' own), and
exits 0 only when every generated token matches and every per-step logit agrees within
``--atol``. It prints a summary read from decode's ``/metrics`` and a final
machine-readable ``SUMMARY`` line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

from kvbridge.connector.common.metrics import parse_metrics

CORPUS = (
    "Large-model serving splits a request in two: a prefill worker computes the KV cache "
    "of the prompt, and a decode worker generates the answer from it. The connector moves "
    "the cache between them, splitting and merging blocks, permuting NHD and HND layouts, "
    "and keeping only what sliding-window and state layers need. "
)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    ok: bool
    max_diff: float  # over the steps both runs have; inf when shapes disagree
    reason: str = ""


def compare(
    got_tokens: list[int], got_logits: np.ndarray, want_tokens: list[int], want_logits, atol
) -> Verdict:
    """Tokens must be equal; logits within ``atol`` (NaN never agrees)."""
    got_logits, want_logits = np.asarray(got_logits), np.asarray(want_logits)
    n = min(len(got_logits), len(want_logits))
    if n and got_logits.shape[1:] != want_logits.shape[1:]:
        return Verdict(ok=False, max_diff=math.inf, reason="logit rows differ in width")
    diff = np.abs(got_logits[:n] - want_logits[:n]) if n else np.zeros(0)
    max_diff = float(np.nan_to_num(diff, nan=math.inf).max()) if diff.size else 0.0
    if got_tokens != want_tokens:
        step = next(
            (i for i, (a, b) in enumerate(zip(got_tokens, want_tokens, strict=False)) if a != b),
            min(len(got_tokens), len(want_tokens)),
        )
        got = got_tokens[step] if step < len(got_tokens) else "end"
        want = want_tokens[step] if step < len(want_tokens) else "end"
        reason = f"token mismatch at step {step}: got {got}, want {want}"
        return Verdict(ok=False, max_diff=max_diff, reason=reason)
    if len(got_logits) != len(want_tokens):
        reason = f"{len(got_logits)} logit rows for {len(want_tokens)} tokens"
        return Verdict(ok=False, max_diff=max_diff, reason=reason)
    if not max_diff < atol:
        return Verdict(ok=False, max_diff=max_diff, reason=f"logit mismatch: {max_diff:.3g}")
    return Verdict(ok=True, max_diff=max_diff)


def make_prompts(num_prompts: int) -> list[str]:
    """Deterministic prompts of varied lengths; the second half extends the first half."""
    text = CORPUS * 3
    first = (num_prompts + 1) // 2
    base = [text[(i * 53) % 97 :][: 20 + (i * 71) % 170] for i in range(first)]
    more = [
        base[i % first] + f" Question {i}: " + text[i * 13 :][:40]
        for i in range(first, num_prompts)
    ]
    return base + more


def _url(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80, parts.path or "/"


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    host, port, path = _url(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def complete(url: str, body: dict, timeout_s: float) -> dict:
    """POST a completion; a streamed answer is folded into one dict like the plain one."""
    host, port, _ = _url(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if not body.get("stream") or resp.status != 200:
            raw = resp.read()
            out = json.loads(raw) if raw else {}
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {out.get('error', raw[:200])}")
            return out
        merged: dict = {"token_ids": [], "logits": [], "chunks": 0}
        while line := resp.readline():
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            merged["chunks"] += 1
            merged["token_ids"] += chunk["token_ids"]
            merged["logits"] += chunk.get("logits", [])
            merged.update({k: v for k, v in chunk.items() if k in ("usage", "finish_reason")})
        return merged
    finally:
        conn.close()


def scrape(worker_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """A worker's ``/metrics``, parsed (:func:`parse_metrics`)."""
    status, raw = http_get(worker_url.rstrip("/") + "/metrics", timeout_s)
    if status != 200:
        raise RuntimeError(f"{worker_url}/metrics: HTTP {status}")
    return parse_metrics(raw.decode())


def blocks_in_use(worker_url: str, timeout_s: float = 10.0) -> int:
    """Blocks a worker still holds once every request is answered; leases and Done
    notifications may lag, so wait up to ``timeout_s`` for them to drain."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            metrics = scrape(worker_url)
        except (OSError, RuntimeError):
            return -1
        used = int(
            metrics['kvbridge_total_blocks{pool="kv"}'] - metrics['kvbridge_free_blocks{pool="kv"}']
        )
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def wait_ready(urls: list[str], pids: list[int], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        for pid in pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                print(f"process {pid} exited before becoming healthy", file=sys.stderr)
                return 1
        try:
            status, _ = http_get(pending[0], timeout_s=1.0)
        except OSError:
            status = 0
        if status == 200:
            pending.pop(0)
            continue
        if time.monotonic() > deadline:
            print(f"timeout: {pending[0]} not healthy after {timeout_s:.0f} s", file=sys.stderr)
            return 1
        time.sleep(0.1)
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    from kvbridge.examples.device import DeviceError, parse_device
    from kvbridge.examples.reference import load_model, reference_generate
    from kvbridge.examples.tokenizer import ByteTokenizer

    torch.set_num_threads(1)
    try:
        device = parse_device(args.device)
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = make_prompts(args.num_prompts)
    tok = ByteTokenizer()
    model = load_model(args.model, device)

    def one(i: int) -> tuple[str, dict | Exception]:
        # Mix the request shapes: text or token ids, plain or streamed.
        prompt = prompts[i] if i % 3 else tok.encode(prompts[i])
        body = {
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "return_logits": True,
            "stream": i % 4 == 1,
            "ignore_eos": True,
        }
        try:
            return prompts[i], complete(args.router, body, args.timeout)
        except (OSError, RuntimeError, ValueError) as exc:
            return prompts[i], exc

    first = (len(prompts) + 1) // 2
    results = []
    with ThreadPoolExecutor(args.concurrency) as pool:
        for wave in (range(first), range(first, len(prompts))):
            results += list(pool.map(one, wave))
    matched, worst = 0, 0.0
    loaded_total, expected_total, short = 0, 0, 0
    if args.show_answers:
        print_plan(args.prefill, args.decode)
        print(
            f"answers: the token ids {args.model} generated for each prompt through the router "
            "(P/D) beside the single-process reference's; exact = every id equal and every "
            f"logit within {args.atol:g} (random weights: as text the ids are noise)"
        )
    for i, (prompt, answer) in enumerate(results):
        ids = tok.encode(prompt)
        want = reference_generate(model, ids, args.max_tokens, eos_id=None)
        if isinstance(answer, Exception):
            print(f"  prompt {i}: request failed: {answer}")
            continue
        verdict = compare(
            answer["token_ids"],
            np.asarray(answer["logits"], np.float32),
            want.token_ids,
            want.logits,
            args.atol,
        )
        worst = max(worst, verdict.max_diff)
        usage = answer.get("usage", {})
        # decode computes only the last prompt token: every other one is loaded or cached
        loaded = int(usage.get("loaded_tokens") or 0)
        expected = len(ids) - 1 - int(usage.get("cached_tokens") or 0)
        loaded_total, expected_total = loaded_total + loaded, expected_total + expected
        if loaded != expected:
            short += 1
            print(
                f"  TOKENS LEFT BEHIND prompt {i} ({len(ids)} tokens, "
                f"{usage.get('cached_tokens')} cached): loaded {loaded}, expected {expected}"
            )
        if args.show_answers:
            print(answer_lines(i, len(ids), answer, verdict, want.token_ids))
        if verdict.ok:
            matched += 1
        else:
            print(
                f"  MISMATCH prompt {i} ({len(ids)} tokens, loaded {usage.get('loaded_tokens')}, "
                f"cached {usage.get('cached_tokens')}): {verdict.reason}"
            )
    leaked = {
        name: blocks_in_use(url)
        for name, url in (("prefill", args.prefill), ("decode", args.decode))
        if url
    }
    metrics, prefill_metrics = _metrics(args.decode, "decode"), _metrics(args.prefill, "prefill")
    bytes_read = int(metrics.get("kvbridge_bytes_read_total", 0))
    seconds = metrics.get("kvbridge_transfer_seconds_total", 0.0)
    # pull: decode posts the READs; push: prefill posts the WRITEs
    descs = int(metrics.get("kvbridge_descriptors_posted_total", 0)) + int(
        prefill_metrics.get("kvbridge_descriptors_posted_total", 0)
    )
    transfers = int(metrics.get("kvbridge_transfers_total", 0))
    failures = int(metrics.get("kvbridge_transfer_failures_total", 0))
    # loads that proved their bytes by prefill's digests (decode's extra.verify), and
    # those whose bytes differed (failed, so recomputed: they count as loads short)
    verified = int(metrics.get("kvbridge_loads_verified_total", 0))
    verify_failures = int(metrics.get("kvbridge_load_verify_failures_total", 0))
    n = len(prompts)
    print(f"prompts matched: {matched}/{n}   max |logit diff|: {worst:.3g} (atol {args.atol})")
    print(
        f"transfers: {transfers} (failures {failures})   bytes moved: {bytes_read} "
        f"({bytes_read / 2**20:.2f} MiB)   transfer time: {seconds * 1e3:.1f} ms   "
        f"descriptors: {descs}   verified: {verified} (failures {verify_failures})"
    )
    if leaked:
        print("blocks in use after the run: " + ", ".join(f"{k} {v}" for k, v in leaked.items()))
    print(f"prompt tokens loaded: {loaded_total} of the {expected_total} decode did not cache")
    ok = matched == n and short == 0 and not any(leaked.values())
    print(
        "RESULT: PASS"
        if ok
        else f"RESULT: FAIL (mismatch in {n - matched} of {n} prompts, {short} loads short)"
    )
    print(
        f"SUMMARY matched={matched}/{n} loaded={loaded_total}/{expected_total} "
        f"bytes={bytes_read} transfer_ms={seconds * 1e3:.2f} "
        f"descriptors={descs} transfers={transfers} max_diff={worst:.3g} "
        f"verified={verified} verify_failures={verify_failures}"
    )
    return 0 if ok else 1


def answer_lines(
    index: int, num_prompt_tokens: int, answer: dict, verdict: Verdict, want: list[int]
) -> str:
    """One prompt for a reader: the verdict, then the ids of ``answer`` (a completion) over
    the reference's ``want``, so that equal columns show equal tokens."""
    usage = answer.get("usage", {})
    word = "exact" if verdict.ok else f"differs ({verdict.reason})"
    return (
        f"  prompt {index} ({num_prompt_tokens} tokens: {usage.get('loaded_tokens')} loaded "
        f"from prefill, {usage.get('cached_tokens')} cached by decode): {word}, "
        f"max |logit diff| {verdict.max_diff:.2g}\n"
        f"    P/D        {_ids(answer['token_ids'])}\n"
        f"    reference  {_ids(want)}"
    )


def _ids(token_ids: list[int]) -> str:
    return " ".join(f"{t:3d}" for t in token_ids)


def print_plan(prefill_url: str | None, decode_url: str | None) -> None:
    """The plan decode computed against prefill, in words (:mod:`kvbridge.examples.plan_words`),
    from the two workers' side channels (their ``/health`` names the ports)."""
    from kvbridge.examples.plan_words import decode_plan, fetch_description, plan_words
    from kvbridge.layouts.errors import KVBridgeError

    if not prefill_url or not decode_url:
        print("plan: unknown (give --prefill and --decode)")
        return
    try:
        descs = []
        for url in (prefill_url, decode_url):
            status, raw = http_get(url.rstrip("/") + "/health")
            if status != 200:
                raise RuntimeError(f"{url}/health: HTTP {status}")
            descs.append(fetch_description(_url(url)[0], int(json.loads(raw)["kv_port"])))
        prefill, decode = descs
        lines = plan_words(prefill, decode, decode_plan(prefill, decode))
    except (OSError, RuntimeError, KeyError, ValueError, KVBridgeError) as exc:
        print(f"plan: unknown ({exc})")
        return
    print("the plan, in words (decode's handshake with prefill computed it):")
    print("\n".join(f"  {line}" for line in lines))


def _metrics(url: str | None, name: str) -> dict[str, float]:
    if not url:
        return {}
    try:
        return scrape(url)
    except (OSError, RuntimeError) as exc:
        print(f"  ({name} /metrics unreadable: {exc})")
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvbridge end-to-end check")
    sub = parser.add_subparsers(dest="cmd", required=True)
    wait = sub.add_parser("wait", help="wait until every URL answers 200")
    wait.add_argument("--url", action="append", default=[])
    wait.add_argument("--pid", action="append", type=int, default=[])
    wait.add_argument("--timeout", type=float, default=60.0)
    check = sub.add_parser("run", help="send prompts through the router and compare")
    check.add_argument("--router", required=True, help="the front door's URL")
    check.add_argument("--decode", default=None, help="decode worker URL (for /metrics)")
    check.add_argument("--prefill", default=None, help="prefill worker URL (for /metrics)")
    check.add_argument("--model", default="tiny-hybrid")
    check.add_argument("--num-prompts", type=int, default=8)
    check.add_argument("--max-tokens", type=int, default=16)
    check.add_argument("--atol", type=float, default=1e-4)
    check.add_argument("--concurrency", type=int, default=4)
    check.add_argument("--timeout", type=float, default=120.0)
    check.add_argument("--show-answers", action="store_true")
    check.add_argument(
        "--device", default="cpu", help="where the reference runs: cpu, cuda or cuda:N"
    )
    args = parser.parse_args(argv)
    if args.cmd == "wait":
        return wait_ready(args.url, args.pid, args.timeout)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
