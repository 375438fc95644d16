"""A prefill frozen at any point of the protocol costs decode's other requests nothing.

Real processes (prefill, decode, vllm-router; real NIXL over UCX, real HTTP). Decode stops
its prefill (SIGSTOP, ``--fault-inject freeze-peer-at-<point>``, ``examples/faults.py``)
the first time it reaches one point of a load: asking for the description (handshake),
adding its NIXL agent (endpoint creation), sending the claim, posting the READ, sending
``Done``. While the prefill stays frozen and the load waits on it, the same local
requests that ran before on decode run again, streamed and each followed by the same
request on a control server (``tests/streamed_latency.py``): decode's median time to first
token and median gap between tokens, over the control's, stay within 1.5x of the same
figure in the runs with no bad peer (before the fault, and after it cleared), and no call
of decode's engine into kvbridge took longer than ``ENGINE_CALL_BOUND_S``. Then the
prefill runs again and the load ends exactly (every prompt token but the last loaded).
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.examples.check import make_prompts
from kvbridge.examples.faults import FREEZE_POINTS, is_stopped
from kvbridge.examples.launch import MODEL, Cluster
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.tokenizer import ByteTokenizer
from tests.engine_call_bounds import ENGINE_CALL_BOUND_S, slowest_engine_calls
from tests.streamed_latency import (
    LOCAL_REQUESTS,
    Paired,
    control_server,
    paired_latency,
    streamed,
    within_ratio,
)
from tests.verified_loads import verifying

MAX_TOKENS = 4
WAIT_S = 30.0  # decode's handshake and load deadlines: the load outlives the measurement
STOP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


def _wait_stopped(pid: int, what: str) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while not is_stopped(pid):
        assert time.monotonic() < deadline, f"timed out after {STOP_TIMEOUT_S} s: {what}"
        time.sleep(0.05)


def _body(prompt: str, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}


@pytest.mark.parametrize("point", FREEZE_POINTS)
def test_a_prefill_frozen_at_any_point_costs_decode_other_requests_nothing(tmp_path, model, point):
    cluster = Cluster(
        tmp_path,
        prefill_kv={"lease_s": 2 * WAIT_S, "heartbeat_s": 1.0},
        decode_kv=verifying({"transfer_timeout_s": WAIT_S, "handshake_timeout_s": WAIT_S}),
        decode_args=["--fault-inject", f"freeze-peer-at-{point}"],
    )
    cleanup = [cluster.close]
    try:
        cluster.start()
        prefill, decode = cluster["prefill"], cluster["decode"]
        assert prefill.proc is not None
        texts = make_prompts(LOCAL_REQUESTS)
        prompt = make_prompts(LOCAL_REQUESTS + 1)[-1]

        control = control_server(tmp_path)
        cleanup.append(control.kill)

        def local(tag: str) -> Paired:
            # 24-token prompts, none a prefix-cache hit of another (16-token blocks)
            prompts = [f"{tag} {i:02d} {t}"[:24] for i, t in enumerate(texts)]
            return paired_latency(decode.url, control.url, prompts)

        # Each server's very first request (lazy imports, allocator) is not measured: the
        # figure compares the same steady path with and without a bad peer. A cold first
        # request is timed in tests/integration/test_vllm_cold_start.py.
        streamed(decode.url, "first of all, not measured")
        streamed(control.url, "first of all, not measured")
        calm = [local("calm")]
        first = cluster.complete(
            "prefill", _body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        )
        calls_before = decode.metrics()
        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(
                cluster.complete,
                "decode",
                _body(prompt, kv_transfer_params=first["kv_transfer_params"]),
                3 * WAIT_S,
            )
            try:
                _wait_stopped(prefill.proc.pid, f"decode freezing its prefill at {point}")
                if point == "done":  # the load ended: its request runs its last steps
                    load.result(timeout=3 * WAIT_S)
                frozen = local("frozen")
                waiting = not load.done()
                calls_after = decode.metrics()
            finally:
                prefill.signal(signal.SIGCONT)
            out = load.result(timeout=3 * WAIT_S)
        calm.append(local("after"))
    finally:
        for close in cleanup:
            close()
    # the frozen peer was met where meant: the load still waited on it (but at Done, sent
    # once the load ended), and it ended exactly once the peer ran again
    assert waiting != (point == "done")
    want = reference_generate(model, ByteTokenizer().encode(prompt), MAX_TOKENS, eos_id=None)
    assert out["token_ids"] == want.token_ids
    usage = out["usage"]
    assert usage["loaded_tokens"] + usage["cached_tokens"] == usage["prompt_tokens"] - 1, usage
    # decode's engine kept stepping for its other requests
    slowest = slowest_engine_calls(calls_before, calls_after)
    figures = f"frozen at {point}: {frozen}; no bad peer, before and after: {calm[0]}; {calm[1]}"
    print(f"{figures}; slowest engine calls {slowest}")
    assert slowest and max(slowest.values()) <= ENGINE_CALL_BOUND_S, slowest
    assert within_ratio(frozen, calm), figures
