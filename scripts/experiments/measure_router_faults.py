"""What a client sees when a worker fails behind vllm-router, measured (docs/operator.md).

Starts a prefill (block 32), a decode (block 16) and vllm-router in P/D mode in front of
them (``examples/launch.py``; the router health-checks every second), keeps CLIENTS
clients sending requests back to back, and per scenario injects one fault at t = FAULT_AT:

    prefill-killed   SIGKILL prefill; restart it on the same HTTP port after DOWN_S
    prefill-frozen   SIGSTOP prefill for DOWN_S, then SIGCONT
    decode-killed    SIGKILL decode; restart it on the same HTTP port after DOWN_S

(the router knows workers by URL, so a restarted worker takes the HTTP port it had; its
side channel binds a new ephemeral port, which its kv_transfer_params advertise). Prints,
per scenario, the answers by HTTP status before, during and after the fault, the first
error texts, and the seconds from the fault (and from the restart) to the first good
answer and to the last failed one::

    python scripts/experiments/measure_router_faults.py [--scenario prefill-killed] [--down 5]
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvbridge.examples.check import make_prompts
from kvbridge.examples.launch import Cluster

SCENARIOS = ("prefill-killed", "prefill-frozen", "decode-killed")


@dataclass
class Answer:
    sent: float
    took: float
    status: int  # 0: no HTTP answer
    error: str


def post(url: str, body: dict, timeout_s: float) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, "" if resp.status == 200 else raw[:160].decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def fixed_port(argv: list[str], port: int) -> list[str]:
    out = list(argv)
    out[out.index("--port") + 1] = str(port)
    return out


def run(scenario: str, args: argparse.Namespace, logs: Path) -> dict:
    cluster = Cluster(
        logs / scenario, prefill_kv={"lease_s": 10.0}, decode_kv={"transfer_timeout_s": 5.0}
    )
    (logs / scenario).mkdir(parents=True)
    answers: list[Answer] = []
    stop = threading.Event()
    prompts = make_prompts(16)
    marks: dict[str, float] = {}
    try:
        cluster.start()
        url = cluster["router"].url
        t0 = time.monotonic()

        def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                body = {
                    "prompt": prompts[(i + n) % len(prompts)] + f" #{i}.{n}",
                    "max_tokens": 4,
                    "ignore_eos": True,
                }
                sent = time.monotonic() - t0
                status, error = post(url, body, args.timeout)
                answers.append(Answer(sent, time.monotonic() - t0 - sent, status, error))
                n += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(args.fault_at)  # the clients run meanwhile; this is the schedule
        name = "prefill" if scenario.startswith("prefill") else "decode"
        proc = cluster[name]
        marks["fault"] = time.monotonic() - t0
        if scenario == "prefill-frozen":
            proc.signal(signal.SIGSTOP)
            time.sleep(args.down)
            proc.signal(signal.SIGCONT)
        else:
            port = proc.ready["port"]
            proc.kill()
            time.sleep(args.down)
            proc.argv = fixed_port(proc.argv, port)
            proc.start()
            proc.wait_healthy(120)
        marks["back"] = time.monotonic() - t0
        time.sleep(args.after)
        stop.set()
        for t in threads:
            t.join(args.timeout + 5)
    finally:
        stop.set()
        cluster.close()
    return summarize(scenario, answers, marks)


def summarize(scenario: str, answers: list[Answer], marks: dict[str, float]) -> dict:
    fault, back = marks["fault"], marks["back"]

    def phase(a: Answer) -> str:
        end = a.sent + a.took
        if end < fault:
            return "before"
        return "during" if a.sent < back else "after"

    by_phase = {
        p: Counter(a.status for a in answers if phase(a) == p)
        for p in ("before", "during", "after")
    }
    failed = [a for a in answers if a.status != 200 and a.sent + a.took >= fault]
    good_after_back = [a for a in answers if a.status == 200 and a.sent >= back]
    errors = Counter(f"{a.status}: {a.error[:100]}" for a in failed)
    return {
        "scenario": scenario,
        "fault_at_s": round(fault, 2),
        "back_at_s": round(back, 2),
        "answers": {p: dict(c) for p, c in by_phase.items()},
        "last_failure_after_fault_s": round(
            max((a.sent + a.took for a in failed), default=fault) - fault, 2
        ),
        "first_good_after_back_s": round(
            min((a.sent + a.took for a in good_after_back), default=float("nan")) - back, 2
        ),
        "longest_failed_wait_s": round(max((a.took for a in failed), default=0.0), 2),
        "errors": dict(errors.most_common(4)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=SCENARIOS, action="append")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--fault-at", type=float, default=5.0)
    parser.add_argument("--down", type=float, default=5.0, help="seconds dead or frozen")
    parser.add_argument("--after", type=float, default=15.0, help="seconds measured after")
    parser.add_argument("--timeout", type=float, default=30.0, help="each request's")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvbridge-router-faults-") as tmp:
        for scenario in args.scenario or SCENARIOS:
            print(json.dumps(run(scenario, args, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
