"""Eight new decodes connecting to one prefill at once cost its other requests nothing.

Real processes: one prefill example server, eight decode example servers that have never
met it, and a control server (a plain example server, no connector) beside them. Each
decode is handed a request the prefill kept, all eight at once: eight handshakes reach the
prefill's listener together, and the prefill adds eight new requesters' NIXL agents before
it answers their claims (on its set-up thread, not on its engine's step). Meanwhile the
prefill serves local requests, streamed and each followed by the same request on the
control server (``tests/streamed_latency.py``): the prefill's median time to first token
and median gap, over the control's, stay within 1.5x of the same figures with no new peer
(before, and after), and no call of the prefill's engine into kvbridge took longer than
``ENGINE_CALL_BOUND_S``. Every load then ends exactly (every prompt token but the last
loaded, the tokens a single process generates).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvbridge.examples.check import complete, make_prompts
from kvbridge.examples.launch import MODEL, Proc, worker_args
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

NUM_DECODES = 8
MAX_TOKENS = 4
WAIT_S = 60.0  # every deadline of the loads: 8 servers starting loads on 2 cores


def _server(logs: Path, name: str, role: str, kv: dict) -> Proc:
    argv = [sys.executable, "-m", "kvbridge.examples.server", "--port", "0"]
    return Proc(name, argv + worker_args(role, kv, 16), logs / f"{name}.log")


def _body(prompt: str, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


def test_eight_new_decodes_at_once_cost_the_prefills_other_requests_nothing(tmp_path, model):
    prefill = _server(
        tmp_path,
        "prefill",
        "prefill",
        {"kv_role": "kv_producer", "engine_id": "prefill-8", "kv_port": 0, "lease_s": 2 * WAIT_S},
    )
    decode_kv = verifying(
        {"kv_role": "kv_consumer", "kv_port": 0, "transfer_timeout_s": WAIT_S}
        | {"handshake_timeout_s": WAIT_S}
    )
    decodes = [
        _server(tmp_path, f"decode{i}", "decode", {**decode_kv, "engine_id": f"decode-{i}"})
        for i in range(NUM_DECODES)
    ]
    procs = [prefill, *decodes]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_healthy(timeout_s=120.0)
        control = control_server(tmp_path)
        procs.append(control)
        texts = make_prompts(LOCAL_REQUESTS)
        prompts = make_prompts(LOCAL_REQUESTS + NUM_DECODES)[LOCAL_REQUESTS:]

        def local(tag: str) -> Paired:
            # 24-token prompts, none a prefix-cache hit of another (16-token blocks)
            return paired_latency(
                prefill.url, control.url, [f"{tag} {i:02d} {t}"[:24] for i, t in enumerate(texts)]
            )

        # each server's very first request is not measured (see test_frozen_points.py)
        streamed(prefill.url, "first of all, not measured")
        streamed(control.url, "first of all, not measured")
        calm = [local("calm")]
        kept = [
            complete(
                prefill.url,
                _body(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                WAIT_S,
            )["kv_transfer_params"]
            for p in prompts
        ]
        calls_before = prefill.metrics()
        with ThreadPoolExecutor(NUM_DECODES) as pool:
            loads = [
                pool.submit(complete, d.url, _body(p, kv_transfer_params=params), 3 * WAIT_S)
                for d, p, params in zip(decodes, prompts, kept, strict=True)
            ]
            connecting = local("connecting")
            outs = [f.result(timeout=3 * WAIT_S) for f in loads]
        calls_after = prefill.metrics()
        calm.append(local("after"))
    finally:
        for p in procs:
            p.kill()
    for prompt, out in zip(prompts, outs, strict=True):
        want = reference_generate(model, ByteTokenizer().encode(prompt), MAX_TOKENS, eos_id=None)
        assert out["token_ids"] == want.token_ids
        usage = out["usage"]
        assert usage["loaded_tokens"] == usage["prompt_tokens"] - 1, usage
    slowest = slowest_engine_calls(calls_before, calls_after)
    figures = (
        f"{NUM_DECODES} decodes connecting: {connecting}; before and after: {calm[0]}; {calm[1]}"
    )
    print(f"{figures}; slowest engine calls {slowest}")
    assert slowest and max(slowest.values()) <= ENGINE_CALL_BOUND_S, slowest
    assert within_ratio(connecting, calm), figures
