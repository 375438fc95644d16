"""The example HTTP server (role "both", in process): bad input gets a 4xx JSON reason,
never a crash, and the server keeps serving. (The front door is vllm-router:
tests/integration/test_router.py.)"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.connector.common.metrics import parse_metrics
from kvbridge.examples.check import compare, complete, http_get, make_prompts
from kvbridge.examples.engine_loop import EngineLoop
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.server import WorkerHTTPServer
from kvbridge.examples.tokenizer import ByteTokenizer
from kvbridge.examples.worker_setup import build, make_parser

MODEL = "tiny-hybrid-state"


def _serve(server) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def worker_url():
    argv = f"--model {MODEL} --block-size 16 --kernel-block-size 8 --num-blocks 64 --device cpu"
    args = make_parser().parse_args([*argv.split(), "--kv-layout", "HND", "--cross-layers"])
    loop, info = build(args)
    assert isinstance(loop, EngineLoop)
    loop.start()  # builds the engine on its own thread
    server = WorkerHTTPServer(("127.0.0.1", 0), loop, info, request_timeout_s=30)
    thread = _serve(server)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()
    loop.close()
    loop.engine.pool.assert_all_free()


def post_raw(url: str, data: bytes, path: str = "/v1/completions", headers=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, data, headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def post(url: str, body: dict, path: str = "/v1/completions"):
    return post_raw(url, json.dumps(body).encode(), path)


def test_completion_matches_reference_plain_and_streamed(worker_url):
    prompt = make_prompts(3)[2]
    want = reference_generate(load_model(MODEL), ByteTokenizer().encode(prompt), 6, eos_id=None)
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 6, "return_logits": True, "stream": stream}
        out = complete(worker_url, {**body, "ignore_eos": True}, timeout_s=30)
        got = np.asarray(out["logits"], np.float32)
        verdict = compare(out["token_ids"], got, want.token_ids, want.logits, 1e-4)
        assert verdict.ok, verdict.reason
        assert out["finish_reason"] == "length"
        if stream:
            assert out["chunks"] == 6  # one server-sent event per token
    status, out = post(worker_url, {"prompt": prompt, "max_tokens": 3, "logprobs": 2})
    assert status == 200 and len(out["logprobs"]) == 3
    top = out["logprobs"][0]
    assert top[0][0] == out["token_ids"][0] and top[0][1] >= top[1][1]


BAD_REQUESTS = [
    (b"not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "Expected `object`"),
    (b"{}", 400, "missing required field `prompt`"),
    (b'{"prompt": ""}', 400, "prompt is empty"),
    (b'{"prompt": []}', 400, "length >= 1"),
    (b'{"prompt": [1, 2, 999]}', 400, "outside the vocabulary"),
    (b'{"prompt": [1, -2]}', 400, ">= 0"),
    (b'{"prompt": [1, 999], "stream": true}', 400, "outside the vocabulary"),
    (b'{"prompt": "hi", "temperature": 0.7}', 400, "greedy"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": "8"}', 400, "Expected `int`, got `str`"),
    (b'{"prompt": "hi", "max_tokens": 4000}', 400, "blocks of 16 tokens"),
    (b'{"prompt": "hi", "model": "gpt-5"}', 400, "not served here"),
    (b'{"prompt": "hi", "logprobs": 99}', 400, "logprobs"),
    (b'{"prompt": "hi", "kv_transfer_params": {"x": 1}}', 400, "unknown field `x`"),
    (b'{"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": true}}', 400, "connector"),
]


@pytest.mark.parametrize(("data", "status", "reason"), BAD_REQUESTS)
def test_bad_requests_get_4xx_with_a_reason_and_the_server_keeps_serving(
    worker_url, data, status, reason
):
    got_status, body = post_raw(worker_url, data)
    assert got_status == status
    assert reason in body["error"]
    ok_status, ok = post(worker_url, {"prompt": "still there?", "max_tokens": 2})
    assert ok_status == 200 and len(ok["token_ids"]) == 2


def test_health_reports_the_device(worker_url):
    status, raw = http_get(worker_url + "/health")
    assert status == 200
    assert json.loads(raw) == {
        "status": "ok",
        "model": MODEL,
        "role": "both",
        "device": "cpu",
    }


def test_wrong_paths_and_sizes(worker_url):
    assert post(worker_url, {"prompt": "x"}, path="/v1/chat")[0] == 404
    assert http_get(worker_url + "/nope")[0] == 404
    status, body = post_raw(worker_url, b"x" * 10, headers={"Content-Length": str(2 << 20)})
    assert status == 413 and "exceeds" in body["error"]
    assert http_get(worker_url + "/health")[0] == 200


def test_concurrent_requests_and_metrics(worker_url):
    prompts = make_prompts(6)

    def one(p: str) -> dict:
        return complete(worker_url, {"prompt": p, "max_tokens": 5, "ignore_eos": True}, 30)

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(one, prompts))
    for p, out in zip(prompts, outs, strict=True):
        want = reference_generate(load_model(MODEL), ByteTokenizer().encode(p), 5, eos_id=None)
        assert out["token_ids"] == want.token_ids
    status, raw = http_get(worker_url + "/metrics")
    metrics = parse_metrics(raw.decode())
    assert status == 200
    assert metrics['kvbridge_total_blocks{pool="kv"}'] == 64
    assert metrics['kvbridge_requests{state="running"}'] == 0
    assert metrics['kvbridge_requests_finished_total{reason="length"}'] >= 6
    families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    assert families["kvbridge_requests_finished"].type == "counter"  # exposed with _total
    assert families["kvbridge_free_blocks"].type == "gauge"
    assert all(f.documentation for f in families.values()), "every metric has HELP text"


def test_compare_flags_token_and_logit_mismatches():
    logits = np.zeros((3, 5), np.float32)
    assert compare([1, 2, 3], logits, [1, 2, 3], logits, 1e-4).ok
    bad = compare([1, 4, 3], logits, [1, 2, 3], logits, 1e-4)
    assert not bad.ok and "step 1: got 4, want 2" in bad.reason
    moved = logits.copy()
    moved[2, 1] = 1e-3
    assert "logit mismatch" in compare([1, 2, 3], moved, [1, 2, 3], logits, 1e-4).reason
    moved[2, 1] = np.nan
    assert not compare([1, 2, 3], moved, [1, 2, 3], logits, 1e-4).ok
    assert "end" in compare([1, 2], logits[:2], [1, 2, 3], logits, 1e-4).reason


def _finished(url: str) -> dict[str, float]:
    m = parse_metrics(http_get(url + "/metrics")[1].decode())
    return {
        r: m.get(f'kvbridge_requests_finished_total{{reason="{r}"}}', 0.0)
        for r in ("abort", "length")
    } | {
        "running": m['kvbridge_requests{state="running"}'],
        "used": m['kvbridge_total_blocks{pool="kv"}'] - m['kvbridge_free_blocks{pool="kv"}'],
    }


def _wait_for(what: str, check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.02)
    return value


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_its_request_and_frees_its_blocks(worker_url, stream):
    before = _finished(worker_url)
    host, port = worker_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    # 250 tokens take seconds on the tiny model: the abort comes long before "length"
    body = {"prompt": "a long answer, please", "max_tokens": 250, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": stream}))
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    else:
        _wait_for("the request to run", lambda: _finished(worker_url)["running"] == 1)
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-answer
    conn.close()
    after = _wait_for(
        "the abort",
        lambda: (m := _finished(worker_url))["abort"] == before["abort"] + 1 and m,
    )
    assert after["length"] == before["length"]
    assert after["running"] == 0 and after["used"] == 0
